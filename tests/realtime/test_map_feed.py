"""The map's feed on the embedded Realtime server (issue 41): a viewer of `map:summary` hears at most a
summary a second however many nodes change, each the changes to the one before, which rebuild the
fleet's summary exactly; a gateway computes nothing while nobody views; clients cannot write there."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import httpx
import psycopg
from realtime import AsyncRealtimeClient
from realtime.types import RealtimeAcknowledgementStatus

from tests.realtime.test_realtime import ANON, realtime_url, until
from tests.realtime.test_realtime_limits import pushed, subscribed

TOPIC = "map:summary"


def fleet(conn: psycopg.Connection, nodes: int) -> None:
    conn.execute(
        "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, latitude, longitude,"
        " endpoint_url, status, last_heartbeat_at)"
        " select 'rt-map-' || g, 'NVIDIA L4', 24, 121, 0.4, 'r' || (g %% 5), -60 + (g * 37 %% 120),"
        " -170 + (g * 53 %% 340), 'http://127.0.0.1:9/', 'online', now() from generate_series(1, %s) g",
        (nodes,),
    )


def apply(held: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    """What the page does with a message: the whole, or the changes to seq - 1."""
    if message["full"]:
        return dict(message)
    assert message["seq"] == held["seq"] + 1, (held["seq"], message["seq"])
    after = {**held, **message}
    for part in ("tiles", "regions", "gpus"):
        after[part] = {**held[part]}
        for key, value in message[part].items():
            if value is None:
                del after[part][key]
            else:
                after[part][key] = value
    return after


def checked_at(db_url: str) -> Any:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "select extract(epoch from checked_at)::float8, seq from public.map_feed"
        ).fetchone()
    assert row is not None
    return row


async def test_a_viewer_hears_a_summary_a_second_whose_changes_rebuild_the_fleet(
    gateway: str, conn: psycopg.Connection, db_url: str
) -> None:
    fleet(conn, 400)
    viewer = AsyncRealtimeClient(realtime_url(gateway), token=ANON, auto_reconnect=False)
    await viewer.connect()
    heard: list[tuple[float, dict[str, Any]]] = []
    try:
        channel = viewer.channel(TOPIC)
        channel.on_broadcast("summary", lambda m: heard.append((time.monotonic(), m["payload"])))
        await channel.subscribe()
        await until(lambda: heard, timeout=5)  # the first, whole: nobody had viewed this fleet
        held = apply({}, heard[0][1])
        assert held["full"] and sum(held["total"]) == 400

        stop = threading.Event()

        def flip() -> None:  # 40 status changes a second, across the world
            with psycopg.connect(db_url, autocommit=True) as writer:
                for i in itertools.count():
                    if stop.is_set():
                        return
                    writer.execute(
                        "update public.nodes set status = case status when 'online' then 'offline' else 'online' end"
                        " where name = %s",
                        (f"rt-map-{1 + i * 7 % 400}",),
                    )
                    time.sleep(0.025)

        writer = threading.Thread(target=flip)
        started = time.monotonic()
        writer.start()
        await asyncio.sleep(6)
        stop.set()
        writer.join()
        seconds = time.monotonic() - started
        await asyncio.sleep(2.5)  # the last changes' summary
        during = [at for at, _ in heard[1:] if at <= started + seconds + 1.2]
        assert 4 <= len(during) <= seconds + 1.2, (len(during), seconds)
        assert min(b - a for a, b in itertools.pairwise(at for at, _ in heard)) > 0.9
        for _, message in heard[1:]:
            assert not message["full"] and len(message["tiles"]) < 400  # the tiles that changed only
            held = apply(held, message)
    finally:
        await viewer.close()
    with psycopg.connect(db_url) as check:
        now = check.execute("select public.map_summary(false)").fetchone()
    assert now is not None
    for part in ("total", "unplaced", "tiles", "regions", "gpus"):
        assert held[part] == now[0][part], part
    # The page's first read is the summary the viewers hold (with its seq), once the feed runs.
    assert httpx.get(f"{gateway}/api/map/summary").json()["seq"] == held["seq"]


async def test_nobody_viewing_costs_nothing(gateway: str, conn: psycopg.Connection, db_url: str) -> None:
    fleet(conn, 50)
    await asyncio.sleep(2.2)
    assert checked_at(db_url) == (float("-inf"), 0)  # never computed
    viewer = AsyncRealtimeClient(realtime_url(gateway), token=ANON, auto_reconnect=False)
    await viewer.connect()
    channel = viewer.channel(TOPIC)
    await channel.subscribe()
    await until(lambda: checked_at(db_url)[1] == 1, timeout=5)
    await viewer.close()
    await asyncio.sleep(1.5)  # the gateway has seen the viewer go
    stopped = checked_at(db_url)[0]
    await asyncio.sleep(2.2)
    assert checked_at(db_url)[0] == stopped


async def test_clients_cannot_write_to_the_summary(gateway: str) -> None:
    """A fake summary from a client (a fleet all offline) is refused: only the platform writes there."""
    faker = AsyncRealtimeClient(realtime_url(gateway), token=ANON, auto_reconnect=False)
    await faker.connect()
    try:
        faking = await subscribed(faker, TOPIC)
        fake = {"seq": 99, "full": True, "total": [0, 0, 0, 100000]}
        status, response = await pushed(
            faking, "broadcast", {"type": "broadcast", "event": "summary", "payload": fake}
        )
        assert status == RealtimeAcknowledgementStatus.Error
        assert response["reason"] == (
            "Unauthorized: You do not have permissions to write to this Channel topic: map:summary"
        )
    finally:
        await faker.close()
