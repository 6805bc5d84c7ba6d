// The map's table of nodes, a page at a time: the database searches, sorts and pages (node_list()), so
// a fleet of 100,000 sends the browser one page. The rows of the page on show stay live (map.js
// refreshes them by id); which nodes are on it changes when one searches, sorts, pages, or the fleet
// grows or shrinks.

import { displayStatus, fmt, h, parseTime, statusBadge, timeAgo, usd } from './common.js';

export const PAGE_SIZE = 50;

/** The status, and beside it a node's verification when it failed or is suspect (the card says more). */
function statusCell(node) {
  const flagged = node.verification === 'failed' || node.verification === 'suspect';
  return [statusBadge(displayStatus(node)), flagged ? h('span', { class: `check c-${node.verification}` }, `${node.verification} verification`) : null];
}

const COLUMNS = [
  { key: 'status', label: 'Status', cell: statusCell },
  { key: 'name', label: 'Node', cell: null },
  { key: 'gpu', label: 'GPU', cell: (n) => `${n.gpu_count} × ${n.gpu_model}` },
  { key: 'vram', label: 'VRAM', num: true, cell: (n) => `${fmt(n.vram_gb)} GB` },
  { key: 'tflops', label: 'TFLOPS', num: true, cell: (n) => fmt(n.tflops) },
  { key: 'price', label: '$/h', num: true, cell: (n) => usd(n.hourly_rate) },
  { key: 'region', label: 'Region', cell: (n) => n.region },
  { key: 'load', label: 'Load', num: true, cell: (n) => `${n.inflight}/${n.max_concurrency}` },
  { key: 'beat', label: 'Last heartbeat', cell: (n) => timeAgo(n.last_heartbeat_at) },
];

export function createTable({ readPage, onOpen, onError }) {
  const $ = (id) => document.getElementById(id);
  let query = { search: '', sort: 'name', descending: false, offset: 0 };
  let rows = []; // the page on show
  let total = 0;
  let selected = null;
  let asked = 0; // answers to older questions are dropped
  let loading = null;

  function nameButton(node) {
    return h('button', {
      type: 'button', class: 'link-button', 'aria-label': `${node.name}: show details`, onclick: () => onOpen(node),
    }, node.name);
  }

  function renderHead() {
    $('nodes-head').replaceChildren(...COLUMNS.map((col) => {
      const sorted = query.sort === col.key;
      const button = h('button', { type: 'button', onclick: () => setSort(col.key) }, col.label,
        h('span', { class: 'sort-icon', 'aria-hidden': 'true' }));
      const order = sorted ? (query.descending ? 'descending' : 'ascending') : 'none';
      return h('th', { scope: 'col', class: col.num ? 'num' : null, 'aria-sort': order }, button);
    }));
  }

  function renderRows() {
    // Rows are rebuilt on every update: keep keyboard focus on the same node's row.
    const focused = document.activeElement?.closest?.('#nodes-body tr')?.dataset.id;
    $('nodes-body').replaceChildren(...rows.map((node) => h('tr', {
      'data-id': node.id, 'data-status': displayStatus(node), class: node.id === selected ? 'selected' : null,
    }, COLUMNS.map((col) => h(col.key === 'name' ? 'th' : 'td', {
      class: col.num ? 'num' : null, scope: col.key === 'name' ? 'row' : null, 'data-label': col.label,
    }, col.cell ? col.cell(node) : nameButton(node))))));
    if (focused) $('nodes-body').querySelector(`tr[data-id="${focused}"] button`)?.focus({ preventScroll: true });
    const searching = query.search !== '';
    $('nodes-empty').hidden = rows.length > 0;
    $('nodes-empty').querySelector('.searching').hidden = !searching;
    $('nodes-empty').querySelector('.no-fleet').hidden = searching;
    const first = rows.length ? query.offset + 1 : 0;
    const last = query.offset + rows.length;
    $('nodes-range').textContent = rows.length
      ? `${fmt(first)}–${fmt(last)} of ${fmt(total)}${searching ? ' found' : ''}`
      : searching ? 'none found' : '';
    $('nodes-prev').disabled = query.offset === 0;
    $('nodes-next').disabled = last >= total;
  }

  async function load() {
    const mine = ++asked;
    loading = (async () => {
      try {
        const page = await readPage({ ...query, limit: PAGE_SIZE });
        if (mine !== asked) return;
        if (!page.nodes.length && page.total > 0 && query.offset > 0) { // the last page emptied: go back
          query.offset = Math.max(0, Math.floor((page.total - 1) / PAGE_SIZE) * PAGE_SIZE);
          await load();
          return;
        }
        rows = page.nodes;
        total = page.total;
        renderRows();
        onError(null);
      } catch (err) {
        if (mine === asked) onError(`Could not load the nodes: ${err.message}`);
      }
    })();
    return loading;
  }

  function setSort(key) {
    query = { ...query, sort: key, descending: query.sort === key ? !query.descending : false, offset: 0 };
    renderHead();
    $('nodes-head').querySelector(`th:nth-child(${COLUMNS.findIndex((c) => c.key === key) + 1}) button`).focus();
    return load();
  }

  let searchTimer = null;
  $('nodes-search').addEventListener('input', (event) => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => {
      query = { ...query, search: event.target.value.trim(), offset: 0 };
      load();
    }, 250);
  });
  $('nodes-prev').addEventListener('click', () => {
    query = { ...query, offset: Math.max(0, query.offset - PAGE_SIZE) };
    load();
  });
  $('nodes-next').addEventListener('click', () => {
    query = { ...query, offset: query.offset + PAGE_SIZE };
    load();
  });

  /** Fresh rows of nodes on the page (by id): their status, load and heartbeat. */
  function update(fresh) {
    const byId = new Map(fresh.map((n) => [n.id, n]));
    let changed = false;
    rows = rows.map((row) => {
      const next = byId.get(row.id);
      if (!next) return row;
      const before = parseTime(row.last_heartbeat_at)?.getTime();
      changed ||= displayStatus(next) !== displayStatus(row) || parseTime(next.last_heartbeat_at)?.getTime() !== before
        || next.inflight !== row.inflight || next.verification !== row.verification;
      return { ...row, ...next };
    });
    if (changed) renderRows();
  }

  function select(id) {
    if (selected === id) return;
    selected = id;
    for (const row of document.querySelectorAll('#nodes-body tr')) row.classList.toggle('selected', row.dataset.id === id);
  }

  renderHead();
  return {
    load, update, select,
    ids: () => rows.map((n) => n.id),
    get total() { return total; },
  };
}
