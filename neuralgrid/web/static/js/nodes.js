// Your nodes: the signed-in owner's nodes (status, uptime, jobs served, reputation, warm models, the
// verification of each model, with a button to ask again for a failed one) and what they earned over
// a period: totals (held and forfeited too), net earnings per day as a bar chart drawn in plain SVG,
// and a table per node and model. Everything comes from /api/my/earnings, read as the owner (RLS);
// asking again is POST /api/my/verification.

import {
  api, displayStatus, enterSignedIn, fmt, h, showAlert, showSignIn, startClock, statusBadge, svg, timeAgo,
} from './common.js';

const $ = (id) => document.getElementById(id);
// The chart's drawing box; a phone gets half the width, so bars and labels keep a readable size.
const CHART = { wide: 960, narrow: 480, height: 240, left: 64, right: 8, top: 12, bottom: 30 };
const DAY_MS = 86_400_000;
const REFRESH_MS = 30_000;
let cfg = null;
let session = null;
let shown = null; // the data on the page, redrawn when the window changes width

// Formatting ----------------------------------------------------------------------------------------

/** USD: cents from one cent up; below that, enough decimals to show a single job's share. */
function money(value) {
  const v = Number(value ?? 0);
  if (v === 0) return '$0.00';
  return Math.abs(v) >= 0.01 ? `$${v.toFixed(2)}` : `$${v.toFixed(6)}`;
}

const percent = (share) => (share === null || share === undefined ? '–' : `${(100 * share).toFixed(1)}%`);

/** Sums of money in floating point, kept to the ledger's 8 decimals. */
const exact = (value) => Math.round(value * 1e8) / 1e8;

function duration(seconds) {
  if (seconds < 3600) return `${Math.max(1, Math.round(seconds / 60))} min`;
  if (seconds < 2 * 86400) return `${Math.round(seconds / 3600)} h`;
  return `${Math.round(seconds / 86400)} d`;
}

function dayLabel(day) {
  return new Date(`${day}T00:00:00Z`).toLocaleDateString('en-US', { month: 'short', day: 'numeric', timeZone: 'UTC' });
}

// The chart -----------------------------------------------------------------------------------------

/** The period's days (UTC dates, oldest first), from the first day the gateway counted from. */
function periodDays(firstDay, count) {
  const start = Date.parse(`${firstDay}T00:00:00Z`);
  return Array.from({ length: count }, (_, i) => new Date(start + i * DAY_MS).toISOString().slice(0, 10));
}

/** A round top for the axis: 1, 2, 2.5 or 5 times a power of ten, at least the highest bar. */
function axisTop(max) {
  if (max <= 0) return 1;
  const power = 10 ** Math.floor(Math.log10(max));
  return [1, 2, 2.5, 5].map((m) => m * power).find((top) => top >= max) ?? 10 * power;
}

function text(x, y, content, anchor = 'middle') {
  return svg('text', { x, y, 'text-anchor': anchor }, content);
}

