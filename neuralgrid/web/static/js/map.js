// The fleet map at any size (issue 41). Nothing here is a message per node: the page reads a summary
// of the fleet (counts by status per 15-degree tile, region and GPU model, and the totals), which
// Realtime keeps current on the public `map:summary` topic with at most one message a second, each
// the changes from the one before. The world unzoomed shows the summary's tiles as clusters; zoomed
// in, the page asks for its view (map_view(): the nodes in it when few, else finer clusters) when the
// view moves or a tile in it changes; the table reads a page at a time (node_list()). The nodes on
// show, on the map and in the table, are read again by id every few seconds for their load and
// heartbeats. On a hosted project the same functions are read through the Data API with supabase-js.

import { api, fmt, h, loadConfig, showSession, startClock, STATUSES, statusBadge, supabaseClient, usd } from './common.js';
import { createMap } from './mapdraw.js';
import { createTable } from './nodetable.js';

const POLL_MS = 5000; // without Realtime: the summary, the view and the table
const ROWS_MS = 5000; // the nodes on show, for their load and heartbeats
const MAX_NODES = 300; // a view shows its nodes one by one up to this many
const CLUSTERS_MS = 5000; // zoomed-in clusters are asked again at most this often on changes
const TILE = 15; // degrees: the summary's tiles

const $ = (id) => document.getElementById(id);
let cfg = null;
let summary = null;
let live = false;
let everLive = false; // the first subscription follows the first read: nothing to catch up on
let viewAsked = 0;
let viewAt = 0;
let worldError = null; // the map's libraries missing: said until the page is reloaded

// Where the fleet is read: the gateway's API, or on a hosted project the Data API (as anon) -------------

async function rpc(name, args) {
  const { data, error } = await supabaseClient(cfg).rpc(name, args);
  if (error) throw new Error(error.message);
  return data;
}

function hosted() {
  return cfg?.mode === 'supabase';
}

async function readSummary() {
  return hosted() ? rpc('map_summary') : api('/api/map/summary');
}

async function readView(box, cell) {
  if (hosted()) {
    return rpc('map_view', {
      p_west: box.west, p_south: box.south, p_east: box.east, p_north: box.north, p_cell_deg: cell, p_max_nodes: MAX_NODES,
    });
  }
  const params = new URLSearchParams({ ...box, cell: String(cell), max_nodes: String(MAX_NODES) });
  return api(`/api/map/view?${params}`);
}

async function readPage({ search, sort, descending, offset, limit }) {
  if (hosted()) {
    return rpc('node_list', { p_search: search, p_sort: sort, p_descending: descending, p_offset: offset, p_limit: limit });
  }
  const params = new URLSearchParams({ q: search, sort, desc: String(descending), offset: String(offset), limit: String(limit) });
  const page = await api(`/api/nodes?${params}`);
  return { total: page.total, nodes: page.data };
}

/** Nodes by id, as they are now (up to a page's worth). */
async function readNodes(ids) {
  if (!ids.length) return [];
  if (hosted()) {
    const { data, error } = await supabaseClient(cfg).from('node_map').select('*').in('id', ids);
    if (error) throw new Error(error.message);
    return data;
  }
  return (await api(`/api/nodes?${new URLSearchParams({ ids: ids.join(',') })}`)).data;
}

// The summary ----------------------------------------------------------------------------------------

const located = (s) => Object.values(s.tiles).reduce((sum, t) => sum + t[2] + t[3] + t[4] + t[5], 0);
const sum = (counts) => counts.reduce((a, b) => a + b, 0);

/** A message of map:summary: the whole, or the changes to the one held (else the whole is read again). */
function onSummaryMessage(message) {
  if (message.full || !summary) {
    setSummary(message);
  } else if (summary.seq != null && message.seq === summary.seq + 1) {
    const next = { ...summary, ...message, tiles: { ...summary.tiles }, regions: { ...summary.regions }, gpus: { ...summary.gpus } };
    for (const part of ['tiles', 'regions', 'gpus']) {
      for (const [key, value] of Object.entries(message[part] ?? {})) {
        if (value === null) delete next[part][key];
        else next[part][key] = value;
      }
    }
    setSummary(next);
  } else if (summary.seq == null || message.seq > summary.seq) {
    refreshSummary(); // one was missed, or ours was computed apart from the feed
  }
}

