// The fleet map: a world map with a marker per node, a node card, fleet stats and a sortable table.
// A snapshot comes from /api/nodes (a hosted project's Data API); after that Realtime (supabase-js, channel 'node-map') keeps it
// current, and the page falls back to polling while the channel is down.

import {
  api, displayStatus, fmt, h, loadConfig, parseTime, showSession, startClock, STATUSES, statusBadge,
  statusShape, supabaseClient, svg, timeAgo, usd,
} from './common.js';

const WIDTH = 960;
const HEIGHT = 500;
const POLL_MS = 5000;
const STATUS_RANK = { online: 0, busy: 1, draining: 2, offline: 3 };
// The node columns the page uses: anything else in a payload is ignored.
const FIELDS = [
  'id', 'name', 'gpu_model', 'gpu_count', 'vram_gb', 'tflops', 'hourly_rate', 'region', 'latitude', 'longitude',
  'status', 'max_concurrency', 'inflight', 'last_heartbeat_at', 'missed_heartbeats', 'successes', 'failures',
  'cooldown_until', 'gpu_utilization', 'free_vram_gb', 'queue_depth', 'warm_models', 'available_models',
];
const NUMERIC = new Set(['gpu_count', 'vram_gb', 'tflops', 'hourly_rate', 'latitude', 'longitude', 'max_concurrency',
  'inflight', 'missed_heartbeats', 'successes', 'failures', 'gpu_utilization', 'free_vram_gb', 'queue_depth']);

const COLUMNS = [
  { key: 'status', label: 'Status', sort: (n) => STATUS_RANK[displayStatus(n)], cell: (n) => statusBadge(displayStatus(n)) },
  { key: 'name', label: 'Node', sort: (n) => n.name.toLowerCase(), cell: (n) => nameButton(n) },
  { key: 'gpu', label: 'GPU', sort: (n) => `${n.gpu_model} ${n.gpu_count}`, cell: (n) => `${n.gpu_count} × ${n.gpu_model}` },
  { key: 'vram', label: 'VRAM', num: true, sort: (n) => n.vram_gb, cell: (n) => `${fmt(n.vram_gb)} GB` },
  { key: 'tflops', label: 'TFLOPS', num: true, sort: (n) => n.tflops, cell: (n) => fmt(n.tflops) },
  { key: 'price', label: '$/h', num: true, sort: (n) => n.hourly_rate, cell: (n) => usd(n.hourly_rate) },
  { key: 'region', label: 'Region', sort: (n) => n.region, cell: (n) => n.region },
  { key: 'load', label: 'Load', num: true, sort: (n) => n.inflight / n.max_concurrency, cell: (n) => `${n.inflight}/${n.max_concurrency}` },
  { key: 'beat', label: 'Last heartbeat', sort: (n) => parseTime(n.last_heartbeat_at)?.getTime() ?? 0, cell: (n) => timeAgo(n.last_heartbeat_at) },
];

const nodes = new Map(); // id -> node
const markers = new Map(); // id -> <g>
let positions = new Map(); // id -> [x, y] on the map
let projection = null;
let layoutDirty = true;
let renderQueued = false;
let sortBy = { key: 'name', dir: 1 };
let shown = null; // id of the node whose card is open
let pinned = false; // opened by click or Enter: stays until closed
let live = false;
let resyncTimer = null;

const $ = (id) => document.getElementById(id);
const mapSvg = $('map');
const dotsLayer = svg('g', { class: 'dots' });

// Nodes -------------------------------------------------------------------------------------------

function normalize(row) {
  const node = {};
  for (const key of FIELDS) {
    if (!(key in row)) continue;
    const value = row[key];
    node[key] = NUMERIC.has(key) && value !== null && value !== undefined ? Number(value) : value;
  }
  return node;
}

/** Merges a row (snapshot, broadcast or postgres_changes) into the node; a newer heartbeat pulses it. */
function mergeNode(row) {
  if (!row?.id) return;
  const old = nodes.get(row.id);
  const node = { warm_models: [], available_models: [], ...old, ...normalize(row) };
  nodes.set(row.id, node);
  if (!old || old.latitude !== node.latitude || old.longitude !== node.longitude) layoutDirty = true;
  const before = parseTime(old?.last_heartbeat_at)?.getTime();
  const after = parseTime(node.last_heartbeat_at)?.getTime();
  if (old && after && after !== before) pulse(node.id);
  scheduleRender();
}

