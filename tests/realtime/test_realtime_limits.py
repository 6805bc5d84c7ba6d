"""What one client socket may do to the embedded Realtime server (neuralgrid/realtime/limits.py):
the platform's map topic is read-only, messages and presences have sizes and counts, a flood is
refused and then closed, and events nobody else watches never reach Postgres."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import websockets
from realtime import AsyncRealtimeChannel, AsyncRealtimeClient, RealtimeSubscribeStates
from realtime.types import RealtimeAcknowledgementStatus

from neuralgrid.realtime import hub as hub_module
from neuralgrid.realtime.hub import Hub
from neuralgrid.realtime.limits import RATE_LIMITED
from neuralgrid.server.settings import PLACEHOLDER_SECRET
from neuralgrid.server.stack import api_key
from tests.conftest import make_node
from tests.realtime.test_realtime import realtime_url, until

ANON = api_key(PLACEHOLDER_SECRET, "anon")
SERVICE = api_key(PLACEHOLDER_SECRET, "service_role")
CLIENT_ROWS = "select count(*) from realtime.feed_overflow where payload->>'k' in ('broadcast', 'presence')"


class Raw:
    """A bare vsn 1.0.0 socket: pushes with refs, and keeps what is not the awaited reply."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.seen: list[dict[str, Any]] = []
        self._refs = itertools.count(1)

    @classmethod
    async def open(cls, gateway: str, token: str = ANON) -> Raw:
        url = f"{realtime_url(gateway)}/websocket?apikey={token}&vsn=1.0.0"
        return cls(await websockets.connect(url, max_size=None))

    async def push(self, topic: str, event: str, payload: dict[str, Any]) -> str:
        ref = str(next(self._refs))
        message = {
            "topic": f"realtime:{topic}",
            "event": event,
            "payload": payload,
            "ref": ref,
            "join_ref": "j",
        }
        await self.ws.send(json.dumps(message))
        return ref

    async def reply(self, ref: str) -> dict[str, Any]:
        while True:
            message = json.loads(await asyncio.wait_for(self.ws.recv(), 5))
            if message["event"] == "phx_reply" and message["ref"] == ref:
                payload: dict[str, Any] = message["payload"]
                return payload
            self.seen.append(message)

    async def call(self, topic: str, event: str, payload: dict[str, Any]) -> dict[str, Any]:
        return await self.reply(await self.push(topic, event, payload))

    async def join(self, topic: str, **config: Any) -> dict[str, Any]:
        return await self.call(topic, "phx_join", {"config": config})

    async def broadcast(self, topic: str, event: str, payload: Any) -> dict[str, Any]:
        return await self.call(topic, "broadcast", {"type": "broadcast", "event": event, "payload": payload})

    async def track(self, topic: str, meta: dict[str, Any]) -> dict[str, Any]:
        return await self.call(topic, "presence", {"event": "track", "payload": meta})

    async def drain(self, settle: float = 0.3) -> list[dict[str, Any]]:
        """Everything received so far, waiting `settle` for stragglers."""
        with pytest.raises(TimeoutError):
            while True:
                self.seen.append(json.loads(await asyncio.wait_for(self.ws.recv(), settle)))
        return self.seen

    async def broadcasts(self, event: str) -> list[Any]:
        """The payloads of the `event` broadcasts received so far."""
        return [
            m["payload"]["payload"]
            for m in await self.drain()
            if m["event"] == "broadcast" and m["payload"]["event"] == event
        ]


@pytest.fixture
async def raw(gateway: str) -> AsyncIterator[Callable[..., Any]]:
    sockets: list[Raw] = []

    async def open_raw(token: str = ANON, at: str = gateway) -> Raw:
        sockets.append(await Raw.open(at, token))
        return sockets[-1]

    yield open_raw
    for socket in sockets:
        await socket.ws.close()


async def subscribed(client: AsyncRealtimeClient, topic: str) -> AsyncRealtimeChannel:
    channel = client.channel(topic)
    states: list[Any] = []
    await channel.subscribe(lambda state, err: states.append(state))
    assert states[-1] == RealtimeSubscribeStates.SUBSCRIBED
    return channel


async def pushed(channel: AsyncRealtimeChannel, event: str, payload: dict[str, Any]) -> tuple[Any, Any]:
    """The reply to a push, as the Python client receives it: (status, response)."""
    push = await channel.push(event, payload)
    await until(lambda: push.received_resp is not None)
    assert push.received_resp is not None
    return push.received_resp


