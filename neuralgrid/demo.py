"""The demo fleet's stand-in agents: heartbeats for the demo nodes, so they stay online."""

from __future__ import annotations

import asyncio
import contextlib

import psycopg

DEMO_NODES = "select id from public.nodes where owner_id is null and status <> 'offline'"


async def keep_alive(url: str, stop: asyncio.Event) -> None:
    """Heartbeat every demo node (owner-less, not offline) at the platform's interval until stop."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        ids = [row[0] for row in await (await conn.execute(DEMO_NODES)).fetchall()]
        cur = await conn.execute("select heartbeat_interval_s from public.platform_settings")
        interval_s = float((await cur.fetchone() or (5.0,))[0])
        while not stop.is_set():
            for node_id in ids:
                await conn.execute("select public.node_heartbeat(%s)", (node_id,))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
