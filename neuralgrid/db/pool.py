"""The gateway's connection pools: the connection given back last is handed out first.

psycopg_pool hands its connections out in turn (first in, first out), so even one request at a time
spreads over all of them, and each statement runs on a Postgres backend that has not run for a
while: its caches are cold. Handing out the connection returned last (last in, first out, as
pgbouncer, node-postgres and Rails do) keeps the load on as few backends as it needs, and they stay
warm: on the 2-core development machine a sequential request cost Postgres about 0.8x the CPU and
took 0.87x the added latency, side by side (docs/benchmarks.md). The other connections wait at the
far end for a burst; one that waited longer than `idle_check_s` is checked before it is handed out,
since a firewall or pooler may have closed it meanwhile (a connection found broken is replaced by
the pool before anyone uses it).

After an outage the pools reconnect within RECONNECT_MAX_DELAY_S of the database's return.
psycopg_pool doubles its pause between attempts without a cap below its reconnect timeout (1, 2, 4,
… 64 s): an outage of 40 s kept a gateway from its database 18 to 31 s longer, long enough for the
sweep to judge it silent and end the jobs it was still serving.

No statement is prepared. psycopg prepares a statement at its sixth run on a connection, and without
its pipeline mode (two round trips a statement: worse) preparing is a round trip of its own: a
gateway 200 ms from its database paid 200 ms more on whichever request or renewal met it, once per
statement and connection. Unprepared, every statement is one round trip, and Postgres parses and
plans its outer `select` each time: 20 to 70 µs more a statement here (2026-12-07); the functions'
own plans are cached either way. Behind a transaction-mode pooler a prepared statement would be
missing on the next server connection anyway (pgbouncer before 1.21 keeps no track of them).
"""

from __future__ import annotations

import time
from typing import Any
from weakref import WeakKeyDictionary

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from psycopg_pool.base import AttemptWithBackoff

IDLE_CHECK_S = 60.0
RECONNECT_MAX_DELAY_S = 2.0


class CappedBackoff(AttemptWithBackoff):
    """psycopg_pool's pauses between attempts to connect, at most RECONNECT_MAX_DELAY_S."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_MAX_DELAY_S)


async def commit_asynchronously(conn: AsyncConnection[Any]) -> None:
    """A pool's `configure` for the request path: its transactions commit without waiting for the
    WAL flush (see Settings.async_commit)."""
    await conn.execute("set synchronous_commit = off")


class LastInFirstOut(AsyncConnectionPool[AsyncConnection[Any]]):
    def __init__(self, conninfo: str, *, idle_check_s: float = IDLE_CHECK_S, **options: Any) -> None:
        self.idle_check_s = idle_check_s
        # Since when each connection has rested: opened, or last handed out.
        self._rested_since: WeakKeyDictionary[AsyncConnection[Any], float] = WeakKeyDictionary()
        configure = options.pop("configure", None)
        options["kwargs"] = {"prepare_threshold": None, **options.get("kwargs", {})}

        async def opened(conn: AsyncConnection[Any]) -> None:
            self._rested_since[conn] = time.monotonic()
            if configure is not None:
                await configure(conn)

        super().__init__(conninfo, check=self._check_if_idle, configure=opened, **options)

    async def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        # psycopg_pool makes the first attempt's backoff here, and hands it on to the next attempts.
        await super()._add_connection(attempt or CappedBackoff(timeout=self.reconnect_timeout), growing)

    async def _get_ready_connection(self, timeout: float | None) -> AsyncConnection[Any] | None:
        # The ready connections are a deque, a returned one appended at the right, and psycopg_pool
        # takes from the left: the one returned last goes to the left first. (tests/db/test_pool.py
        # checks the order, so a psycopg_pool that keeps them otherwise fails there, not here.) Not
        # when psycopg_pool is about to give up waiting: the order stays as it was.
        if timeout is None or timeout > 0:
            self._pool.rotate(1)
        return await super()._get_ready_connection(timeout)

    async def _check_if_idle(self, conn: AsyncConnection[Any]) -> None:
        """Run for each connection handed out: a round trip only after a long rest (counted from
        when it was opened, for one never handed out before)."""
        now = time.monotonic()
        rested_since = self._rested_since.get(conn, 0.0)
        self._rested_since[conn] = now
        if now - rested_since > self.idle_check_s:
            await AsyncConnectionPool.check_connection(conn)
