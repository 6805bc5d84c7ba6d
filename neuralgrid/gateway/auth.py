"""API keys: SHA-256 lookup, a short cache, and revocations pushed by Postgres NOTIFY."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from decimal import Decimal
from uuid import UUID

import psycopg
from psycopg_pool import AsyncConnectionPool

from neuralgrid.gateway.errors import Unauthorized

log = logging.getLogger(__name__)
CHANNEL = "neuralgrid_api_keys"

LOOKUP = """
select id, owner_id, name, key_hash, rpm_limit, tpm_limit, budget_usd, revoked_at is not null
from public.api_keys where key_hash = %s
"""


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
    """Authenticates bearer keys. A cached key lives at most ttl_s; a NOTIFY drops it at once."""

    def __init__(self, pool: AsyncConnectionPool, ttl_s: float) -> None:
        self.pool = pool
        self.ttl_s = ttl_s
        self._cache: dict[bytes, tuple[ApiKey, float]] = {}

    async def authenticate(self, authorization: str | None) -> ApiKey:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        key_digest = digest(authorization[7:].strip())
        cached = self._cache.get(key_digest)
        if cached and cached[1] > time.monotonic():
            return cached[0]
        async with self.pool.connection() as conn:
            row = await (await conn.execute(LOOKUP, (key_digest,))).fetchone()
        # The lookup is by digest; compare_digest keeps the final check constant-time as well.
        if row is None or not hmac.compare_digest(bytes(row[3]), key_digest):
            raise Unauthorized("unknown API key")
        if row[7]:
            raise Unauthorized("this API key has been revoked")
        key = ApiKey(row[0], row[1], row[2], row[4], row[5], row[6])
        if self.ttl_s:
            self._cache[key_digest] = (key, time.monotonic() + self.ttl_s)
        return key

    def forget(self, key_id: str) -> None:
        for cached_digest, (key, _) in list(self._cache.items()):
            if str(key.id) == key_id:
                del self._cache[cached_digest]

    async def listen(self, url: str, stop: asyncio.Event) -> None:
        """Drop keys as Postgres announces changes; on a lost connection, drop everything."""
        while not stop.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                    await conn.execute(f"listen {CHANNEL}")
                    self._cache.clear()  # changes missed while we were not listening
                    gen = conn.notifies()
                    stopper = asyncio.ensure_future(stop.wait())
                    while not stop.is_set():
                        nxt = asyncio.ensure_future(anext(gen))
                        done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
                        if nxt in done:
                            self.forget(nxt.result().payload)
                        else:
                            nxt.cancel()
                    stopper.cancel()
            except (psycopg.OperationalError, StopAsyncIteration) as err:
                log.warning("key listener lost the database (%s); retrying", err)
                self._cache.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1)