function removeNode(id) {
  if (!nodes.delete(id)) return;
  layoutDirty = true;
  if (shown === id) closeCard(false);
  scheduleRender();
}

function applySnapshot(rows) {
  const seen = new Set(rows.map((r) => r.id));
  for (const id of [...nodes.keys()]) if (!seen.has(id)) removeNode(id);
  for (const row of rows) mergeNode(row);
}

// Where the fleet is read: the gateway's API, or, on a hosted project, Supabase's Data API (the
// node_map view and fleet_stats(), as anon) with supabase-js: the same view and function either way.
async function readNodes() {
  const cfg = await loadConfig();
  if (cfg.mode !== 'supabase') return (await api('/api/nodes')).data;
  const { data, error } = await supabaseClient(cfg).from('node_map').select('*').order('name');
  if (error) throw new Error(error.message);
  return data;
}

async function readStats() {
  const cfg = await loadConfig();
  if (cfg.mode !== 'supabase') return api('/api/stats');
  const { data, error } = await supabaseClient(cfg).rpc('fleet_stats').single();
  if (error) throw new Error(error.message);
  return data;
}

async function refreshNodes() {
  try {
    applySnapshot(await readNodes());
    showAlertIn('nodes-error', null);
  } catch (err) {
    showAlertIn('nodes-error', `Could not load the nodes: ${err.message}`);
  }
}

/** Broadcasts carry the public columns but not the models: fetch the snapshot again, once, soon. */
function scheduleResync() {
  clearTimeout(resyncTimer);
  resyncTimer = setTimeout(refreshNodes, 800);
}

// Realtime ----------------------------------------------------------------------------------------

function onBroadcast(event, payload) {
  const node = payload?.node;
  if (!node?.id) return;
  if (event === 'node_delete') removeNode(node.id);
  else {
    mergeNode(node);
    if (event === 'node_insert') scheduleResync();
  }
}

function setLive(state, text) {
  const badge = $('live');
  badge.dataset.state = state;
  badge.textContent = text;
}

function connectRealtime(cfg) {
  let client;
  try {
    client = supabaseClient(cfg);
  } catch (err) {
    setLive('unavailable', 'Live updates unavailable: refreshing every 5 s');
    return;
  }
  client
    .channel('node-map')
    .on('broadcast', { event: '*' }, (message) => onBroadcast(message.event, message.payload))
    // Heartbeats and load changes arrive as row updates (anon sees the map columns only).
    .on('postgres_changes', { event: 'UPDATE', schema: 'public', table: 'nodes' }, (change) => mergeNode(change.new))
    .subscribe((status) => {
      const wasLive = live;
      live = status === 'SUBSCRIBED';
      if (live) {
        setLive('live', 'Live');
        if (!wasLive) refreshNodes(); // catch up on whatever changed while the channel was down
      } else {
        setLive('reconnecting', 'Reconnecting… (refreshing every 5 s)');
      }
    });
}

// The map -----------------------------------------------------------------------------------------

async function drawWorld() {
  if (!window.d3?.geoNaturalEarth1 || !window.topojson) {
    throw new Error('the map libraries are not installed on this gateway: run ./dev up (or npm install)');
  }
  const response = await fetch('/vendor/countries-110m.json');
  if (!response.ok) throw new Error('the world map is not installed on this gateway: run ./dev up (or npm install)');
  const world = await response.json();
  projection = d3.geoNaturalEarth1().fitExtent([[6, 6], [WIDTH - 6, HEIGHT - 6]], { type: 'Sphere' });
  const path = d3.geoPath(projection);
  const countries = world.objects.countries;
  mapSvg.replaceChildren(
    svg('path', { class: 'sphere', d: path({ type: 'Sphere' }) }),
    svg('path', { class: 'graticule', d: path(d3.geoGraticule10()) }),
    svg('path', { class: 'land', d: path(topojson.feature(world, countries)) }),
    svg('path', { class: 'borders', d: path(topojson.mesh(world, countries, (a, b) => a !== b)) }),
    dotsLayer,
  );
  layoutDirty = true;
  scheduleRender();
}

/** Markers grow on small screens so that they stay big enough to see and to tap. */
function markerScale() {
  const width = mapSvg.clientWidth || WIDTH;
  return Math.min(3, Math.max(1.3, 900 / width));
}

