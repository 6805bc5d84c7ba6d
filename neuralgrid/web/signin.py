"""One-time sign-in links for the local owner of an embedded stack.

`neuralgrid up` prints `<gateway>/signin#token=…`; the page trades the token for a user access token
(`POST /api/auth/signin`). Only the token's SHA-256 is kept, with its expiry, in a file under
NEURALGRID_HOME: the gateway that checks it may run in another process than the command that printed
it, and a token read from disk is useless. On a hosted Supabase project users sign in by email instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.server.settings import Settings

LOCAL_OWNER_EMAIL = "owner@localhost"
TOKEN_TTL_S = 10 * 60
SESSION_TTL_S = 12 * 3600


def tokens_file(settings: Settings) -> Path:
    return settings.home / "signin-tokens.json"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@contextlib.contextmanager
def _token_store(settings: Settings) -> Iterator[dict[str, float]]:
    """The live tokens (digest -> expiry), read and rewritten under an exclusive lock, so that two
    gateways never both accept the same token."""
    path = tokens_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            stored: dict[str, float] = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            stored = {}  # none issued yet, or a torn file: either way no token is valid
        now = time.time()
        store = {digest: expiry for digest, expiry in stored.items() if expiry > now}
        yield store
        scratch = path.with_suffix(".tmp")
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(store, f)
        os.replace(scratch, path)  # atomic: a crash leaves the old file or the new one
    finally:
        os.close(lock)  # closing releases the lock


def issue_signin_token(settings: Settings) -> str:
    """A new token, valid once for TOKEN_TTL_S; the caller puts it in a link's fragment."""
    token = secrets.token_urlsafe(32)
    with _token_store(settings) as store:
        store[_digest(token)] = time.time() + TOKEN_TTL_S
    return token


def consume_signin_token(settings: Settings, token: str) -> bool:
    """True exactly once per issued token, and only before it expires."""
    with _token_store(settings) as store:
        return store.pop(_digest(token), None) is not None


def signin_link(settings: Settings, base_url: str) -> str | None:
    """The link `neuralgrid up` prints; None where Supabase Auth signs users in (hosted mode)."""
    if settings.supabase_url:
        return None
    # The fragment never reaches a server, so the token stays out of access logs and Referer headers.
    return f"{base_url.rstrip('/')}/signin#token={issue_signin_token(settings)}"


async def ensure_local_owner(store: Store) -> UUID:
    """The local owner's user id, creating the auth.users row on first sign-in."""
    await store.one(q.ADD_USER, {"email": LOCAL_OWNER_EMAIL})
    user_id: UUID = await store.get(q.USER_ID, (LOCAL_OWNER_EMAIL,))
    return user_id
