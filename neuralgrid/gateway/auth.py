"""Who is calling: API keys (SHA-256 lookup, a short cache, revocations pushed by Postgres NOTIFY)
and signed-in users' access tokens. No FastAPI here: server/deps.py makes these its dependencies, so
core code (rate limits, admission) takes an ApiKey without importing a route's machinery."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from uuid import UUID

import jwt

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.gateway.errors import Unauthorized
from neuralgrid.server.tokens import TokenKeyError, TokenKeys


@dataclass(frozen=True)
class ApiKey:
    id: UUID
    owner_id: UUID | None
    name: str
    rpm_limit: int | None
    tpm_limit: int | None
    budget_usd: Decimal | None


def digest(raw_key: str) -> bytes:
    return hashlib.sha256(raw_key.encode()).digest()


class KeyStore:
    """Authenticates bearer keys. A NOTIFY drops a cached key at once (revoked, changed). A key
    cached for ttl_s is read again in the background while the cache still answers (what that read
    finds replaces it, or drops it), so that no request waits on Postgres for a key it knows; a key
    not read again for three ttl_s is read before it is used."""

    def __init__(self, store: Store, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._cache: dict[bytes, tuple[ApiKey, float]] = {}
        self._reading: dict[bytes, asyncio.Task[None]] = {}
        self._forgotten = 0  # how many times keys were dropped: a read begun before is not cached

    async def authenticate(self, authorization: str | None) -> ApiKey:
        if not authorization:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if not authorization.lower().startswith("bearer "):  # its words unsaid: they may be the key
            raise Unauthorized(
                "the Authorization header is not a bearer key: send 'Authorization: Bearer <key>'"
            )
        key_digest = digest(authorization[7:].strip())
        cached = self._cache.get(key_digest)
        now = time.monotonic()
        if cached and cached[1] > now:
            return cached[0]
        if cached and cached[1] + 2 * self.ttl_s > now:
            if key_digest not in self._reading:
                task = asyncio.get_running_loop().create_task(self._read_again(key_digest))
                self._reading[key_digest] = task
            return cached[0]
        return await self._read(key_digest)

    async def _read_again(self, key_digest: bytes) -> None:
        try:
            await self._read(key_digest)
        except Unauthorized:
            self._cache.pop(key_digest, None)
        except Exception:  # the cached key serves on until its last ttl; a request reads it then
            pass
        finally:
            self._reading.pop(key_digest, None)

    async def _read(self, key_digest: bytes) -> ApiKey:
        forgotten = self._forgotten
        row = await self.store.one(q.KEY_BY_HASH, (key_digest,))
        # The lookup is by digest; compare_digest keeps the final check constant-time as well.
        if row is None or not hmac.compare_digest(bytes(row.key_hash), key_digest):
            raise Unauthorized("unknown API key")
        if row.revoked:
            raise Unauthorized("this API key has been revoked")
        key = ApiKey(row.id, row.owner_id, row.name, row.rpm_limit, row.tpm_limit, row.budget_usd)
        if self.ttl_s and forgotten == self._forgotten:  # else a revocation may have come since
            self._cache[key_digest] = (key, time.monotonic() + self.ttl_s)
        return key

    def forget(self, key_id: str) -> None:
        self._forgotten += 1
        for cached_digest, (key, _) in list(self._cache.items()):
            if str(key.id) == key_id:
                del self._cache[cached_digest]

    def forget_all(self) -> None:
        """Announcements may have been missed (the listener reconnected): every key is read again
        before its next use but one, which it still serves (served from leases while the database
        is away; a revocation whose announcement was lost then reaches this gateway within ttl_s)."""
        self._forgotten += 1
        stale = time.monotonic() - self.ttl_s
        self._cache = {digest_: (key, min(until, stale)) for digest_, (key, until) in self._cache.items()}


async def verify_user(authorization: str | None, tokens: TokenKeys) -> dict[str, Any]:
    """A Supabase user's JWT, as Supabase Auth issues it: signed with one of the project's signing keys
    (ES256 or RS256, from its JWKS) or with the legacy JWT secret (HS256; the embedded stack's)."""
    header = authorization or ""
    if not header.lower().startswith("bearer "):
        raise Unauthorized("sign in: send 'Authorization: Bearer <Supabase access token>'")
    token = header[7:].strip()
    try:
        found = await tokens.for_token(token)
    except TokenKeyError as err:
        raise Unauthorized(f"invalid access token: {err}") from err
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            found.key,
            algorithms=[found.algorithm],
            audience="authenticated",
            options={"require": ["exp", "sub"]},  # a token that never expires is no session's
        )
    except jwt.PyJWTError as err:
        raise Unauthorized(f"invalid access token: {err}") from err
    if claims.get("role") != "authenticated" or not _is_uuid(claims.get("sub")):
        raise Unauthorized("the access token is not a signed-in user's")
    return claims


def _is_uuid(value: object) -> bool:
    """Supabase Auth's user ids are UUIDs; the policies compare auth.uid() with uuid columns."""
    try:
        UUID(str(value))
    except ValueError:
        return False
    return isinstance(value, str)