async function refreshSummary() {
  try {
    setSummary(await readSummary());
    showAlertIn('stats-error', null);
  } catch (err) {
    showAlertIn('stats-error', `Could not load the fleet's summary: ${err.message}`);
  }
}

const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

/** What changed from the summary held to the next: its tiles that differ, and whether anything did. */
function changes(before, after) {
  const keys = new Set([...Object.keys(before.tiles), ...Object.keys(after.tiles)]);
  const tiles = [...keys].filter((key) => !same(before.tiles[key], after.tiles[key]));
  const any = tiles.length > 0 || ['total', 'unplaced', 'regions', 'gpus', 'stats'].some((k) => !same(before[k], after[k]));
  return { tiles, any };
}

function setSummary(next) {
  const before = summary;
  summary = next;
  renderStats();
  if (!before) return; // the first: main() reads the view and the table
  const { tiles, any } = changes(before, next);
  if (tiles.some(tileInView)) refreshView({ soon: true });
  if (sum(next.total) !== sum(before.total)) table.load(); // the fleet grew or shrank: which nodes a page holds
  else if (any) refreshRows();
}

function tileInView(key) {
  const t = Number(key);
  const [row, col] = [Math.floor(t / 100), t % 100];
  const [south, west] = [-90 + (row - 1) * TILE, -180 + (col - 1) * TILE];
  const view = map.box();
  return south <= view.north && south + TILE >= view.south && west <= view.east && west + TILE >= view.west;
}

function renderStats() {
  const s = summary;
  const unplaced = sum(s.unplaced);
  $('stat-online').textContent = fmt(s.total[0] + s.total[1]);
  $('stat-vram').textContent = `${fmt(s.stats.online_vram_gb)} GB`;
  $('stat-tflops').textContent = `${fmt(s.stats.online_tflops)} TFLOPS`;
  $('stat-jobs').textContent = fmt(s.stats.jobs_last_minute);
  $('stat-p50').textContent = s.stats.p50_latency_ms == null ? 'no jobs' : `${fmt(s.stats.p50_latency_ms)} ms`;
  const cheapest = Object.entries(s.gpus).filter(([, g]) => g[4] != null).sort((a, b) => a[1][4] - b[1][4] || a[0].localeCompare(b[0]));
  $('cheapest').replaceChildren(...(cheapest.length
    ? cheapest.map(([gpu, g]) => h('tr', {}, h('td', {}, gpu), h('td', { class: 'num' }, usd(g[4]))))
    : [h('tr', {}, h('td', { colspan: '2', class: 'muted' }, 'no node online'))]));
  const regions = Object.entries(s.regions).sort((a, b) => sum(b[1]) - sum(a[1]) || a[0].localeCompare(b[0]));
  $('regions').replaceChildren(...regions.map(([name, c]) => h('tr', {},
    h('td', {}, name), h('td', { class: 'num' }, fmt(c[0] + c[1])), h('td', { class: 'num' }, fmt(sum(c))))));
  const total = sum(s.total);
  $('node-count').textContent = `${fmt(total)} node${total === 1 ? '' : 's'}${unplaced ? ` (${fmt(unplaced)} without a location, not on the map)` : ''}`;
  for (const item of $('legend').querySelectorAll('[data-status]')) {
    item.querySelector('.count').textContent = fmt(s.total[Object.keys(STATUSES).indexOf(item.dataset.status)]);
  }
}

// The view -------------------------------------------------------------------------------------------

let viewTimer = null;

/** Asks for what the map shows now: the summary's tiles for the world when it holds many nodes, else
 * the view's nodes or its clusters. `soon`: a change the feed told of (clusters wait CLUSTERS_MS). */
function refreshView({ soon = false } = {}) {
  clearTimeout(viewTimer);
  if (!summary) return;
  if (map.zoom === 1 && located(summary) > MAX_NODES) {
    map.setClusters(Object.values(summary.tiles).map((t) => ({ lat: t[0], lon: t[1], counts: t.slice(2, 6) })));
    markReady();
    return;
  }
  const wait = soon && map.mode === 'clusters' ? Math.max(0, viewAt + CLUSTERS_MS - Date.now()) : 0;
  viewTimer = setTimeout(async () => {
    const mine = ++viewAsked;
    viewAt = Date.now();
    try {
      const view = await readView(map.box(), map.cellDegrees());
      if (mine !== viewAsked) return;
      if (view.nodes) map.setNodes(view.nodes);
      else map.setClusters(view.clusters.map((c) => ({ lat: c[0], lon: c[1], counts: c.slice(2, 6) })));
      if (!worldError) showAlertIn('map-error', null);
      markReady();
    } catch (err) {
      if (!worldError) showAlertIn('map-error', `Could not load the map's view: ${err.message}`);
    }
  }, wait);
}

