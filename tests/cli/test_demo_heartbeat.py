"""The demo's heartbeats outlive a database restart: reconnect with backoff, said once per outage,
and the demo nodes are kept alive again after it, even those the sweeper set offline meanwhile."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import psycopg
import pytest

from neuralgrid.dev.demo import keep_alive
from tests.conftest import make_node
from tests.own_postgres import OwnPostgres, own_postgres


@pytest.fixture(scope="module")
def pg() -> Iterator[OwnPostgres]:
    with own_postgres() as server:
        yield server


async def _until(url: str, query: str, expected: tuple[object, ...], timeout_s: float = 10) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        async with asyncio.timeout(timeout_s):
            while await (await conn.execute(query)).fetchone() != expected:
                await asyncio.sleep(0.05)


async def test_demo_heartbeats_outlive_a_database_restart(
    pg: OwnPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    url = pg.fresh_database()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("update platform_settings set heartbeat_interval_s = 0.2")
        make_node(conn, "demo-a")
        conn.execute("update nodes set last_heartbeat_at = now() - interval '1 minute'")
    fresh = ("select status, last_heartbeat_at > now() - interval '1 second' from nodes", ("online", True))
    stop = asyncio.Event()
    with caplog.at_level(logging.INFO, logger="neuralgrid.dev.demo"):
        heartbeats = asyncio.create_task(keep_alive(url, stop, first_retry_s=0.05, max_retry_s=0.2))
        await _until(url, *fresh)

        await asyncio.to_thread(pg.server.stop)
        await asyncio.sleep(1.0)  # several reconnects fail meanwhile
        assert not heartbeats.done()
        await asyncio.to_thread(pg.server.start)
        # As the sweeper would have left it after a long outage: silent, offline.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "update nodes set status = 'offline', last_heartbeat_at = now() - interval '1 minute'"
            )
        await _until(url, *fresh)

        stop.set()
        await asyncio.wait_for(heartbeats, 5)
    lost = [r for r in caplog.records if "lost the database" in r.getMessage()]
    back = [r for r in caplog.records if "the database is back" in r.getMessage()]
    assert (len(lost), len(back)) == (1, 1)


async def test_a_database_restart_is_no_nodes_silence(pg: OwnPostgres) -> None:
    """Found by a fault-injection review: the first sweep after a restart set every node offline (no
    heartbeat could be written while the database was away). Silence counts from its start too."""
    url = pg.fresh_database()
    with psycopg.connect(url, autocommit=True) as conn:
        make_node(conn, "quiet-through-the-outage")
        # Beat last a minute ago: as a node looks when the database was away for that long.
        conn.execute("update nodes set last_heartbeat_at = now() - interval '1 minute'")
    await asyncio.to_thread(pg.server.stop)
    await asyncio.to_thread(pg.server.start)
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("select * from public.sweep_stale_nodes()").fetchall() == []
        assert conn.execute("select status from nodes").fetchone() == ("online",)
        # Its allowance from the start (3 beats of 5 s) is the same: past it, it is offline.
        conn.execute("update platform_settings set heartbeat_interval_s = 0.1")
        await asyncio.sleep(0.4)
        assert [r[1] for r in conn.execute("select * from public.sweep_stale_nodes()").fetchall()] == [
            "quiet-through-the-outage"
        ]
