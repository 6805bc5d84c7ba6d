"""The sweeper: calls sweep() every second, which marks silent nodes offline and ends the jobs whose
completion will not come: those of a gateway silent for platform_settings.gateway_timeout_s (see
server/liveness.py), and any still running past platform_settings.job_deadline_s.

Where pg_cron is enabled, the database runs it too (public.schedule_sweep()); running both is
harmless (the updates are idempotent), so every gateway instance may run a sweeper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store

log = logging.getLogger(__name__)


async def sweep_once(conn: psycopg.AsyncConnection) -> list[str]:
    """One sweep; returns the names of nodes it set offline. Jobs it ended are logged."""
    names = []
    for swept in await Store(conn).all(q.SWEEP):
        if swept.kind == "node_offline":
            names.append(str(swept.name))
        elif swept.kind == "job_orphaned":
            log.warning("job %s: its gateway stopped; ended, its slot and budget hold released", swept.id)
        else:
            log.warning(
                "job %s passed the job deadline without a completion: ended as failed, its slot and"
                " budget hold released",
                swept.id,
            )
    return names


PRUNE_EVERY_S = 60.0


async def prune_realtime(conn: psycopg.AsyncConnection) -> int:
    """Old realtime.messages and feed overflow, where the embedded Realtime feed is installed."""
    store = Store(conn)
    if not await store.get(q.FEED_INSTALLED):
        return 0
    return int(await store.get(q.PRUNE_FEED))


async def run_sweeper(
    url: str,
    interval_s: float,
    stop: asyncio.Event,
    check_in: Callable[[Store], Awaitable[object]] | None = None,
) -> None:
    """Sweep every interval_s until stop is set; reconnects if the database goes away. A gateway's
    own sweeper checks in for it first (`check_in`): its process is alive, so are the jobs it
    relays, though its pools may still be reconnecting after an outage."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                pruned_at = 0.0
                while not stop.is_set():
                    if check_in is not None:
                        await check_in(Store(conn))
                    for name in await sweep_once(conn):
                        log.info("node %s is silent: marked offline", name)
                    if loop.time() - pruned_at > PRUNE_EVERY_S:
                        pruned_at = loop.time()
                        await prune_realtime(conn)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except psycopg.OperationalError as err:
            log.warning("sweeper lost the database (%s); retrying", err)
            await asyncio.sleep(interval_s)