/** The nodes on show read again for their load and heartbeats: the map's view (its nodes, by their
 * place: an index) and the table's page (by id). */
let rowsTimer = null;
async function refreshRows() {
  clearTimeout(rowsTimer);
  rowsTimer = setTimeout(refreshRows, ROWS_MS);
  if (map.mode === 'nodes') refreshView();
  try {
    const rows = await readNodes(table.ids());
    table.update(rows);
    map.updateShown(rows);
  } catch (err) {
    // the next round tries again; the table keeps what it had
  }
}

// Realtime -------------------------------------------------------------------------------------------

function setLive(state, text) {
  $('live').dataset.state = state;
  $('live').textContent = text;
}

function connectRealtime() {
  let client;
  try {
    client = supabaseClient(cfg);
  } catch (err) {
    setLive('unavailable', 'Live updates unavailable: refreshing every 5 s');
    return;
  }
  client
    .channel('map:summary')
    .on('broadcast', { event: 'summary' }, (message) => onSummaryMessage(message.payload))
    .subscribe((status) => {
      const wasLive = live;
      live = status === 'SUBSCRIBED';
      if (live) {
        setLive('live', 'Live');
        if (!wasLive && everLive) catchUp(); // whatever changed while the channel was down
        everLive = true;
      } else {
        setLive('reconnecting', 'Reconnecting… (refreshing every 5 s)');
      }
    });
}

function catchUp() {
  refreshSummary();
  table.load();
}

// Start ----------------------------------------------------------------------------------------------

function showAlertIn(id, message) {
  $(id).textContent = message ?? '';
  $(id).hidden = !message;
}

let ready = false;
function markReady() {
  if (ready || !summary || !tableLoaded) return;
  ready = true;
  requestAnimationFrame(() => performance.mark('map-ready'));
}

function renderLegend() {
  const notes = { busy: '(every slot in use)', draining: '(finishing its jobs, taking no new ones)' };
  $('legend').replaceChildren(
    ...Object.keys(STATUSES).map((s) => h('li', { 'data-status': s }, statusBadge(s), h('span', { class: 'count' }, ''),
      h('span', { class: 'muted' }, notes[s] ?? ''))),
    h('li', {}, h('span', { class: 'cluster-key', 'aria-hidden': 'true' }, '12'),
      h('span', { class: 'muted' }, 'a cluster of nodes, ringed by their statuses: select it to zoom in')),
    h('li', { 'data-key': 'verify-failed' }, h('span', { class: 'verify-key', 'aria-hidden': 'true' }),
      h('span', { class: 'muted' }, 'a dashed red ring: the node failed verification of a model (it gets no requests for it)')),
  );
}

const map = createMap({ svgEl: $('map'), wrapEl: $('map-wrap'), cardEl: $('card'), onView: () => refreshView() });
let tableLoaded = false;
const table = createTable({
  readPage,
  onOpen: (node) => {
    map.openCard(node, true);
    if (map.hasMarker(node.id)) map.focusMarker(node.id);
  },
  onError: (message) => showAlertIn('nodes-error', message),
});
map.onCardChange((id) => table.select(id));

async function main() {
  renderLegend();
  $('zoom-in').addEventListener('click', () => map.zoomBy(2));
  $('zoom-out').addEventListener('click', () => map.zoomBy(0.5));
  $('zoom-reset').addEventListener('click', () => map.reset());
  document.addEventListener('keydown', (event) => { if (event.key === 'Escape' && map.shownId) map.closeCard(true); });
  startClock();
  try {
    cfg = await loadConfig();
    showSession(cfg).catch(() => {});
  } catch (err) {
    setLive('unavailable', 'Live updates unavailable: refreshing every 5 s');
  }
  const world = map.drawWorld().catch((err) => {
    worldError = `The map cannot be drawn: ${err.message}. The table below still works.`;
    showAlertIn('map-error', worldError);
  });
  await Promise.all([refreshSummary(), table.load().then(() => { tableLoaded = true; }), world]);
  refreshView();
  rowsTimer = setTimeout(refreshRows, ROWS_MS);
  if (cfg) connectRealtime();
  setInterval(() => {
    if (!live) catchUp();
  }, POLL_MS);
}

main();
