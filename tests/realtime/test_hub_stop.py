"""A Realtime hub stops when told, whatever it is doing then, and closes its feed's connection."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from neuralgrid.realtime.hub import Hub

LISTENING = (
    "select count(*) from pg_stat_activity where datname = current_database() and query = 'listen realtime'"
)


async def test_a_hub_told_to_stop_while_it_handles_a_notification_stops_and_closes_its_feed(
    db_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two notifications psycopg's generator holds its connection's lock, which leaving the
    connection waits for: a hub told to stop as it handled one hung there (a gateway's shutdown
    cancelled it 2 s on, its feed's connection left open)."""
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, open=False) as pool:
        hub = Hub(pool, db_url)
        stop = asyncio.Event()
        handle = hub._handle

        async def handle_then_stop(text: str) -> None:  # its own hello comes back on the feed
            await handle(text)
            stop.set()

        monkeypatch.setattr(hub, "_handle", handle_then_stop)
        running = asyncio.create_task(hub.run(stop))
        await asyncio.wait_for(hub.listening.wait(), 10)
        assert conn.execute(LISTENING).fetchone() == (1,)
        await asyncio.wait_for(stop.wait(), 5)
        await asyncio.wait_for(running, 3)  # its goodbye takes at most BYE_S

    assert conn.execute(LISTENING).fetchone() == (0,)