# -- the platform's map topic ---------------------------------------------------------------------


async def test_clients_cannot_write_to_the_map(gateway: str, conn: psycopg.Connection) -> None:
    """A fake node_update (or presence) on node-map is refused with a reason, through the official
    client; subscribers get only what the platform and service_role publish there."""
    node = make_node(conn, "rt-map")
    watcher, faker, operator = (
        AsyncRealtimeClient(realtime_url(gateway), token=token, auto_reconnect=False)
        for token in (ANON, ANON, SERVICE)
    )
    clients = (watcher, faker, operator)
    for client in clients:
        await client.connect()
    try:
        got: list[dict[str, Any]] = []
        watching = await subscribed(watcher, "node-map")
        watching.on_broadcast("*", lambda message: got.append(dict(message)))
        faking = await subscribed(faker, "node-map")

        fake = {"node": {"id": str(node), "name": "rt-map", "status": "offline"}, "old_status": "online"}
        status, response = await pushed(
            faking, "broadcast", {"type": "broadcast", "event": "node_update", "payload": fake}
        )
        assert status == RealtimeAcknowledgementStatus.Error
        assert response["reason"] == (
            "Unauthorized: You do not have permissions to write to this Channel topic: node-map"
        )
        status, response = await pushed(faking, "presence", {"event": "track", "payload": {"x": 1}})
        assert status == RealtimeAcknowledgementStatus.Error
        assert "write to this Channel topic: node-map" in response["reason"]

        conn.execute("update public.nodes set status = 'offline' where id = %s", (node,))
        await until(lambda: any(m["payload"]["node"]["status"] == "offline" for m in got))
        operating = await subscribed(operator, "node-map")
        await operating.send_broadcast("maintenance", {"at": "02:00"})
        await until(lambda: any(m["event"] == "maintenance" for m in got))
        assert [m["payload"]["node"]["status"] for m in got if m["event"] == "node_update"] == ["offline"]
    finally:
        for client in clients:
            await client.close()


def binary_broadcast(topic: str, event: str, payload: Any, ref: str) -> bytes:
    """realtime-js's User Broadcast Push frame (vsn 2.0.0)."""
    fields = [b"j", ref.encode(), f"realtime:{topic}".encode(), event.encode(), b""]
    header = bytes([3, *(len(f) for f in fields), 1])
    return header + b"".join(fields) + json.dumps(payload).encode()


async def test_binary_broadcasts_obey_the_same_rules(gateway: str) -> None:
    url = f"{realtime_url(gateway)}/websocket?apikey={ANON}&vsn=2.0.0"
    async with websockets.connect(url) as ws:
        for topic in ("chat", "node-map"):
            await ws.send(
                json.dumps(
                    ["j", topic, f"realtime:{topic}", "phx_join", {"config": {"broadcast": {"self": True}}}]
                )
            )
            assert json.loads(await ws.recv())[4]["status"] == "ok"

        await ws.send(binary_broadcast("chat", "hi", {"n": 1}, "1"))
        echo = json.loads(await ws.recv())
        assert echo[2:4] == ["realtime:chat", "broadcast"] and echo[4]["payload"] == {"n": 1}
        await ws.send(binary_broadcast("node-map", "node_update", {"node": {}}, "2"))
        reply = json.loads(await ws.recv())
        assert reply[1:4] == ["2", "realtime:node-map", "phx_reply"] and reply[4]["status"] == "error"
        with pytest.raises(TimeoutError):  # and no echo
            await asyncio.wait_for(ws.recv(), 0.3)


# -- sizes and counts -----------------------------------------------------------------------------


async def test_oversized_messages_are_refused(raw: Callable[..., Any]) -> None:
    """64 KiB a message and 8 KiB a presence, as sent: bigger ones are refused and go nowhere."""
    sender, listener = await raw(), await raw()
    assert (await sender.join("big", broadcast={"ack": True}))["status"] == "ok"
    assert (await listener.join("big"))["status"] == "ok"

    refused = await sender.broadcast("big", "blob", "x" * 70_000)
    assert refused["status"] == "error"
    assert refused["response"]["reason"].startswith("PayloadSizeExceeded: the message is 7")
    assert refused["response"]["reason"].endswith("the limit is 65536")
    assert (await sender.broadcast("big", "blob", "y" * 60_000))["status"] == "ok"
    assert await listener.broadcasts("blob") == ["y" * 60_000]

    too_big = await sender.track("big", {"bio": "z" * 9_000})
    assert too_big["status"] == "error" and too_big["response"]["reason"].endswith("the limit is 8192")
    assert (await sender.track("big", {"bio": "short"}))["status"] == "ok"