/** Places each located node; nodes in one city would hide each other, so later ones step out along a
 * spiral until they are clear of those already placed (a grid of cells keeps the search local). */
function layout() {
  positions = new Map();
  if (!projection) return;
  const gap = 12 * markerScale();
  const cells = new Map();
  const cellOf = (x, y) => `${Math.floor(x / gap)},${Math.floor(y / gap)}`;
  const crowded = (x, y) => {
    const [cx, cy] = [Math.floor(x / gap), Math.floor(y / gap)];
    for (let dx = -1; dx <= 1; dx++) {
      for (let dy = -1; dy <= 1; dy++) {
        for (const [px, py] of cells.get(`${cx + dx},${cy + dy}`) ?? []) if (Math.hypot(px - x, py - y) < gap) return true;
      }
    }
    return false;
  };
  const located = [...nodes.values()].filter((n) => n.latitude !== null && n.latitude !== undefined && n.longitude !== null && n.longitude !== undefined);
  located.sort((a, b) => a.name.localeCompare(b.name) || a.id.localeCompare(b.id));
  for (const node of located) {
    const point = projection([node.longitude, node.latitude]);
    if (!point) continue;
    let [x, y] = point;
    for (let i = 1; crowded(x, y) && i < 500; i++) {
      const radius = gap * 0.6 * Math.sqrt(i);
      x = point[0] + radius * Math.cos(i * 2.39996); // the golden angle spreads points evenly
      y = point[1] + radius * Math.sin(i * 2.39996);
    }
    const key = cellOf(x, y);
    cells.set(key, [...(cells.get(key) ?? []), [x, y]]);
    positions.set(node.id, [x, y]);
  }
  layoutDirty = false;
}

function describe(node) {
  const status = displayStatus(node);
  return `${node.name}: ${STATUSES[status].label}, ${node.gpu_count} × ${node.gpu_model}, ${usd(node.hourly_rate)} per hour, ${node.region}`;
}

function marker(id) {
  let g = markers.get(id);
  if (g) return g;
  g = svg('g', { class: 'node', tabindex: '0', role: 'button', 'aria-controls': 'card', 'aria-expanded': 'false', 'data-id': id },
    svg('circle', { class: 'pulse', r: '6' }), statusShape('online'), svg('circle', { class: 'focus-ring', r: '9' }));
  g.addEventListener('mouseenter', () => { if (!pinned) openCard(id, false); });
  g.addEventListener('mouseleave', () => { if (!pinned && shown === id) closeCard(false); });
  g.addEventListener('focus', () => { if (!pinned) openCard(id, false); });
  g.addEventListener('blur', () => { if (!pinned && shown === id) closeCard(false); });
  g.addEventListener('click', (event) => { event.stopPropagation(); openCard(id, true); });
  g.addEventListener('keydown', (event) => {
    if (event.key === 'Enter' || event.key === ' ') {
      event.preventDefault();
      openCard(id, true);
    }
  });
  markers.set(id, g);
  return g;
}

function renderMarkers() {
  const scale = markerScale();
  for (const [id, g] of markers) {
    if (!positions.has(id)) {
      g.remove();
      markers.delete(id);
    }
  }
  for (const [id, [x, y]] of positions) {
    const node = nodes.get(id);
    const status = displayStatus(node);
    const g = marker(id);
    g.setAttribute('transform', `translate(${x.toFixed(1)} ${y.toFixed(1)}) scale(${scale.toFixed(2)})`);
    g.setAttribute('class', `node s-${status}`);
    g.setAttribute('aria-label', describe(node));
    g.dataset.status = status;
    g.querySelector('.shape').setAttribute('d', STATUSES[status].path);
    if (!g.isConnected) dotsLayer.append(g);
  }
}

/** Replays the marker's pulse (a CSS animation) for a heartbeat. */
function pulse(id) {
  const ring = markers.get(id)?.querySelector('.pulse');
  if (!ring) return;
  ring.classList.remove('pulsing');
  ring.getBoundingClientRect(); // a reflow, so that adding the class starts the animation again
  ring.classList.add('pulsing');
}

// The node card -------------------------------------------------------------------------------------

function openCard(id, pin) {
  shown = id;
  pinned = pin;
  renderCard();
}

function closeCard(restoreFocus) {
  const id = shown;
  shown = null;
  pinned = false;
  renderCard();
  if (restoreFocus && id) markers.get(id)?.focus();
}

