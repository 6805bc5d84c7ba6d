// What every page shares: DOM building, the API client, the session, formatting and status shapes.

const SESSION_KEY = 'neuralgrid.session';
const SVG_NS = 'http://www.w3.org/2000/svg';

/** An element with properties (attributes, or on* listeners) and children (nodes or text). */
export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  setProps(el, props);
  el.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return el;
}

/** The same for SVG elements. */
export function svg(tag, props = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setProps(el, props);
  el.append(...children);
  return el;
}

function setProps(el, props) {
  for (const [name, value] of Object.entries(props)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith('on')) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? '' : String(value));
  }
}

// Statuses ------------------------------------------------------------------------------------------

// Each status has its own shape as well as colour, so the map reads without colour vision.
export const STATUSES = {
  online: { label: 'online', path: 'M-5,0a5,5 0 1,0 10,0a5,5 0 1,0 -10,0Z' },
  busy: { label: 'busy', path: 'M0,-6L6,0L0,6L-6,0Z' },
  draining: {
    label: 'draining',
    path: 'M-5.5,0a5.5,5.5 0 1,0 11,0a5.5,5.5 0 1,0 -11,0ZM-2.5,0a2.5,2.5 0 1,0 5,0a2.5,2.5 0 1,0 -5,0Z',
  },
  offline: { label: 'offline', path: 'M-5,-3L-3,-5L0,-2L3,-5L5,-3L2,0L5,3L3,5L0,2L-3,5L-5,3L-2,0Z' },
};

/** The status a person should see: an online node with every slot taken is busy. */
export function displayStatus(node) {
  if (node.status === 'online' && Number(node.inflight) >= Number(node.max_concurrency)) return 'busy';
  return node.status in STATUSES ? node.status : 'offline';
}

export function statusShape(status) {
  return svg('path', { class: 'shape', d: STATUSES[status].path, 'fill-rule': 'evenodd', fill: 'currentColor' });
}

/** A status as icon and word, for tables and cards. */
export function statusBadge(status) {
  const icon = svg('svg', { viewBox: '-7 -7 14 14', 'aria-hidden': 'true', focusable: 'false' }, statusShape(status));
  return h('span', { class: `status s-${status}` }, icon, STATUSES[status].label);
}

// API -----------------------------------------------------------------------------------------------

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** JSON in and out; an error response (OpenAI-shaped, or FastAPI's) becomes an ApiError. */
export async function api(path, { method = 'GET', body, token } = {}) {
  const headers = { accept: 'application/json' };
  if (body !== undefined) headers['content-type'] = 'application/json';
  if (token) headers.authorization = `Bearer ${token}`;
  let response;
  try {
    response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (err) {
    throw new ApiError(0, `cannot reach the gateway (${err.message}); is neuralgrid up still running?`);
  }
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const message = data?.error?.message ?? data?.detail ?? `${response.status} ${response.statusText}`;
    throw new ApiError(response.status, typeof message === 'string' ? message : JSON.stringify(message));
  }
  return data;
}

let configPromise = null;
export function loadConfig() {
  configPromise ??= api('/api/config').catch((err) => {
    configPromise = null; // asked again next time: the gateway may be back
    throw err;
  });
  return configPromise;
}

let client = null;
/** The page's one supabase-js client (Realtime everywhere; Auth on a hosted project). */
export function supabaseClient(cfg) {
  if (!window.supabase) throw new Error('supabase-js is not installed on this gateway: run npm install');
  client ??= window.supabase.createClient(cfg.supabase_url, cfg.anon_key);
  return client;
}

// Session: one shape {access_token, expires_at, user}, whichever way the user signed in ------------

export function saveLocalSession(session) {
  localStorage.setItem(SESSION_KEY, JSON.stringify(session));
}

/** The signed-in user's session, or null: from the sign-in link (embedded) or Supabase Auth. */
export async function getSession(cfg) {
  if (cfg.mode === 'supabase') {
    const { data } = await supabaseClient(cfg).auth.getSession();
    const s = data.session;
    return s ? { access_token: s.access_token, expires_at: s.expires_at, user: { id: s.user.id, email: s.user.email } } : null;
  }
  let session = null;
  try {
    session = JSON.parse(localStorage.getItem(SESSION_KEY));
  } catch {
    session = null;
  }
  if (!session?.access_token || session.expires_at * 1000 <= Date.now() + 30_000) {
    localStorage.removeItem(SESSION_KEY);
    return null;
  }
  return session;
}

export async function signOut(cfg) {
  localStorage.removeItem(SESSION_KEY);
  if (cfg.mode === 'supabase') await supabaseClient(cfg).auth.signOut();
}

/** The header's "signed in as … / sign out". */
export async function showSession(cfg, onSignOut = () => location.reload()) {
  const box = document.getElementById('session');
  const session = await getSession(cfg).catch(() => null);
  if (!session) {
    box.replaceChildren();
    return null;
  }
  const out = h('button', { type: 'button', onclick: async () => { await signOut(cfg); onSignOut(); } }, 'Sign out');
  box.replaceChildren(h('span', {}, 'Signed in as ', h('strong', {}, session.user.email ?? 'you')), out);
  return session;
}

/** A page for signed-in users (its #signin-needed and #signed-in boxes): the config and the session,
 * with #signed-in shown; or null, once #signin-needed says why not (the gateway is unreachable, or
 * nobody is signed in: the sign-in form). */
export async function enterSignedIn() {
  const needed = document.getElementById('signin-needed');
  let cfg;
  try {
    cfg = await loadConfig();
  } catch (err) {
    needed.hidden = false;
    needed.replaceChildren(h('p', { class: 'alert error', role: 'alert' }, `Cannot reach the gateway: ${err.message}`));
    return null;
  }
  const session = await showSession(cfg);
  if (!session) {
    showSignIn(cfg);
    return null;
  }
  needed.hidden = true;
  document.getElementById('signed-in').hidden = false;
  return { cfg, session };
}

/** Hides a signed-in page's content and shows how to sign in (again, with `reason`). */
export function showSignIn(cfg, reason = '') {
  document.getElementById('signed-in').hidden = true;
  const needed = document.getElementById('signin-needed');
  needed.hidden = false;
  renderSignIn(needed, cfg, { reason });
}

/** What a page that needs a user shows to a visitor: how to sign in, for this kind of stack. */
export function renderSignIn(box, cfg, { reason = '' } = {}) {
  const intro = reason ? h('p', { class: 'alert error', role: 'alert' }, reason) : null;
  if (cfg.mode !== 'supabase') {
    box.replaceChildren(
      h('h2', {}, 'Sign in to continue'),
      intro,
      h('p', {}, 'Run ', h('code', {}, 'neuralgrid up'), ' and open the sign-in link it prints (',
        h('code', {}, 'sign in   http://…/signin#token=…'), '). Each link works once, for 10 minutes.'),
    );
    return;
  }
  // A hosted Supabase project: Supabase Auth emails a magic link that comes back to this page.
  const email = h('input', { id: 'signin-email', type: 'email', required: true, autocomplete: 'email', 'aria-describedby': 'signin-msg' });
  const message = h('p', { id: 'signin-msg', role: 'status' });
  const form = h('form', { novalidate: true }, h('label', { for: 'signin-email' }, 'Email'), email,
    h('div', { class: 'form-actions' }, h('button', { class: 'primary', type: 'submit' }, 'Email me a sign-in link')), message);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    if (!email.value.trim() || !email.checkValidity()) {
      email.setAttribute('aria-invalid', 'true');
      message.className = 'alert error';
      message.textContent = 'Enter the email address to send the sign-in link to.';
      return;
    }
    email.removeAttribute('aria-invalid');
    const redirect = `${location.origin}${location.pathname}`;
    const { error } = await supabaseClient(cfg).auth.signInWithOtp({ email: email.value.trim(), options: { emailRedirectTo: redirect } });
    message.className = error ? 'alert error' : 'alert ok';
    message.textContent = error ? `Could not send the link: ${error.message}` : `Check ${email.value.trim()} for a sign-in link.`;
  });
  box.replaceChildren(h('h2', {}, 'Sign in to continue'), intro, form);
}