@pytest.mark.parametrize(
    "gateway_settings", [{"NEURALGRID_REALTIME_MAX_CHANNELS": 3, "NEURALGRID_REALTIME_MAX_PRESENCES": 2}]
)
async def test_channels_and_presences_per_socket_are_capped(raw: Callable[..., Any]) -> None:
    client = await raw()
    for topic in ("a", "b", "c"):
        assert (await client.join(topic))["status"] == "ok"
    fourth = await client.join("d")
    assert fourth == {"status": "error", "response": {"reason": "ChannelRateLimitReached: Too many channels"}}
    assert (await client.join("a"))["status"] == "ok"  # a rejoin replaces, it does not add

    assert (await client.track("a", {"n": 1}))["status"] == "ok"
    assert (await client.track("b", {"n": 2}))["status"] == "ok"
    third = await client.track("c", {"n": 3})
    assert third["status"] == "error" and "at most 2 channels" in third["response"]["reason"]
    assert (await client.track("a", {"n": 4}))["status"] == "ok"  # a channel replaces its own

    other = await raw()  # the caps are per socket
    assert (await other.join("long" * 100))["response"]["reason"].startswith("TopicNameTooLong")
    assert (await other.join("d"))["status"] == "ok"


async def test_a_flood_is_refused_then_closed(raw: Callable[..., Any]) -> None:
    """100 messages a second, 200 at once: past that each gets an error reply, and a socket that
    keeps going is closed (1008). Subscribers get exactly the accepted ones."""
    flooder, listener = await raw(), await raw()
    assert (await flooder.join("flood", broadcast={"ack": True}))["status"] == "ok"
    assert (await listener.join("flood"))["status"] == "ok"

    sent = 0
    with contextlib.suppress(websockets.ConnectionClosed):  # it may close before we are done
        for n in range(2000):
            await flooder.push("flood", "broadcast", {"type": "broadcast", "event": "n", "payload": n})
            sent += 1
    statuses: list[str] = []
    with pytest.raises(websockets.ConnectionClosedError):
        while True:
            message = json.loads(await asyncio.wait_for(flooder.ws.recv(), 5))
            if message["event"] == "phx_reply":
                statuses.append(message["payload"]["status"])
                if message["payload"]["status"] == "error":
                    assert message["payload"]["response"]["reason"] == RATE_LIMITED
    assert flooder.ws.close_code == 1008
    accepted = statuses.count("ok")
    # The bucket holds 200 (the join took one); it refills by 100 a second while the flood lasts.
    assert 199 <= accepted < 600 and statuses.count("error") >= 199
    assert statuses[:199] == ["ok"] * 199
    assert sent > len(statuses)  # closed before it had read everything
    assert len(await listener.broadcasts("n")) == accepted


# -- what reaches Postgres and the other gateways -------------------------------------------------


@dataclass
class Gateway:
    url: str
    hub: Hub


@pytest.fixture
def two_gateways(db_url: str) -> Iterator[tuple[Gateway, Gateway]]:
    """Two gateways on one database, past the first second in which they forward everything."""
    from neuralgrid.server.app import create_app
    from neuralgrid.server.serving import ThreadedServer
    from neuralgrid.server.settings import Settings

    with (
        ThreadedServer(create_app(Settings(), db_url, sweep=False)) as a,
        ThreadedServer(create_app(Settings(), db_url, sweep=False)) as b,
    ):
        gateways = [Gateway(s.url, s.app.state.services.realtime) for s in (a, b)]
        deadline = max(g.hub.forward_all_until for g in gateways)
        time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)
        yield gateways[0], gateways[1]


def client_rows(conn: psycopg.Connection) -> int:
    row = conn.execute(CLIENT_ROWS).fetchone()
    assert row is not None
    return int(row[0])


