// API keys: list, create and revoke the signed-in user's keys through the gateway's /v1/keys.

import {
  api, enterSignedIn, fieldError, h, showAlert, showSignIn, startClock, timeAgo, usd, wireCopy,
} from './common.js';

const $ = (id) => document.getElementById(id);
const SDK_MODEL = 'meta-llama/Llama-3.1-8B-Instruct';
let cfg = null;
let session = null;

/** Any call that finds the session gone (expired, or signed out elsewhere) asks to sign in again. */
async function call(path, options = {}) {
  try {
    return await api(path, { ...options, token: session.access_token });
  } catch (err) {
    if (err.status === 401) {
      session = null;
      showSignIn(cfg, `Your session has ended (${err.message}). Sign in again.`);
    }
    throw err;
  }
}

// The list --------------------------------------------------------------------------------------------

function limits(key) {
  const parts = [];
  if (key.rpm_limit) parts.push(`${key.rpm_limit} req/min`);
  if (key.tpm_limit) parts.push(`${key.tpm_limit} tokens/min`);
  return parts.length ? parts.join(', ') : 'none';
}

function spend(key) {
  const spent = usd(key.spent_usd, 4);
  if (key.budget_usd === null) return `${spent} (no budget)`;
  // A zero budget allows nothing: show it full.
  const full = key.budget_usd > 0 ? key.budget_usd : 1;
  const used = key.budget_usd > 0 ? Math.min(key.spent_usd, key.budget_usd) : 1;
  const meter = h('meter', { min: '0', max: String(full), value: String(used), 'aria-hidden': 'true' });
  return [meter, ` ${spent} of ${usd(key.budget_usd)}`];
}

function stateCell(key) {
  if (key.revoked_at) return h('span', { class: 'muted' }, 'revoked ', timeAgo(key.revoked_at));
  const revoke = h('button', { type: 'button', class: 'danger', 'aria-label': `Revoke ${key.name}` }, 'Revoke');
  const cancel = h('button', { type: 'button', hidden: true }, 'Cancel');
  // Two steps: a revoked key cannot be restored, and apps using it stop working within a second.
  revoke.addEventListener('click', async () => {
    if (!revoke.classList.contains('confirm')) {
      revoke.classList.add('confirm');
      revoke.textContent = 'Confirm revoke';
      revoke.setAttribute('aria-label', `Confirm: revoke ${key.name}`);
      cancel.hidden = false;
      return;
    }
    revoke.disabled = true;
    try {
      await call(`/v1/keys/${encodeURIComponent(key.id)}`, { method: 'DELETE' });
      showAlert($('keys-status'), `Revoked "${key.name}". Requests with it are refused from now on.`);
      await refresh();
      $('keys-title').focus();
    } catch (err) {
      revoke.disabled = false;
      showAlert($('keys-error'), `Could not revoke "${key.name}": ${err.message}`);
    }
  });
  cancel.addEventListener('click', () => {
    revoke.classList.remove('confirm');
    revoke.textContent = 'Revoke';
    revoke.setAttribute('aria-label', `Revoke ${key.name}`);
    cancel.hidden = true;
    revoke.focus();
  });
  return h('span', { class: 'row-actions' }, revoke, cancel);
}

async function refresh() {
  try {
    const { data } = await call('/v1/keys');
    const keys = [...data].reverse(); // newest first
    $('keys-body').replaceChildren(...keys.map((key) => h('tr', { 'data-id': key.id, 'data-revoked': key.revoked_at ? 'true' : 'false' },
      h('th', { scope: 'row', 'data-label': 'Name' }, key.name),
      h('td', { 'data-label': 'Key' }, h('code', {}, `${key.prefix}…`)),
      h('td', { 'data-label': 'Limits' }, limits(key)),
      h('td', { 'data-label': 'Spent / budget' }, spend(key)),
      h('td', { 'data-label': 'Last used' }, timeAgo(key.last_used_at)),
      h('td', { 'data-label': 'Created' }, timeAgo(key.created_at)),
      h('td', { 'data-label': 'State' }, stateCell(key)))));
    $('keys-empty').hidden = keys.length > 0;
    showAlert($('keys-error'), null);
  } catch (err) {
    if (err.status !== 401) showAlert($('keys-error'), `Could not load your keys: ${err.message}`);
  }
}

// Creating a key ----------------------------------------------------------------------------------

/** The form's values, or null after marking each bad field with what is wrong with it. */
function readForm() {
  const name = $('key-name');
  const optionalInt = (input, what) => {
    const text = input.value.trim();
    const ok = !text || (/^\d+$/.test(text) && Number(text) >= 1 && Number(text) <= 2147483647);
    fieldError(input, ok ? null : `${what} must be a whole number of at least 1, or empty for no limit.`);
    return text && ok ? Number(text) : null;
  };
  const budgetInput = $('key-budget');
  const budgetText = budgetInput.value.trim().replace(/^\$/, '');
  // As the ledger keeps it, to 4 decimals (the gateway refuses what it cannot hold).
  const budgetOk = !budgetText || /^\d+(\.\d{1,4})?$/.test(budgetText);
  fieldError(budgetInput, budgetOk ? null : 'The budget is an amount in USD, 0 or more, to 4 decimals at most (like 5 or 12.50), or empty for none.');
  const budget = budgetText && budgetOk ? Number(budgetText) : null;
  const nameText = name.value.trim();
  fieldError(name, nameText ? (nameText.length > 100 ? 'Keep the name to 100 characters.' : null) : 'Give the key a name, to recognise it by.');
  const values = {
    name: nameText,
    rpm_limit: optionalInt($('key-rpm'), 'Requests per minute'),
    tpm_limit: optionalInt($('key-tpm'), 'Tokens per minute'),
    budget_usd: budget,
  };
  const bad = document.querySelector('#create-form [aria-invalid="true"]');
  if (bad) {
    bad.focus();
    return null;
  }
  return values;
}

function snippet(key) {
  const base = `${location.origin}/v1`;
  return [
    'from openai import OpenAI',
    '',
    `client = OpenAI(base_url="${base}", api_key="${key}")`,
    'reply = client.chat.completions.create(',
    `    model="${SDK_MODEL}",`,
    '    messages=[{"role": "user", "content": "Hello, grid!"}],',
    ')',
    'print(reply.choices[0].message.content)',
  ].join('\n');
}

async function create(event) {
  event.preventDefault();
  showAlert($('create-error'), null);
  const values = readForm();
  if (!values) return;
  const submit = event.target.querySelector('button[type="submit"]');
  submit.disabled = true;
  try {
    const created = await call('/v1/keys', { method: 'POST', body: values });
    $('new-key-value').textContent = created.key;
    $('snippet').textContent = snippet(created.key);
    $('new-key').hidden = false;
    $('new-key-title').focus();
    event.target.reset();
    showAlert($('keys-status'), `Created "${created.name}".`);
    await refresh();
  } catch (err) {
    if (err.status !== 401) showAlert($('create-error'), `Could not create the key: ${err.message}`);
  } finally {
    submit.disabled = false;
  }
}

async function main() {
  startClock();
  for (const el of document.querySelectorAll('.base-url')) el.textContent = `${location.origin}/v1`;
  const entered = await enterSignedIn();
  if (!entered) return;
  ({ cfg, session } = entered);
  $('create-form').addEventListener('submit', create);
  wireCopy($('copy-key'), () => $('new-key-value').textContent);
  wireCopy($('copy-snippet'), () => $('snippet').textContent);
  await refresh();
}

main();