function renderChart(data) {
  const days = periodDays(data.first_day, data.days);
  const net = new Map(days.map((day) => [day, 0]));
  for (const row of data.by_day) if (net.has(row.day)) net.set(row.day, exact(net.get(row.day) + row.net_usd));
  const { height, left, right, top, bottom } = CHART;
  const width = $('chart').clientWidth < 600 ? CHART.narrow : CHART.wide;
  $('chart').setAttribute('viewBox', `0 0 ${width} ${height}`);
  const plotWidth = width - left - right;
  const plotHeight = height - top - bottom;
  const highest = axisTop(Math.max(...net.values()));
  const y = (value) => top + plotHeight - (value / highest) * plotHeight;
  const grid = [0, highest / 2, highest].map((value) => svg('g', { class: 'tick' },
    svg('line', { x1: left, x2: width - right, y1: y(value), y2: y(value) }),
    text(left - 6, y(value) + 4, money(value), 'end')));
  const step = plotWidth / days.length;
  const gap = Math.min(4, step * 0.25);
  const bars = days.map((day, i) => {
    const value = net.get(day);
    const summary = `${dayLabel(day)}: ${money(value)} earned`;
    return svg('rect', {
      class: 'bar', x: left + i * step + gap / 2, y: y(value), width: step - gap, height: y(0) - y(value),
      'data-day': day, 'data-net': String(value), onclick: () => { $('chart-detail').textContent = summary; },
    }, svg('title', {}, summary));
  });
  // The first, middle and last days, the outer two flush with the plot's edges.
  const last = days.length - 1;
  const labels = [
    text(left, height - 10, dayLabel(days[0]), 'start'),
    last > 1 ? text(left + (Math.floor(last / 2) + 0.5) * step, height - 10, dayLabel(days[Math.floor(last / 2)])) : null,
    last > 0 ? text(width - right, height - 10, dayLabel(days[last]), 'end') : null,
  ].filter(Boolean);
  $('chart').replaceChildren(...grid, ...bars, ...labels);
  $('chart').setAttribute('aria-label', `Net earnings per day over the last ${data.days} days: ${money(data.totals.net_usd)} in all`);
  $('first-day').textContent = dayLabel(days[0]);
  $('chart-detail').textContent = '';
}

// The tables ----------------------------------------------------------------------------------------

const cell = (label, content, className = null) => h('td', { 'data-label': label, class: className }, content);

function renderEarnings(data) {
  const groups = new Map(); // node and model -> sums
  for (const row of data.by_day) {
    const key = `${row.node_id}\u0000${row.model_id}`;
    const sum = groups.get(key) ?? { node: row.node_name, model: row.model_id, jobs: 0, gross: 0, fee: 0, net: 0 };
    sum.jobs += row.jobs;
    sum.gross = exact(sum.gross + row.gross_usd);
    sum.fee = exact(sum.fee + row.fee_usd);
    sum.net = exact(sum.net + row.net_usd);
    groups.set(key, sum);
  }
  const rows = [...groups.values()].sort((a, b) => (a.node ?? '').localeCompare(b.node ?? '') || a.model.localeCompare(b.model));
  $('earnings-body').replaceChildren(...rows.map((r) => h('tr', {},
    h('th', { scope: 'row', 'data-label': 'Node' }, r.node ?? h('span', { class: 'muted' }, 'deleted node')),
    cell('Model', r.model),
    cell('Jobs', fmt(r.jobs), 'num'),
    cell('Charged', money(r.gross), 'num'),
    cell('Fee', money(r.fee), 'num'),
    cell('Earned', money(r.net), 'num'))));
  $('earnings-empty').hidden = rows.length > 0;
}

function uptimeCell(node, days) {
  const whole = node.observed_s >= days * 86400 - 60;
  const title = node.uptime === null ? 'nothing recorded yet' : whole ? `over the last ${days} days` : `over the ${duration(node.observed_s)} recorded`;
  return h('td', { 'data-label': `Uptime (${days} d)`, class: 'num', title }, percent(node.uptime));
}

/** Each of the node's models under verification: its state, its record and the last failure's reason;
 * a failed one with the button that asks again. */
function verificationCell(node, checks) {
  const mine = checks.filter((c) => c.node_id === node.node_id);
  if (!mine.length) return cell('Verification', h('span', { class: 'muted' }, 'no model checked'), 'wrap verification');
  return cell('Verification', h('ul', { class: 'plain checks' }, mine.map((c) => h('li', { 'data-model': c.model_id, 'data-state': c.state },
    h('span', { class: `check c-${c.state}` }, c.state), ' ', c.model_id,
    h('div', { class: 'muted' }, `${fmt(c.challenges - c.failures)} passed, ${fmt(c.failures)} failed · since `, timeAgo(c.state_since)),
    c.last_failure ? h('div', { class: 'last-failure' }, `Last failure: ${c.last_failure}`) : null,
    c.state === 'failed'
      ? h('button', { type: 'button', class: 'verify-again', 'aria-label': `Verify ${c.model_id} on ${node.name} again`, onclick: (event) => verifyAgain(node, event.currentTarget) }, 'Verify again')
      : null))), 'wrap verification');
}

