// Run a node: the command that connects a GPU to this gateway, and the signed-in user's own nodes.

import {
  api, displayStatus, fieldError, h, loadConfig, renderSignIn, showAlert, showSession, startClock, statusBadge,
  timeAgo, usd, wireCopy,
} from './common.js';

const $ = (id) => document.getElementById(id);
const BACKEND = 'http://127.0.0.1:8000';
// The regions the map places a node in, at a city each when it has no coordinates of its own: those
// of neuralgrid/protocol/regions.py (tests/web/test_operator_page.py holds them equal).
const REGIONS = [
  ['us-east', 'Ashburn'], ['us-west', 'San Jose'], ['eu-west', 'London'], ['eu-central', 'Frankfurt'],
  ['ap-northeast', 'Tokyo'], ['ap-southeast', 'Singapore'], ['ap-south', 'Mumbai'], ['sa-east', 'São Paulo'],
  ['oceania', 'Sydney'], ['af-south', 'Johannesburg'],
];

/** A word the shell passes through unchanged: bare when safe, else in single quotes. */
function shellWord(text) {
  return /^[\w@%+=:,./-]+$/.test(text) ? text : `'${text.replaceAll("'", "'\\''")}'`;
}

/** A path as shellWord() gives it, a leading ~/ left to the shell to expand, as it expanded the one
 * on the server's own command line (which names the model by it). */
function pathWord(text) {
  return text.startsWith('~/') ? `~/${shellWord(text.slice(2))}` : shellWord(text);
}

/** The command for the form's values; bad fields are marked and shown as placeholders. */
function renderCommand() {
  const name = $('node-name');
  const region = $('node-region');
  const price = $('node-price');
  const token = $('node-token');
  const alias = $('node-alias');
  const nameText = name.value.trim();
  const regionText = region.value.trim();
  const priceText = price.value.trim().replace(/^\$/, '');
  const tokenText = token.value.trim();
  const aliasText = alias.value.trim();
  const nameOk = fieldError(name, nameText ? null : 'Give the node a name (1 to 100 characters), like my-4090.');
  const regionOk = fieldError(region, regionText ? null : 'Give a region, like eu-west or us-east.');
  const priceOk = fieldError(price, /^\d+(\.\d+)?$/.test(priceText) ? null : 'The price is USD per hour, 0 or more, like 0.30.');
  fieldError(token, tokenText && !tokenText.startsWith('ng-') ? 'NeuralGrid API keys start with ng-: create one on the API keys page.' : null);
  const aliasOk = fieldError(alias, !aliasText || /^[^=]+=[^=]+$/.test(aliasText) ? null : 'The file as your server names the model, =, and the catalog id, like smollm2.gguf=HuggingFaceTB/SmolLM2-135M-Instruct.');
  const city = REGIONS.find(([region]) => region === regionText)?.[1];
  $('node-region-place').textContent = !regionOk ? ''
    : city ? `On the map at ${city}.`
    : `Not one of the map's regions: add --latitude and --longitude to place the node on it.`;
  const parts = [
    'neuralgrid node run',
    `--gateway ${shellWord(location.origin)}`,
    `--backend ${BACKEND}`,
    ...(aliasText ? [`--model-alias ${aliasOk ? pathWord(aliasText) : '<file>=<catalog id>'}`] : []),
    `--name ${nameOk ? shellWord(nameText) : '<name>'}`,
    `--region ${regionOk ? shellWord(regionText) : '<region>'}`,
    `--price ${priceOk ? priceText : '<USD per hour>'}`,
    '--tunnel',
  ];
  // The key in the environment, not on the command line, where `ps` shows it to the machine's users.
  const key = `export NEURALGRID_NODE_TOKEN=${tokenText ? shellWord(tokenText) : '<your API key>'}`;
  $('command').textContent = `${key}\n${parts.join(' \\\n    ')}`;
}

async function showMyNodes(cfg) {
  const session = await showSession(cfg);
  if (!session) {
    $('mine-signin').hidden = false;
    renderSignIn($('mine-signin'), cfg);
    return;
  }
  try {
    const { data } = await api('/api/my/nodes', { token: session.access_token });
    $('mine-body').replaceChildren(...data.map((n) => h('tr', { 'data-id': n.id },
      h('td', { 'data-label': 'Status' }, statusBadge(displayStatus(n))),
      h('th', { scope: 'row', 'data-label': 'Node' }, n.name),
      h('td', { 'data-label': 'GPU' }, `${n.gpu_count} × ${n.gpu_model}`),
      h('td', { class: 'num', 'data-label': '$/h' }, usd(n.hourly_rate)),
      h('td', { 'data-label': 'Region' }, n.region),
      h('td', { class: 'num', 'data-label': 'Load' }, `${n.inflight}/${n.max_concurrency}`),
      h('td', { 'data-label': 'Reputation' }, `${n.successes} ok / ${n.failures} failed`),
      h('td', { 'data-label': 'Last heartbeat' }, timeAgo(n.last_heartbeat_at)))));
    $('mine-empty').hidden = data.length > 0;
    $('mine').hidden = false;
  } catch (err) {
    if (err.status === 401) {
      $('mine-signin').hidden = false;
      renderSignIn($('mine-signin'), cfg, { reason: `Your session has ended (${err.message}). Sign in again.` });
    } else {
      showAlert($('mine-error'), `Could not load your nodes: ${err.message}`);
    }
  }
}

async function main() {
  startClock();
  $('regions').replaceChildren(...REGIONS.map(([region, city]) => h('option', { value: region }, city)));
  $('node-form').addEventListener('input', renderCommand);
  $('node-form').addEventListener('submit', (event) => event.preventDefault());
  wireCopy($('copy-command'), () => $('command').textContent);
  renderCommand();
  try {
    await showMyNodes(await loadConfig());
  } catch (err) {
    showAlert($('mine-error'), `Cannot reach the gateway: ${err.message}`);
  }
}

main();
