// The one-time sign-in link that `neuralgrid up` prints: /signin#token=…
// The token rides in the fragment, which browsers never send to a server, so no log ever holds it.

import { api, saveLocalSession } from './common.js';

const status = document.getElementById('signin-status');
const error = document.getElementById('signin-error');

function fail(message) {
  status.textContent = 'You are not signed in.';
  error.textContent = message;
  error.hidden = false;
}

async function main() {
  const token = new URLSearchParams(location.hash.slice(1)).get('token');
  // Take the token out of the address bar and history before anything else: it is single-use anyway.
  history.replaceState(null, '', location.pathname);
  if (!token) {
    fail('This page needs the link that neuralgrid up prints (…/signin#token=…). Copy the whole link into the address bar.');
    return;
  }
  try {
    const session = await api('/api/auth/signin', { method: 'POST', body: { token } });
    saveLocalSession(session);
    status.textContent = `Signed in as ${session.user.email}. Opening your API keys…`;
    location.replace('/keys');
  } catch (err) {
    fail(err.message);
  }
}

main();
