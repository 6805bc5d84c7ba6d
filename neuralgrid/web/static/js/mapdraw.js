// The map itself: the world (d3-geo), zoom and pan, and what is drawn on it: a marker per node when the
// view holds few enough, else a cluster per cell (a ring of its statuses and its count); the node card.
// It knows nothing of where data comes from: map.js gives it nodes or clusters and hears of new views.

import { displayStatus, fmt, h, parseTime, STATUSES, statusBadge, statusShape, svg, timeAgo, usd } from './common.js';

export const WIDTH = 960;
export const HEIGHT = 500;
const MAX_ZOOM = 256;
const ORDER = ['online', 'busy', 'draining', 'offline'];

export function createMap({ svgEl, wrapEl, cardEl, onView }) {
  let projection = null;
  let zoom = { k: 1, x: 0, y: 0 };
  const world = svg('g', { class: 'world' });
  const layer = svg('g', { class: 'dots' });
  let mode = 'none'; // 'nodes' | 'clusters'
  const nodes = new Map(); // id -> node (nodes mode)
  const markers = new Map(); // id -> <g>
  let clusters = [];
  let shown = null; // the node whose card is open
  let pinned = false;
  let moved = false;
  let viewTimer = null;
  svgEl.dataset.zoom = '1';

  // The world and its zoom --------------------------------------------------------------------------

  async function drawWorld() {
    if (!window.d3?.geoNaturalEarth1 || !window.topojson) {
      throw new Error('the map libraries are not installed on this gateway: run ./dev up (or npm install)');
    }
    const response = await fetch('/vendor/countries-110m.json');
    if (!response.ok) throw new Error('the world map is not installed on this gateway: run ./dev up (or npm install)');
    const atlas = await response.json();
    projection = d3.geoNaturalEarth1().fitExtent([[6, 6], [WIDTH - 6, HEIGHT - 6]], { type: 'Sphere' });
    const path = d3.geoPath(projection);
    const countries = atlas.objects.countries;
    world.replaceChildren(
      svg('path', { class: 'sphere', d: path({ type: 'Sphere' }) }),
      svg('path', { class: 'graticule', d: path(d3.geoGraticule10()) }),
      svg('path', { class: 'land', d: path(topojson.feature(atlas, countries)) }),
      svg('path', { class: 'borders', d: path(topojson.mesh(atlas, countries, (a, b) => a !== b)) }),
    );
    render();
  }

  function place(k, x, y) {
    k = Math.min(MAX_ZOOM, Math.max(1, k));
    x = Math.min(0, Math.max(WIDTH - WIDTH * k, x));
    y = Math.min(0, Math.max(HEIGHT - HEIGHT * k, y));
    if (k === zoom.k && x === zoom.x && y === zoom.y) return;
    zoom = { k, x, y };
    world.setAttribute('transform', `translate(${x.toFixed(2)} ${y.toFixed(2)}) scale(${k})`);
    svgEl.dataset.zoom = String(Math.round(k * 100) / 100);
    render();
    clearTimeout(viewTimer);
    viewTimer = setTimeout(() => onView(), 120);
  }

  /** Zooms by `factor` about a point of the view box (its centre by default). */
  function zoomBy(factor, at = [WIDTH / 2, HEIGHT / 2]) {
    const k = Math.min(MAX_ZOOM, Math.max(1, zoom.k * factor));
    place(k, at[0] - ((at[0] - zoom.x) * k) / zoom.k, at[1] - ((at[1] - zoom.y) * k) / zoom.k);
  }

  /** Centres a place at zoom k. */
  function zoomTo(longitude, latitude, k) {
    const p = projection?.([longitude, latitude]);
    if (!p) return;
    const scale = Math.min(MAX_ZOOM, Math.max(1, k));
    place(scale, WIDTH / 2 - p[0] * scale, HEIGHT / 2 - p[1] * scale);
  }

  function toScreen(longitude, latitude) {
    const p = projection?.([longitude, latitude]);
    return p ? [p[0] * zoom.k + zoom.x, p[1] * zoom.k + zoom.y] : null;
  }

  /** The view as a box of longitudes and latitudes (the whole world unzoomed), a little wider. */
  function box() {
    if (!projection || zoom.k === 1) return { west: -180, south: -90, east: 180, north: 90 };
    const lons = [];
    const lats = [];
    for (let i = 0; i <= 12; i++) {
      for (let j = 0; j <= 8; j++) {
        const point = projection.invert([((i * WIDTH) / 12 - zoom.x) / zoom.k, ((j * HEIGHT) / 8 - zoom.y) / zoom.k]);
        if (!point || !Number.isFinite(point[0]) || !Number.isFinite(point[1])) continue;
        if (Math.abs(point[0]) > 180 || Math.abs(point[1]) > 90) continue;
        lons.push(point[0]);
        lats.push(point[1]);
      }
    }
    if (!lons.length) return { west: -180, south: -90, east: 180, north: 90 };
    const [west, east, south, north] = [Math.min(...lons), Math.max(...lons), Math.min(...lats), Math.max(...lats)];
    const [padX, padY] = [(east - west) * 0.08 + 0.01, (north - south) * 0.08 + 0.01];
    return {
      west: Math.max(-180, west - padX), east: Math.min(180, east + padX),
      south: Math.max(-90, south - padY), north: Math.min(90, north + padY),
    };
  }

  /** Degrees per cluster cell at this zoom: some 48 pixels apart on the screen. */
  function cellDegrees() {
    return 18 / zoom.k;
  }

  function viewPoint(event) {
    const rect = svgEl.getBoundingClientRect();
    return [((event.clientX - rect.left) * WIDTH) / rect.width, ((event.clientY - rect.top) * HEIGHT) / rect.height];
  }

  svgEl.addEventListener('wheel', (event) => {
    event.preventDefault();
    zoomBy(event.deltaY < 0 ? 1.5 : 1 / 1.5, viewPoint(event));
  }, { passive: false });
  let drag = null;
  svgEl.addEventListener('pointerdown', (event) => {
    if (event.button !== 0) return;
    drag = { at: viewPoint(event), x: zoom.x, y: zoom.y };
    moved = false;
  });
  svgEl.addEventListener('pointermove', (event) => {
    if (!drag) return;
    const at = viewPoint(event);
    const [dx, dy] = [at[0] - drag.at[0], at[1] - drag.at[1]];
    if (!moved && Math.hypot(dx, dy) < 4) return;
    moved = true;
    place(zoom.k, drag.x + dx, drag.y + dy);
  });
  window.addEventListener('pointerup', () => { drag = null; });

  // Nodes and clusters ---------------------------------------------------------------------------

  function setNodes(rows) {
    mode = 'nodes';
    clusters = [];
    const seen = new Set();
    for (const row of rows) {
      seen.add(row.id);
      const old = nodes.get(row.id);
      const node = { warm_models: [], available_models: [], ...row };
      nodes.set(row.id, node);
      const before = parseTime(old?.last_heartbeat_at)?.getTime();
      const after = parseTime(node.last_heartbeat_at)?.getTime();
      if (old && after && after !== before) queueMicrotask(() => pulse(node.id));
    }
    for (const id of [...nodes.keys()]) {
      if (seen.has(id)) continue;
      nodes.delete(id);
      if (shown?.id === id) closeCard(false); // gone, or out of view
    }
    render();
  }

  /** The node whose card is open, read again (from the table's page, when the map does not show it). */
  function updateShown(rows) {
    const row = shown && !nodes.has(shown.id) && rows.find((r) => r.id === shown.id);
    if (row) openCard({ ...shown, ...row }, pinned);
  }

  function setClusters(list) {
    mode = 'clusters';
    clusters = list;
    nodes.clear();
    render();
  }

  function markerScale() {
    return Math.min(3, Math.max(1.3, 900 / (svgEl.clientWidth || WIDTH)));
  }

  /** Located nodes at their screen places; those of one city step out along a spiral. */
  function layout() {
    const positions = new Map();
    const gap = 12 * markerScale();
    const cells = new Map();
    const crowded = (x, y) => {
      const [cx, cy] = [Math.floor(x / gap), Math.floor(y / gap)];
      for (let dx = -1; dx <= 1; dx++) {
        for (let dy = -1; dy <= 1; dy++) {
          for (const [px, py] of cells.get(`${cx + dx},${cy + dy}`) ?? []) if (Math.hypot(px - x, py - y) < gap) return true;
        }
      }
      return false;
    };
    const located = [...nodes.values()].filter((n) => n.latitude != null && n.longitude != null);
    located.sort((a, b) => a.name.localeCompare(b.name) || a.id.localeCompare(b.id));
    for (const node of located) {
      const point = toScreen(Number(node.longitude), Number(node.latitude));
      if (!point) continue;
      let [x, y] = point;
      for (let i = 1; crowded(x, y) && i < 500; i++) {
        const radius = gap * 0.6 * Math.sqrt(i);
        x = point[0] + radius * Math.cos(i * 2.39996); // the golden angle spreads points evenly
        y = point[1] + radius * Math.sin(i * 2.39996);
      }
      const key = `${Math.floor(x / gap)},${Math.floor(y / gap)}`;
      cells.set(key, [...(cells.get(key) ?? []), [x, y]]);
      positions.set(node.id, [x, y]);
    }
    return positions;
  }

  function describe(node) {
    const status = displayStatus(node);
    const failed = node.verification === 'failed' ? ', failed verification' : '';
    return `${node.name}: ${STATUSES[status].label}${failed}, ${node.gpu_count} × ${node.gpu_model}, ${usd(node.hourly_rate)} per hour, ${node.region}`;
  }

  function marker(id) {
    let g = markers.get(id);
    if (g) return g;
    g = svg('g', { class: 'node', tabindex: '0', role: 'button', 'aria-controls': 'card', 'aria-expanded': 'false', 'data-id': id },
      svg('circle', { class: 'pulse', r: '6' }), svg('circle', { class: 'verify-ring', r: '8.5' }), statusShape('online'),
      svg('circle', { class: 'focus-ring', r: '9' }));
    g.addEventListener('mouseenter', () => { if (!pinned) openCard(nodes.get(id), false); });
    g.addEventListener('mouseleave', () => { if (!pinned && shown?.id === id) closeCard(false); });
    g.addEventListener('focus', () => { if (!pinned) openCard(nodes.get(id), false); });
    g.addEventListener('blur', () => { if (!pinned && shown?.id === id) closeCard(false); });
    g.addEventListener('click', (event) => { event.stopPropagation(); openCard(nodes.get(id), true); });
    g.addEventListener('keydown', (event) => {
      if (event.key === 'Enter' || event.key === ' ') {
        event.preventDefault();
        openCard(nodes.get(id), true);
      }
    });
    markers.set(id, g);
    return g;
  }

  function ring(counts, radius) {
    const total = counts.reduce((a, b) => a + b, 0) || 1;
    const around = 2 * Math.PI * radius;
    let done = 0;
    return ORDER.flatMap((status, i) => {
      if (!counts[i]) return [];
      const length = (around * counts[i]) / total;
      const arc = svg('circle', {
        class: `arc s-${status}`, r: radius.toFixed(2), 'stroke-dasharray': `${length.toFixed(2)} ${(around - length).toFixed(2)}`,
        'stroke-dashoffset': (-done).toFixed(2), transform: 'rotate(-90)',
      });
      done += length;
      return [arc];
    });
  }

  function short(n) {
    if (n < 1000) return String(n);
    if (n < 10000) return `${(n / 1000).toFixed(1).replace(/\.0$/, '')}k`;
    if (n < 1e6) return `${Math.round(n / 1000)}k`;
    return `${(n / 1e6).toFixed(1)}M`;
  }

  function clusterMarker(cluster) {
    const total = cluster.counts.reduce((a, b) => a + b, 0);
    const radius = radiusOf(total);
    const words = ORDER.map((s, i) => `${fmt(cluster.counts[i])} ${s}`).join(', ');
    const where = `${Number(cluster.lat).toFixed(1)}, ${Number(cluster.lon).toFixed(1)}`;
    const zoomIn = () => zoomTo(cluster.lon, cluster.lat, zoom.k * 4);
    return svg('g', {
      class: 'cluster', tabindex: '0', role: 'button', 'data-count': String(total),
      'aria-label': `${fmt(total)} nodes near ${where}: ${words}. Zoom in`,
      onclick: (event) => { event.stopPropagation(); if (!moved) zoomIn(); },
      onkeydown: (event) => { if (event.key === 'Enter' || event.key === ' ') { event.preventDefault(); zoomIn(); } },
    },
    svg('circle', { class: 'disc', r: radius.toFixed(2) }),
    ...ring(cluster.counts, radius - 2.5),
    svg('text', { class: 'count', 'text-anchor': 'middle', dy: '0.35em' }, short(total)),
    svg('circle', { class: 'focus-ring', r: (radius + 3).toFixed(2) }));
  }

  const radiusOf = (total) => 9 + 3.2 * Math.log10(Math.max(1, total));

  /** Clusters on the screen, those that would overlap merged (the biggest first take the smaller in). */
  function merged() {
    const placed = [];
    const sorted = clusters.map((c) => ({ ...c, total: c.counts.reduce((a, b) => a + b, 0) })).sort((a, b) => b.total - a.total);
    for (const cluster of sorted) {
      const at = toScreen(cluster.lon, cluster.lat);
      if (!at) continue;
      const near = placed.find((p) => Math.hypot(p.x - at[0], p.y - at[1]) < radiusOf(p.total) + radiusOf(cluster.total));
      if (!near) {
        placed.push({ ...cluster, x: at[0], y: at[1], counts: [...cluster.counts] });
        continue;
      }
      const total = near.total + cluster.total;
      near.lat = (near.lat * near.total + cluster.lat * cluster.total) / total;
      near.lon = (near.lon * near.total + cluster.lon * cluster.total) / total;
      near.counts = near.counts.map((n, i) => n + cluster.counts[i]);
      near.total = total;
    }
    return placed;
  }

  function render() {
    if (!layer.isConnected) svgEl.replaceChildren(world, layer);
    if (mode === 'clusters') {
      for (const g of markers.values()) g.remove();
      markers.clear();
      layer.replaceChildren(...merged().map((cluster) => {
        const g = clusterMarker(cluster);
        g.setAttribute('transform', `translate(${cluster.x.toFixed(1)} ${cluster.y.toFixed(1)})`);
        return g;
      }));
    } else {
      for (const g of layer.querySelectorAll('.cluster')) g.remove();
      const positions = projection ? layout() : new Map();
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
        // A node that failed verification is ringed: it cheated on a model (or its server broke it).
        g.setAttribute('class', `node s-${status}${node.verification === 'failed' ? ' verify-failed' : ''}`);
        g.setAttribute('aria-label', describe(node));
        g.dataset.status = status;
        g.dataset.verification = node.verification ?? '';
        g.querySelector('.shape').setAttribute('d', STATUSES[status].path);
        if (!g.isConnected) layer.append(g);
      }
    }
    if (shown) {
      if (nodes.has(shown.id)) shown = nodes.get(shown.id);
      renderCard();
    }
  }

  function pulse(id) {
    const dot = markers.get(id)?.querySelector('.pulse');
    if (!dot) return;
    dot.classList.remove('pulsing');
    dot.getBoundingClientRect(); // a reflow, so that adding the class starts the animation again
    dot.classList.add('pulsing');
  }

  // The node card --------------------------------------------------------------------------------

  let onCard = () => {};

  function openCard(node, pin) {
    if (!node) return;
    shown = node;
    pinned = pin;
    renderCard();
  }

  function closeCard(restoreFocus) {
    const id = shown?.id;
    shown = null;
    pinned = false;
    renderCard();
    if (restoreFocus && id) markers.get(id)?.focus();
  }

  function percent(value) {
    return value == null ? null : `${Math.round(value * 100)}%`;
  }

  function verificationText(state) {
    if (!state) return 'no model checked';
    const words = {
      failed: 'failed: a model it serves did not pass the platform\'s challenges; it gets no requests for it',
      suspect: 'suspect: a challenge failed lately; challenged more often',
      unverified: 'not yet verified: being challenged',
      verified: 'verified: its models pass the platform\'s challenges',
    };
    return h('span', { class: `check-word c-${state}` }, words[state] ?? state);
  }

  function renderCard() {
    for (const [id, g] of markers) g.setAttribute('aria-expanded', String(id === shown?.id));
    onCard(shown?.id ?? null);
    const node = shown;
    if (!node) {
      cardEl.hidden = true;
      return;
    }
    const status = displayStatus(node);
    const load = [`${node.inflight}/${node.max_concurrency} in flight`];
    if (node.gpu_utilization != null) load.push(`GPU ${percent(node.gpu_utilization)}`);
    if (node.queue_depth !== undefined) load.push(`queue ${node.queue_depth}`);
    const total = node.successes + node.failures;
    const reputation = total ? `${node.successes} ok / ${node.failures} failed (${Math.round((100 * node.successes) / total)}%)` : 'no jobs yet';
    const cooldown = parseTime(node.cooldown_until);
    const rows = [
      ['Status', [statusBadge(status), node.missed_heartbeats ? ` · ${node.missed_heartbeats} missed heartbeats` : '',
        cooldown && cooldown > new Date() ? ' · cooling down' : '']],
      ['GPU', `${node.gpu_count} × ${node.gpu_model}`],
      ['VRAM', `${fmt(node.vram_gb)} GB${node.free_vram_gb != null ? ` (${fmt(node.free_vram_gb)} GB free)` : ''}`],
      ['Compute', `${fmt(node.tflops)} TFLOPS`],
      ['Price', `${usd(node.hourly_rate)} per hour`],
      ['Region', node.region],
      ['Warm models', node.warm_models?.length ? h('ul', {}, node.warm_models.map((m) => h('li', {}, m))) : 'none loaded'],
      ['Load', load.join(' · ')],
      ['Reputation', reputation],
      ['Verification', verificationText(node.verification)],
      ['Last heartbeat', timeAgo(node.last_heartbeat_at)],
    ];
    const close = h('button', { type: 'button', 'aria-label': 'Close node details', onclick: () => closeCard(true) }, '×');
    const hadFocus = cardEl.contains(document.activeElement); // live updates must not steal keyboard focus
    cardEl.replaceChildren(
      h('div', { class: 'card-head' }, h('h3', { id: 'card-title' }, node.name), pinned ? close : null),
      h('dl', {}, rows.flatMap(([term, value]) => [h('dt', {}, term), h('dd', {}, value)])),
    );
    cardEl.setAttribute('aria-labelledby', 'card-title');
    cardEl.hidden = false;
    if (hadFocus && pinned) close.focus({ preventScroll: true });
    placeCard(node.id);
  }

  /** Floats the card beside its marker, inside the map (on phones CSS lays it out under the map). */
  function placeCard(id) {
    if (getComputedStyle(cardEl).position !== 'absolute') return;
    const wrap = wrapEl.getBoundingClientRect();
    const dot = markers.get(id)?.getBoundingClientRect();
    const [width, height] = [cardEl.offsetWidth, cardEl.offsetHeight];
    let [left, top] = [8, 8];
    if (dot) {
      left = dot.right - wrap.left + 10;
      if (left + width > wrap.width) left = dot.left - wrap.left - width - 10;
      top = dot.top - wrap.top - 16;
    }
    cardEl.style.left = `${Math.max(0, Math.min(left, wrap.width - width))}px`;
    cardEl.style.top = `${Math.max(0, Math.min(top, wrap.height - height))}px`;
  }

  svgEl.addEventListener('click', () => { if (shown && !moved) closeCard(false); });
  let resizeTimer = null;
  window.addEventListener('resize', () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(render, 150);
  });

  return {
    drawWorld, box, cellDegrees, zoomBy, zoomTo, setNodes, updateShown, setClusters, openCard, closeCard,
    reset: () => place(1, 0, 0),
    get zoom() { return zoom.k; },
    get mode() { return mode; },
    get shownId() { return shown?.id ?? null; },
    nodeIds: () => [...nodes.keys()],
    hasMarker: (id) => markers.has(id),
    focusMarker: (id) => markers.get(id)?.focus({ preventScroll: true }),
    onCardChange: (callback) => { onCard = callback; },
  };
}
