"""`neuralgrid watch`: the live feed of the fleet in a terminal, through Supabase's `realtime` client."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from realtime import AsyncRealtimeClient, RealtimePostgresChangesListenEvent, RealtimeSubscribeStates


def describe(event: str, payload: dict[str, Any]) -> str:
    """One line for a node-map broadcast: when, what, which node, and its status change."""
    node = payload.get("node") or {}
    status = node.get("status", "?")
    before = payload.get("old_status")
    change = f"{before} -> {status}" if before and before != status else status
    where = node.get("region") or "?"
    gpu = f"{node.get('gpu_count', 1)}x {node.get('gpu_model', '?')}"
    name = node.get("name", node.get("id", "?"))
    return f"{time.strftime('%H:%M:%S')}  {event:<12} {name:<24} {change:<20} {gpu} @ {where}"


def describe_heartbeat(change: dict[str, Any]) -> str:
    record = change["data"]["record"]
    load = f"{record.get('inflight', 0)}/{record.get('max_concurrency', '?')} busy"
    name, status = record.get("name", "?"), record.get("status", "?")
    return f"{time.strftime('%H:%M:%S')}  {'heartbeat':<12} {name:<24} {status:<20} {load}"


async def watch(
    realtime_url: str,
    key: str,
    emit: Callable[[str], None],
    *,
    heartbeats: bool = False,
    count: int | None = None,
    timeout: float | None = None,
) -> int:
    """Prints node-map events (and heartbeats if asked) until `count` events or `timeout` seconds.
    Returns the number of events printed."""
    seen = 0
    done = asyncio.Event()

    def printed(line: str) -> None:
        nonlocal seen
        emit(line)
        seen += 1
        if count is not None and seen >= count:
            done.set()

    client = AsyncRealtimeClient(realtime_url, token=key, auto_reconnect=True)
    await client.connect()
    try:
        channel = client.channel("node-map")
        channel.on_broadcast("*", lambda m: printed(describe(m["event"], m["payload"])))
        if heartbeats:
            channel.on_postgres_changes(
                RealtimePostgresChangesListenEvent.Update,
                lambda c: printed(describe_heartbeat(dict(c))),
                table="nodes",
                schema="public",
            )
        states: list[RealtimeSubscribeStates] = []
        await channel.subscribe(lambda state, err: states.append(state))
        if not states or states[-1] != RealtimeSubscribeStates.SUBSCRIBED:
            raise ConnectionError(f"could not subscribe to node-map at {realtime_url}")
        emit(f"watching node-map at {realtime_url} (Ctrl-C stops)")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout)
    finally:
        await client.close()
    return seen