// Forms ---------------------------------------------------------------------------------------------

/** Shows (or clears, with null) a field's error next to it and marks the field invalid. */
export function fieldError(input, message) {
  const note = document.getElementById(`${input.id}-error`);
  note.textContent = message ?? '';
  note.hidden = !message;
  if (message) input.setAttribute('aria-invalid', 'true');
  else input.removeAttribute('aria-invalid');
  return !message;
}

export function showAlert(el, message) {
  el.textContent = message ?? '';
  el.hidden = !message;
}

/** A button that copies text, saying so (or how to copy by hand where the clipboard is off-limits). */
export function wireCopy(button, text) {
  button.addEventListener('click', async () => {
    const label = button.dataset.label ?? button.textContent;
    button.dataset.label = label;
    try {
      await navigator.clipboard.writeText(text());
      button.textContent = 'Copied';
    } catch {
      button.textContent = 'Select and copy by hand';
    }
    setTimeout(() => { button.textContent = label; }, 2000);
  });
}

// Formatting ----------------------------------------------------------------------------------------

const number = new Intl.NumberFormat('en-US', { maximumFractionDigits: 1 });
export const fmt = (value) => (value === null || value === undefined || Number.isNaN(Number(value)) ? '–' : number.format(Number(value)));
export const usd = (value, digits = 2) => (value === null || value === undefined ? '–' : `$${Number(value).toFixed(digits)}`);

/** Postgres and ISO timestamps alike ("2026-11-21 07:00:00.12+00" as well as "…T…+00:00"). */
export function parseTime(value) {
  if (!value) return null;
  if (value instanceof Date) return value;
  const iso = String(value).replace(' ', 'T').replace(/([+-]\d\d)$/, '$1:00');
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? null : date;
}

export function relativeTime(date, now = Date.now()) {
  if (!date) return 'never';
  const s = Math.round((now - date.getTime()) / 1000);
  if (s < 2) return 'just now';
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

/** A <time> that keeps saying how long ago it was (see startClock). */
export function timeAgo(value) {
  const date = parseTime(value);
  const el = h('time', date ? { datetime: date.toISOString(), title: date.toLocaleString(), 'data-relative': '' } : {});
  el.textContent = relativeTime(date);
  return el;
}

/** Refreshes every relative time on the page once a second. */
export function startClock() {
  setInterval(() => {
    const now = Date.now();
    for (const el of document.querySelectorAll('time[data-relative]')) {
      el.textContent = relativeTime(new Date(el.getAttribute('datetime')), now);
    }
  }, 1000);
}