function percent(value) {
  return value === null || value === undefined ? null : `${Math.round(value * 100)}%`;
}

function renderCard() {
  const card = $('card');
  for (const [id, g] of markers) g.setAttribute('aria-expanded', String(id === shown));
  for (const row of document.querySelectorAll('#nodes-body tr')) row.classList.toggle('selected', row.dataset.id === shown);
  const node = shown && nodes.get(shown);
  if (!node) {
    card.hidden = true;
    return;
  }
  const status = displayStatus(node);
  const load = [`${node.inflight}/${node.max_concurrency} in flight`];
  if (node.gpu_utilization !== null && node.gpu_utilization !== undefined) load.push(`GPU ${percent(node.gpu_utilization)}`);
  if (node.queue_depth !== undefined) load.push(`queue ${node.queue_depth}`);
  const total = node.successes + node.failures;
  const reputation = total ? `${node.successes} ok / ${node.failures} failed (${Math.round((100 * node.successes) / total)}%)` : 'no jobs yet';
  const cooldown = parseTime(node.cooldown_until);
  const rows = [
    ['Status', [statusBadge(status), node.missed_heartbeats ? ` · ${node.missed_heartbeats} missed heartbeats` : '',
      cooldown && cooldown > new Date() ? ' · cooling down' : '']],
    ['GPU', `${node.gpu_count} × ${node.gpu_model}`],
    ['VRAM', `${fmt(node.vram_gb)} GB${node.free_vram_gb !== null && node.free_vram_gb !== undefined ? ` (${fmt(node.free_vram_gb)} GB free)` : ''}`],
    ['Compute', `${fmt(node.tflops)} TFLOPS`],
    ['Price', `${usd(node.hourly_rate)} per hour`],
    ['Region', node.region],
    ['Warm models', node.warm_models.length ? h('ul', {}, node.warm_models.map((m) => h('li', {}, m))) : 'none loaded'],
    ['Load', load.join(' · ')],
    ['Reputation', reputation],
    ['Last heartbeat', timeAgo(node.last_heartbeat_at)],
  ];
  const close = h('button', { type: 'button', 'aria-label': 'Close node details', onclick: () => closeCard(true) }, '×');
  const hadFocus = card.contains(document.activeElement); // live updates must not steal keyboard focus
  card.replaceChildren(
    h('div', { class: 'card-head' }, h('h3', { id: 'card-title' }, node.name), pinned ? close : null),
    h('dl', {}, rows.flatMap(([term, value]) => [h('dt', {}, term), h('dd', {}, value)])),
  );
  card.setAttribute('aria-labelledby', 'card-title');
  card.hidden = false;
  if (hadFocus && pinned) close.focus({ preventScroll: true });
  placeCard(card, node.id);
}

/** Floats the card beside its marker, inside the map (on phones CSS lays it out under the map). */
function placeCard(card, id) {
  if (getComputedStyle(card).position !== 'absolute') return;
  const wrap = $('map-wrap').getBoundingClientRect();
  const dot = markers.get(id)?.getBoundingClientRect();
  const width = card.offsetWidth;
  const height = card.offsetHeight;
  let left = 8;
  let top = 8;
  if (dot) {
    left = dot.right - wrap.left + 10;
    if (left + width > wrap.width) left = dot.left - wrap.left - width - 10;
    top = dot.top - wrap.top - 16;
  }
  card.style.left = `${Math.max(0, Math.min(left, wrap.width - width))}px`;
  card.style.top = `${Math.max(0, Math.min(top, wrap.height - height))}px`;
}

// The table -----------------------------------------------------------------------------------------

function nameButton(node) {
  return h('button', {
    type: 'button',
    class: 'link-button',
    'aria-label': `${node.name}: show details`,
    onclick: () => {
      openCard(node.id, true);
      markers.get(node.id)?.focus({ preventScroll: true });
    },
  }, node.name);
}

function renderHead() {
  const cells = COLUMNS.map((col) => {
    const sorted = sortBy.key === col.key;
    const button = h('button', { type: 'button', onclick: () => setSort(col.key) }, col.label, h('span', { class: 'sort-icon', 'aria-hidden': 'true' }));
    return h('th', { scope: 'col', class: col.num ? 'num' : null, 'aria-sort': sorted ? (sortBy.dir > 0 ? 'ascending' : 'descending') : 'none' }, button);
  });
  $('nodes-head').replaceChildren(...cells);
}

