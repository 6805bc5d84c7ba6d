"""`neuralgrid watch`: the live feed of the fleet in a terminal, through Supabase's `realtime` client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from realtime import AsyncRealtimeClient, RealtimePostgresChangesListenEvent, RealtimeSubscribeStates
from websockets.exceptions import WebSocketException


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


# Between tries while the feed is away (the last repeats: a watch outlives a platform's restart).
RETRY_S = (1.0, 2.0, 5.0)
# The subscription's states that mean the socket or the channel is gone.
LOST = {
    RealtimeSubscribeStates.CHANNEL_ERROR,
    RealtimeSubscribeStates.CLOSED,
    RealtimeSubscribeStates.TIMED_OUT,
}


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
    A feed lost (the gateway stopped) is said, and followed again once it answers, however long
    that takes: the client's own retries give up silently after five. A first connection that
    fails raises. Returns the number of events printed."""
    seen = 0
    done = asyncio.Event()

    def printed(line: str) -> None:
        nonlocal seen
        emit(line)
        seen += 1
        if count is not None and seen >= count:
            done.set()

    async def follow() -> None:
        tries, first = 0, True  # tries since the feed was lost
        while True:
            client = AsyncRealtimeClient(realtime_url, token=key, auto_reconnect=False)
            try:
                lost = await _subscribe(client, realtime_url, printed, heartbeats)
                emit(f"watching node-map at {realtime_url}{'' if first else ' again'} (Ctrl-C stops)")
                first, tries = False, 0
                await lost.wait()
                emit(f"lost the feed at {realtime_url}: following it again once it answers")
            except (OSError, ConnectionError, WebSocketException):
                if first:
                    raise
            finally:
                await client.close()
            await asyncio.sleep(RETRY_S[min(tries, len(RETRY_S) - 1)])
            tries += 1

    following = asyncio.create_task(follow())
    waiting = asyncio.create_task(done.wait())
    try:
        await asyncio.wait({following, waiting}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if following.done():
            following.result()  # the first connection failed: raised
    finally:
        for task in (following, waiting):
            task.cancel()
        # Both done, the client closed (gather would return at the first cancelled one, and the
        # loop's end would then cut the socket's close short: a socket left open).
        await asyncio.wait({following, waiting})
    return seen


async def _subscribe(
    client: AsyncRealtimeClient, realtime_url: str, printed: Callable[[str], None], heartbeats: bool
) -> asyncio.Event:
    """Connects and joins node-map; returns the event set when the socket or the channel is lost."""
    await client.connect()
    channel = client.channel("node-map")
    channel.on_broadcast("*", lambda m: printed(describe(m["event"], m["payload"])))
    if heartbeats:
        channel.on_postgres_changes(
            RealtimePostgresChangesListenEvent.Update,
            lambda c: printed(describe_heartbeat(dict(c))),
            table="nodes",
            schema="public",
        )
    lost = asyncio.Event()
    states: list[RealtimeSubscribeStates] = []

    def said(state: RealtimeSubscribeStates, _error: Exception | None) -> None:
        states.append(state)
        if state in LOST:
            lost.set()

    await channel.subscribe(said)
    if not states or states[-1] != RealtimeSubscribeStates.SUBSCRIBED:
        raise ConnectionError(f"could not subscribe to node-map at {realtime_url}")
    return lost