async def test_refused_and_unwatched_events_never_reach_postgres(
    two_gateways: tuple[Gateway, Gateway], raw: Callable[..., Any], conn: psycopg.Connection
) -> None:
    """Big client events park in realtime.feed_overflow only when another gateway has a subscriber
    for them, and refused ones never: a topic nobody else joined costs no row."""
    a, b = two_gateways
    listener = await raw(at=b.url)
    assert (await listener.join("wanted"))["status"] == "ok"
    await until(lambda: ("wanted", False) in a.hub.remote_interest)
    sender = await raw(at=a.url)
    for topic in ("wanted", "unwatched", "node-map"):
        assert (await sender.join(topic, broadcast={"ack": True}))["status"] == "ok"
    blob = "x" * 20_000

    assert (await sender.broadcast("unwatched", "blob", blob))["status"] == "ok"
    assert (await sender.broadcast("wanted", "blob", blob * 4))["status"] == "error"  # 80 KB
    assert (await sender.broadcast("node-map", "node_update", blob))["status"] == "error"
    assert (await sender.track("wanted", {"bio": blob}))["status"] == "error"
    assert (await sender.track("unwatched", {"bio": "y" * 8_000}))["status"] == "ok"
    assert client_rows(conn) == 0

    assert (await sender.broadcast("wanted", "blob", blob))["status"] == "ok"
    assert await listener.broadcasts("blob") == [blob]
    assert client_rows(conn) == 1  # the one another gateway needed


async def test_presence_stays_where_someone_watches_it(
    two_gateways: tuple[Gateway, Gateway], raw: Callable[..., Any]
) -> None:
    """Presence on a topic only one gateway holds stays in that gateway's memory; a gateway that
    gets a subscriber later receives it then, and forgets it when the last one leaves."""
    a, b = two_gateways
    tracker = await raw(at=a.url)
    assert (await tracker.join("lobby", presence={"key": "ann", "enabled": True}))["status"] == "ok"
    assert (await tracker.track("lobby", {"status": "here"}))["status"] == "ok"
    await asyncio.sleep(0.3)
    assert ("lobby", False) in a.hub.presence and not b.hub.presence

    watcher = await raw(at=b.url)
    assert (await watcher.join("lobby", presence={"enabled": True}))["status"] == "ok"
    await until(lambda: "ann" in b.hub.presence.get(("lobby", False), {}))
    diffs = [m["payload"] for m in await watcher.drain() if m["event"] == "presence_diff"]
    assert diffs[0]["joins"]["ann"]["metas"][0]["status"] == "here"
    await watcher.ws.close()
    await until(lambda: not b.hub.presence and ("lobby", False) not in a.hub.remote_interest)


async def test_client_overflow_rows_are_pruned_in_minutes(
    monkeypatch: pytest.MonkeyPatch, db_url: str, raw: Callable[..., Any], conn: psycopg.Connection
) -> None:
    """Parked client events are deleted two minutes on (the database's own, after an hour)."""
    from neuralgrid.server.app import create_app
    from neuralgrid.server.serving import ThreadedServer
    from neuralgrid.server.settings import Settings

    monkeypatch.setattr(hub_module, "WATCH_REFRESH_S", 0.1)  # the upkeep's pace, not its rule
    with (
        ThreadedServer(create_app(Settings(), db_url, sweep=False)) as a,
        ThreadedServer(create_app(Settings(), db_url, sweep=False)) as b,
    ):
        listener, sender = await raw(at=b.url), await raw(at=a.url)
        assert (await listener.join("wanted"))["status"] == "ok"
        hub_a: Hub = a.app.state.services.realtime
        await until(lambda: ("wanted", False) in hub_a.remote_interest)
        assert (await sender.join("wanted", broadcast={"ack": True}))["status"] == "ok"
        assert (await sender.broadcast("wanted", "blob", "x" * 20_000))["status"] == "ok"
        conn.execute(
            "select realtime.send(jsonb_build_object('blob', repeat('d', 20000)), 'blob', 'db', false)"
        )
        await until(lambda: client_rows(conn) == 1)
        await asyncio.sleep(0.5)
        assert client_rows(conn) == 1  # young rows stay

        conn.execute("update realtime.feed_overflow set created_at = created_at - interval '3 minutes'")
        await until(lambda: client_rows(conn) == 0)
        kept = conn.execute("select payload->>'k' from realtime.feed_overflow").fetchall()
        assert kept == [("message",)]  # database broadcasts keep the feed's own retention