async function verifyAgain(node, button) {
  button.disabled = true;
  try {
    const started = await api('/api/my/verification', { method: 'POST', body: { node: node.node_id }, token: session.access_token });
    const models = started.models.map((m) => m.model_id).join(', ');
    showStatus(`${started.node_name}: ${models} ${started.models.length === 1 ? 'starts' : 'start'} over, unverified. It gets requests again, and is challenged at once.`, 'ok');
    await load();
  } catch (err) {
    button.disabled = false;
    showStatus(`Could not ask again for ${node.name}: ${err.message}`, 'error');
  }
}

function showStatus(message, kind) {
  const el = $('verify-status');
  el.className = `alert ${kind}`;
  showAlert(el, message);
}

function renderNodes(data) {
  const checks = data.checks ?? [];
  $('nodes-body').replaceChildren(...data.nodes.map((n) => h('tr', { 'data-id': n.node_id, 'data-name': n.name },
    cell('Status', statusBadge(displayStatus(n))),
    h('th', { scope: 'row', 'data-label': 'Node' }, n.name),
    cell('GPU', `${n.gpu_count} × ${n.gpu_model}`, 'wrap'),
    cell('Region', n.region),
    uptimeCell(n, data.uptime_days),
    cell('Jobs served', fmt(n.jobs_served), 'num'),
    h('td', { 'data-label': 'Reputation', class: 'num', title: `${n.jobs_served} served, ${n.failures} failed` }, percent(n.reputation)),
    cell('Warm models', n.warm_models.length ? h('ul', { class: 'plain' }, n.warm_models.map((m) => h('li', {}, m))) : h('span', { class: 'muted' }, 'no model loaded'), 'wrap'),
    verificationCell(n, checks),
    cell('Earned', money(n.net_usd), 'num'),
    cell('Last heartbeat', timeAgo(n.last_heartbeat_at)))));
  $('nodes-empty').hidden = data.nodes.length > 0;
}

function renderTotals(data) {
  $('total-jobs').textContent = fmt(data.totals.jobs);
  $('total-gross').textContent = money(data.totals.gross_usd);
  $('total-fee').textContent = money(data.totals.fee_usd);
  $('total-net').textContent = money(data.totals.net_usd);
  $('total-held').textContent = money(data.totals.held_usd);
  $('total-forfeited').textContent = money(data.totals.forfeited_usd);
  $('fee-rate').textContent = `${Number((100 * data.fee_rate).toFixed(2))}%`;
}

// Loading ---------------------------------------------------------------------------------------------

async function load() {
  if (!session) return;
  try {
    const data = await api(`/api/my/earnings?days=${encodeURIComponent($('period').value)}`, { token: session.access_token });
    shown = data;
    renderTotals(data);
    renderChart(data);
    renderEarnings(data);
    renderNodes(data);
    showAlert($('load-error'), null);
  } catch (err) {
    if (err.status === 401) {
      session = null;
      showSignIn(cfg, `Your session has ended (${err.message}). Sign in again.`);
    } else {
      showAlert($('load-error'), `Could not load your nodes and earnings: ${err.message}`);
    }
  }
}

async function main() {
  startClock();
  const entered = await enterSignedIn();
  if (!entered) return;
  ({ cfg, session } = entered);
  $('period').addEventListener('change', load);
  window.addEventListener('resize', () => { if (shown) renderChart(shown); });
  await load();
  // Status, uptime and earnings move on while the page is open.
  setInterval(() => { if (!document.hidden) load(); }, REFRESH_MS);
}

main();
