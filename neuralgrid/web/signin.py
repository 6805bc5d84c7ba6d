"""One-time sign-in links for the users of an embedded stack: the local owner, and those that
`neuralgrid users add` makes.

`neuralgrid up` prints `<gateway>/signin#token=…`; the page trades the token for a user access token
(`POST /api/auth/signin`). Only the token's SHA-256 is kept, with its expiry and its user's email, in a
file under NEURALGRID_HOME: the gateway that checks it may run in another process than the command that
printed it, and a token read from disk is useless. On a hosted Supabase project users sign in by email
instead.
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
from typing import Any
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
def _token_store(settings: Settings) -> Iterator[dict[str, tuple[float, str]]]:
    """The live tokens (digest -> expiry and email), read and rewritten under an exclusive lock, so
    that two gateways never both accept the same token."""
    path = tokens_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            stored: dict[str, Any] = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            stored = {}  # none issued yet, or a torn file: either way no token is valid
        now = time.time()
        entries = {digest: _entry(value) for digest, value in stored.items()}
        store = {digest: entry for digest, entry in entries.items() if entry[0] > now}
        yield store
        scratch = path.with_suffix(".tmp")
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(store, f)
        os.replace(scratch, path)  # atomic: a crash leaves the old file or the new one
    finally:
        os.close(lock)  # closing releases the lock


def _entry(value: Any) -> tuple[float, str]:
    """A kept token: [expiry, email]; a bare expiry (as the first tokens were kept) is the owner's."""
    if isinstance(value, list):
        return float(value[0]), str(value[1])
    return float(value), LOCAL_OWNER_EMAIL


def issue_signin_token(settings: Settings, email: str = LOCAL_OWNER_EMAIL) -> str:
    """A new token that signs in the user with this email, valid once for TOKEN_TTL_S; the caller puts
    it in a link's fragment."""
    token = secrets.token_urlsafe(32)
    with _token_store(settings) as store:
        store[_digest(token)] = (time.time() + TOKEN_TTL_S, email)
    return token


def consume_signin_token(settings: Settings, token: str) -> str | None:
    """The email of the user the token signs in, exactly once per issued token, and only before it
    expires; else None."""
    with _token_store(settings) as store:
        entry = store.pop(_digest(token), None)
    return None if entry is None else entry[1]


def signin_link(settings: Settings, base_url: str, email: str = LOCAL_OWNER_EMAIL) -> str | None:
    """The link `neuralgrid up` prints (for another user: `neuralgrid users add`); None where Supabase
    Auth signs users in (hosted mode)."""
    if settings.supabase_url:
        return None
    # The fragment never reaches a server, so the token stays out of access logs and Referer headers.
    return f"{base_url.rstrip('/')}/signin#token={issue_signin_token(settings, email)}"


async def signin_user(store: Store, email: str) -> UUID | None:
    """The id of the user a token signs in: the local owner, created on first sign-in; another user
    (`neuralgrid users add`) only while they exist."""
    if email == LOCAL_OWNER_EMAIL:
        return await ensure_local_owner(store)
    user_id: UUID | None = await store.one(q.USER_ID, (email,))
    return user_id


async def ensure_local_owner(store: Store) -> UUID:
    """The local owner's user id, creating the auth.users row on first sign-in."""
    await store.one(q.ADD_USER, {"email": LOCAL_OWNER_EMAIL})
    user_id: UUID = await store.get(q.USER_ID, (LOCAL_OWNER_EMAIL,))
    return user_id