function setSort(key) {
  sortBy = { key, dir: sortBy.key === key ? -sortBy.dir : 1 };
  renderHead();
  renderTable();
  $('nodes-head').querySelector(`th:nth-child(${COLUMNS.findIndex((c) => c.key === key) + 1}) button`).focus();
}

function renderTable() {
  const column = COLUMNS.find((c) => c.key === sortBy.key);
  const rows = [...nodes.values()].sort((a, b) => {
    const [x, y] = [column.sort(a), column.sort(b)];
    return (x < y ? -1 : x > y ? 1 : a.name.localeCompare(b.name)) * sortBy.dir;
  });
  // Rows are rebuilt on every update: keep keyboard focus on the same node's row.
  const focused = document.activeElement?.closest?.('#nodes-body tr')?.dataset.id;
  $('nodes-body').replaceChildren(...rows.map((node) => h('tr', { 'data-id': node.id, 'data-status': displayStatus(node), class: node.id === shown ? 'selected' : null },
    COLUMNS.map((col) => h(col.key === 'name' ? 'th' : 'td', { class: col.num ? 'num' : null, scope: col.key === 'name' ? 'row' : null, 'data-label': col.label }, col.cell(node))))));
  if (focused) $('nodes-body').querySelector(`tr[data-id="${focused}"] button`)?.focus({ preventScroll: true });
  $('nodes-empty').hidden = nodes.size > 0;
  const offMap = [...nodes.values()].filter((n) => !positions.has(n.id)).length;
  $('node-count').textContent = `${nodes.size} node${nodes.size === 1 ? '' : 's'}${offMap && projection ? ` (${offMap} without a location, not on the map)` : ''}`;
}

function scheduleRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    if (layoutDirty) layout();
    renderMarkers();
    renderTable();
    renderCard();
  });
}

// Stats ---------------------------------------------------------------------------------------------

async function refreshStats() {
  try {
    const stats = await readStats();
    $('stat-online').textContent = fmt(stats.online_nodes);
    $('stat-vram').textContent = `${fmt(stats.online_vram_gb)} GB`;
    $('stat-tflops').textContent = `${fmt(stats.online_tflops)} TFLOPS`;
    $('stat-jobs').textContent = fmt(stats.jobs_last_minute);
    $('stat-p50').textContent = stats.p50_latency_ms === null ? 'no jobs' : `${fmt(stats.p50_latency_ms)} ms`;
    $('cheapest').replaceChildren(...(stats.cheapest.length
      ? stats.cheapest.map((c) => h('tr', {}, h('td', {}, c.gpu_model), h('td', { class: 'num' }, usd(c.hourly_rate))))
      : [h('tr', {}, h('td', { colspan: '2', class: 'muted' }, 'no node online'))]));
    showAlertIn('stats-error', null);
  } catch (err) {
    showAlertIn('stats-error', `Could not load the stats: ${err.message}`);
  }
}

function showAlertIn(id, message) {
  $(id).textContent = message ?? '';
  $(id).hidden = !message;
}

function renderLegend() {
  const notes = { busy: '(every slot in use)', draining: '(finishing its jobs, taking no new ones)' };
  $('legend').replaceChildren(...Object.keys(STATUSES).map((s) => h('li', {}, statusBadge(s), h('span', { class: 'muted' }, notes[s] ?? ''))));
}

// Start ---------------------------------------------------------------------------------------------

async function main() {
  renderLegend();
  renderHead();
  mapSvg.addEventListener('click', () => { if (shown) closeCard(false); });
  document.addEventListener('keydown', (event) => { if (event.key === 'Escape' && shown) closeCard(true); });
  let resizeTimer = null;
  window.addEventListener('resize', () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { layoutDirty = true; scheduleRender(); }, 150);
  });
  startClock();
  const world = drawWorld().catch((err) => showAlertIn('map-error', `The map cannot be drawn: ${err.message}. The table below still works.`));
  await Promise.all([refreshNodes(), refreshStats(), world]);
  let cfg = null;
  try {
    cfg = await loadConfig();
    showSession(cfg).catch(() => {});
  } catch (err) {
    setLive('unavailable', 'Live updates unavailable: refreshing every 5 s');
  }
  if (cfg) connectRealtime(cfg);
  setInterval(() => {
    refreshStats();
    if (!live) refreshNodes();
  }, POLL_MS);
}

main();
