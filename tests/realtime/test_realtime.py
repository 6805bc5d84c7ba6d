"""The embedded Realtime server, through Supabase's own Python client (`realtime`, vsn 1.0.0)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
import websockets
from realtime import (
    AsyncRealtimeChannel,
    AsyncRealtimeClient,
    RealtimePostgresChangesListenEvent,
    RealtimeSubscribeStates,
)

from neuralgrid.server.settings import PLACEHOLDER_SECRET
from neuralgrid.server.stack import api_key, user_token
from tests.conftest import make_node, make_user

ANON = api_key(PLACEHOLDER_SECRET, "anon")
SERVICE = api_key(PLACEHOLDER_SECRET, "service_role")


def realtime_url(gateway: str) -> str:
    return f"{gateway.replace('http://', 'ws://')}/realtime/v1"


@pytest.fixture
async def connect(gateway: str) -> AsyncIterator[Callable[..., Any]]:
    clients: list[AsyncRealtimeClient] = []

    async def open_client(token: str = ANON) -> AsyncRealtimeClient:
        client = AsyncRealtimeClient(realtime_url(gateway), token=token, auto_reconnect=False)
        await client.connect()
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        await client.close()


async def subscribed(channel: AsyncRealtimeChannel) -> AsyncRealtimeChannel:
    states: list[tuple[RealtimeSubscribeStates, Exception | None]] = []
    await channel.subscribe(lambda state, err: states.append((state, err)))
    assert states and states[-1][0] == RealtimeSubscribeStates.SUBSCRIBED, states
    return channel


async def until(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.02)


def set_status(db_url: str, node_id: uuid.UUID, status: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("update public.nodes set status = %s where id = %s", (status, node_id))


def add_node(db_url: str, name: str) -> uuid.UUID:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return make_node(conn, name)


async def test_postgres_changes_reach_anon_with_public_columns_only(
    connect: Callable[..., Any], conn: psycopg.Connection, db_url: str
) -> None:
    owner = make_user(conn)
    node = make_node(conn, "rt-a", owner_id=owner)
    client = await connect()
    got: list[dict[str, Any]] = []
    channel = client.channel("nodes-feed")
    channel.on_postgres_changes("UPDATE", got.append, table="nodes", schema="public")
    await subscribed(channel)

    await asyncio.to_thread(set_status, db_url, node, "offline")
    await until(lambda: got)
    data = got[0]["data"]
    assert data["type"] == "UPDATE" and data["schema"] == "public" and data["table"] == "nodes"
    assert data["record"]["status"] == "offline" and data["record"]["id"] == str(node)
    assert data["errors"] is None and data["commit_timestamp"].endswith("Z")
    # anon's column grants: never the endpoint, the owner or the secret.
    assert {"endpoint_url", "owner_id", "secret_hash"}.isdisjoint(data["record"])
    assert {c["name"] for c in data["columns"]} == set(data["record"])
    assert data["old_record"] == {"id": str(node)}  # replica identity default: the key only
    assert got[0]["ids"] == [channel.postgres_changes_callbacks[0].id]


async def test_filters_and_events_select_changes(
    connect: Callable[..., Any], conn: psycopg.Connection, db_url: str
) -> None:
    a, b = make_node(conn, "rt-f1"), make_node(conn, "rt-f2")
    client = await connect(SERVICE)
    only_b: list[dict[str, Any]] = []
    inserts: list[dict[str, Any]] = []
    channel = client.channel("filtered")
    channel.on_postgres_changes("UPDATE", only_b.append, table="nodes", schema="public", filter=f"id=eq.{b}")
    channel.on_postgres_changes("INSERT", inserts.append, table="nodes", schema="public")
    await subscribed(channel)

    await asyncio.to_thread(set_status, db_url, a, "offline")
    await asyncio.to_thread(set_status, db_url, b, "offline")
    new = await asyncio.to_thread(add_node, db_url, "rt-f3")
    await until(lambda: only_b and inserts)
    await asyncio.sleep(0.2)
    assert [m["data"]["record"]["id"] for m in only_b] == [str(b)]
    assert [m["data"]["record"]["id"] for m in inserts] == [str(new)]
    # service_role sees every column.
    assert "endpoint_url" in only_b[0]["data"]["record"]


async def test_a_filter_never_tests_a_column_the_subscriber_cannot_select(
    connect: Callable[..., Any], conn: psycopg.Connection, db_url: str, gateway: str
) -> None:
    """Found by a security review: filters were tested against the whole row before it was trimmed
    to what the subscriber may select, and each event's `ids` said which filter matched. An
    anonymous map visitor read any node's endpoint and the hash its requests are signed with, a
    character an update, and sent a signed request to a node with it. A filter on such a column is
    refused at the join and matches nothing."""
    owner = make_user(conn)
    node = make_node(conn, "rt-hidden", owner_id=owner, endpoint_url="http://10.1.2.3:8001/secret")
    client = await connect()
    hits: dict[str, list[dict[str, Any]]] = {"visible": [], "hidden": []}
    channel = client.channel("oracle")
    for name, condition in (("visible", "status=eq.offline"), ("hidden", "endpoint_url=gte.http")):
        channel.on_postgres_changes(
            "UPDATE", hits[name].append, table="nodes", schema="public", filter=f"id=eq.{node},{condition}"
        )
    await subscribed(channel)
    await asyncio.to_thread(set_status, db_url, node, "offline")
    await until(lambda: hits["visible"])
    await asyncio.sleep(0.3)
    assert hits["hidden"] == []
    assert [m["ids"] for m in hits["visible"]] == [[channel.postgres_changes_callbacks[0].id]]

    # Said at the join, in the system message Realtime sends for a binding it cannot serve.
    async with await raw_socket(gateway, ANON) as ws:
        changes = [{"event": "UPDATE", "schema": "public", "table": "nodes", "filter": "secret_hash=eq.x"}]
        await ws.send(join("realtime:y", {"config": {"postgres_changes": changes}}))
        assert json.loads(await ws.recv())["payload"]["status"] == "ok"
        said = json.loads(await ws.recv())["payload"]
        assert said["status"] == "error" and "secret_hash" in said["message"], said


def test_no_api_role_can_feed_the_gateways(conn: psycopg.Connection) -> None:
    """Found by a security review: anon could call realtime.feed_notify(), whose payload every
    gateway delivers to its subscribers as a row change or a message."""
    for role in ("anon", "authenticated"):
        allowed = conn.execute(
            "select has_function_privilege(%s, 'realtime.feed_notify(jsonb)', 'execute')", (role,)
        ).fetchone()
        assert allowed == (False,), role


async def test_rls_hides_rows_a_subscriber_cannot_select(
    connect: Callable[..., Any], conn: psycopg.Connection, db_url: str
) -> None:
    alice, bob = make_user(conn), make_user(conn)
    with conn.transaction():
        conn.execute("set local role authenticated")
        claims = json.dumps({"sub": str(alice), "role": "authenticated"})
        conn.execute("select set_config('request.jwt.claims', %s, true)", (claims,))
        row = conn.execute("select id from public.create_api_key('alice key')").fetchone()
    assert row is not None
    conn.execute("alter publication supabase_realtime add table public.api_keys")
    key_id = row[0]
    seen: dict[str, list[dict[str, Any]]] = {"alice": [], "bob": []}
    for who, user in (("alice", alice), ("bob", bob)):
        client = await connect(user_token(PLACEHOLDER_SECRET, user, None))
        channel = client.channel(f"keys-{who}")
        channel.on_postgres_changes("UPDATE", seen[who].append, table="api_keys", schema="public")
        await subscribed(channel)

    conn.execute("update public.api_keys set revoked_at = now() where id = %s", (key_id,))
    await until(lambda: seen["alice"])
    await asyncio.sleep(0.3)
    assert seen["alice"][0]["data"]["record"]["id"] == str(key_id)
    assert "key_hash" not in seen["alice"][0]["data"]["record"]  # a column authenticated may not select
    assert seen["bob"] == []


async def test_broadcast_from_database_and_between_clients(
    connect: Callable[..., Any], conn: psycopg.Connection, db_url: str
) -> None:
    node = make_node(conn, "rt-b")
    listener, sender = await connect(), await connect()
    got: list[dict[str, Any]] = []
    listening = listener.channel("node-map")
    listening.on_broadcast("*", got.append)
    await subscribed(listening)
    chat: list[dict[str, Any]] = []
    hearing = listener.channel("chat")
    hearing.on_broadcast("*", chat.append)
    await subscribed(hearing)
    talking = await subscribed(sender.channel("chat"))  # node-map is the platform's: read-only

    await asyncio.to_thread(set_status, db_url, node, "offline")  # the node-map trigger
    await until(lambda: any(m["event"] == "node_update" for m in got))
    update = next(m for m in got if m["event"] == "node_update")
    assert update["payload"]["node"]["status"] == "offline" and update["payload"]["old_status"] == "online"
    assert "endpoint_url" not in update["payload"]["node"] and update["meta"]["id"]

    await talking.send_broadcast("hello", {"from": "sender"})
    await until(lambda: any(m["event"] == "hello" for m in chat))
    assert next(m for m in chat if m["event"] == "hello")["payload"] == {"from": "sender"}


async def test_private_topics_need_rls_rights(connect: Callable[..., Any], conn: psycopg.Connection) -> None:
    owner, stranger = make_user(conn), make_user(conn)
    node = make_node(conn, "rt-p", owner_id=owner)
    mine: list[dict[str, Any]] = []
    owner_client = await connect(user_token(PLACEHOLDER_SECRET, owner, None))
    channel = owner_client.channel(f"owner:{owner}", {"config": {"private": True}})
    channel.on_broadcast("*", mine.append)
    await subscribed(channel)

    states: list[Any] = []
    stranger_client = await connect(user_token(PLACEHOLDER_SECRET, stranger, None))
    spy = stranger_client.channel(f"owner:{owner}", {"config": {"private": True}})
    await spy.subscribe(lambda state, err: states.append((state, err)))
    assert states[-1][0] == RealtimeSubscribeStates.CHANNEL_ERROR
    assert "Unauthorized" in str(states[-1][1])
    anon_states: list[Any] = []
    anon = (await connect()).channel(f"owner:{owner}", {"config": {"private": True}})
    await anon.subscribe(lambda state, err: anon_states.append((state, err)))
    assert anon_states[-1][0] == RealtimeSubscribeStates.CHANNEL_ERROR

    conn.execute("update public.nodes set status = 'offline' where id = %s", (node,))
    await until(lambda: mine)
    assert mine[0]["payload"]["node"]["endpoint_url"]  # the owner's topic carries the whole row


async def test_presence_track_state_and_diff(connect: Callable[..., Any]) -> None:
    first, second = await connect(), await connect()
    a = first.channel("lobby", {"config": {"presence": {"key": "alice", "enabled": True}}})
    a.on_presence_sync(lambda: None)
    await subscribed(a)
    await a.track({"status": "watching"})
    b = second.channel("lobby", {"config": {"presence": {"key": "bob", "enabled": True}}})
    b.on_presence_sync(lambda: None)
    await subscribed(b)
    await until(lambda: "alice" in b.presence_state())  # presence_state on join
    await b.track({"status": "typing"})
    await until(lambda: "bob" in a.presence_state())  # presence_diff
    assert a.presence_state()["bob"][0]["status"] == "typing"
    await second.close()
    await until(lambda: "bob" not in a.presence_state())  # a closed socket leaves


async def raw_socket(gateway: str, token: str, vsn: str = "1.0.0") -> websockets.ClientConnection:
    return await websockets.connect(f"{realtime_url(gateway)}/websocket?apikey={token}&vsn={vsn}")


def join(topic: str, payload: dict[str, Any], ref: str = "1") -> str:
    """A phx_join as vsn 1.0.0 sends it (the ref is the channel's join_ref too)."""
    return json.dumps({"topic": topic, "event": "phx_join", "ref": ref, "join_ref": ref, "payload": payload})


async def test_heartbeat_and_vsn2_arrays(gateway: str) -> None:
    async with await raw_socket(gateway, ANON, "2.0.0") as ws:
        await ws.send(json.dumps([None, "7", "phoenix", "heartbeat", {}]))
        assert json.loads(await ws.recv()) == [
            None,
            "7",
            "phoenix",
            "phx_reply",
            {"status": "ok", "response": {}},
        ]
        await ws.send(json.dumps(["1", "2", "realtime:room", "phx_join", {"config": {}}]))
        reply = json.loads(await ws.recv())
        assert reply == [
            "1",
            "2",
            "realtime:room",
            "phx_reply",
            {"status": "ok", "response": {"postgres_changes": []}},
        ]
        await ws.send(json.dumps(["1", "3", "realtime:room", "phx_leave", {}]))
        assert json.loads(await ws.recv())[3] == "phx_reply"
        assert json.loads(await ws.recv())[3] == "phx_close"


async def test_bad_tokens_and_expiry(gateway: str, conn: psycopg.Connection) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        await raw_socket(gateway, "not-a-jwt")
    assert refused.value.response.status_code == 403
    forged = api_key("another-secret-entirely-and-long-enough", "service_role")
    with pytest.raises(websockets.InvalidStatus):
        await raw_socket(gateway, forged)

    user = make_user(conn)
    async with await raw_socket(gateway, ANON) as ws:
        expired = user_token(PLACEHOLDER_SECRET, user, None, ttl_s=-5)
        await ws.send(join("realtime:t", {"config": {}, "access_token": expired}))
        reply = json.loads(await ws.recv())
        assert reply["payload"]["status"] == "error"
        assert reply["payload"]["response"]["reason"].startswith("InvalidJWTExpiration: Token has expired")

        short = user_token(PLACEHOLDER_SECRET, user, None, ttl_s=1)
        await ws.send(join("realtime:t", {"config": {}, "access_token": short}, ref="2"))
        assert json.loads(await ws.recv())["payload"]["status"] == "ok"
        system = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert system["event"] == "system" and system["payload"]["status"] == "error"
        assert "Token has expired" in system["payload"]["message"]
        assert json.loads(await ws.recv())["event"] == "phx_close"

        # A refreshed token keeps the channel open past the first one's expiry.
        await ws.send(
            join(
                "realtime:t",
                {
                    "config": {},
                    "access_token": user_token(PLACEHOLDER_SECRET, user, None, ttl_s=1),
                },
                ref="3",
            )
        )
        assert json.loads(await ws.recv())["payload"]["status"] == "ok"
        await ws.send(
            json.dumps(
                {
                    "topic": "realtime:t",
                    "event": "access_token",
                    "ref": "4",
                    "join_ref": "3",
                    "payload": {"access_token": user_token(PLACEHOLDER_SECRET, user, None)},
                }
            )
        )
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ws.recv(), 1.5)


async def test_bad_bindings_are_reported_not_fatal(gateway: str) -> None:
    async with await raw_socket(gateway, ANON) as ws:
        changes = [
            {"event": "UPDATE", "schema": "public", "table": "nodes", "filter": "status=like.x"},
            {"event": "*", "schema": "public", "table": "jobs_that_do_not_exist"},
        ]
        await ws.send(join("realtime:x", {"config": {"postgres_changes": changes}}))
        assert json.loads(await ws.recv())["payload"]["status"] == "ok"
        errors = [json.loads(await ws.recv())["payload"] for _ in range(2)]
        assert all(e["status"] == "error" and e["extension"] == "postgres_changes" for e in errors)
        assert "invalid filter" in errors[0]["message"] and "publication" in errors[1]["message"]
        await ws.send(json.dumps({"topic": "phoenix", "event": "heartbeat", "ref": "2", "payload": {}}))
        assert json.loads(await ws.recv())["payload"]["status"] == "ok"  # the socket lives on

        # Config sections that are not objects are taken as absent, not a crash.
        odd = {"broadcast": "yes", "presence": [1], "postgres_changes": None}
        await ws.send(join("realtime:odd", {"config": odd}, ref="3"))
        assert json.loads(await ws.recv())["payload"] == {
            "status": "ok",
            "response": {"postgres_changes": []},
        }


async def test_every_gateway_instance_delivers_everything(db_url: str, conn: psycopg.Connection) -> None:
    """Two gateways on one database: a client broadcast, a database change and presence made on one
    reach a subscriber of the other, including presence tracked before the second one started."""
    from neuralgrid.server.app import create_app
    from neuralgrid.server.serving import ThreadedServer
    from neuralgrid.server.settings import Settings

    node = make_node(conn, "rt-multi")
    with ThreadedServer(create_app(Settings(), db_url, sweep=False)) as first:
        a = AsyncRealtimeClient(realtime_url(first.url), token=ANON, auto_reconnect=False)
        await a.connect()
        lobby_a = a.channel("lobby", {"config": {"presence": {"key": "on-a", "enabled": True}}})  # type: ignore[arg-type]
        lobby_a.on_presence_sync(lambda: None)
        await subscribed(lobby_a)
        await lobby_a.track({"where": "a"})
        with ThreadedServer(create_app(Settings(), db_url, sweep=False)) as second:
            b = AsyncRealtimeClient(realtime_url(second.url), token=ANON, auto_reconnect=False)
            await b.connect()
            got: list[Any] = []
            lobby_b = b.channel("lobby", {"config": {"presence": {"key": "on-b", "enabled": True}}})  # type: ignore[arg-type]
            lobby_b.on_presence_sync(lambda: None)
            lobby_b.on_broadcast("*", got.append)
            await subscribed(lobby_b)
            await until(lambda: "on-a" in lobby_b.presence_state())
            await lobby_b.track({"where": "b"})
            await until(lambda: "on-b" in lobby_a.presence_state())

            await lobby_a.send_broadcast("ping", {"from": "a"})
            await until(lambda: any(m["event"] == "ping" for m in got))

            changes: list[Any] = []
            feed = b.channel("nodes")
            feed.on_postgres_changes(
                RealtimePostgresChangesListenEvent.Update, changes.append, table="nodes", schema="public"
            )
            await subscribed(feed)
            await asyncio.to_thread(set_status, db_url, node, "offline")
            await until(lambda: changes)
            await b.close()
        await until(lambda: "on-b" not in lobby_a.presence_state())
        await a.close()


async def test_large_payloads_and_retention(connect: Callable[..., Any], conn: psycopg.Connection) -> None:
    """A broadcast bigger than NOTIFY's 8000 bytes still arrives; the sweeper prunes old messages."""
    from neuralgrid.server.sweeper import prune_realtime

    client = await connect()
    got: list[dict[str, Any]] = []
    channel = client.channel("big")
    channel.on_broadcast("blob", got.append)
    await subscribed(channel)
    blob = "x" * 20_000
    conn.execute("select realtime.send(jsonb_build_object('blob', %s::text), 'blob', 'big', false)", (blob,))
    await until(lambda: got)
    assert got[0]["payload"]["blob"] == blob

    conn.execute("update realtime.messages set inserted_at = inserted_at - interval '4 days'")
    async with await psycopg.AsyncConnection.connect(conn.info.dsn, autocommit=True) as aconn:
        assert await prune_realtime(aconn) >= 1
    assert conn.execute("select count(*) from realtime.messages").fetchone() == (0,)


async def test_row_changes_are_notified_only_while_someone_watches(
    connect: Callable[..., Any], conn: psycopg.Connection, db_url: str
) -> None:
    """An unwatched table's writes (every claim of a node) cost no NOTIFY."""
    node = make_node(conn, "rt-quiet")

    def kinds_after_update() -> list[str]:
        with psycopg.connect(db_url, autocommit=True) as listener:
            listener.execute("listen realtime")
            conn.execute("update public.nodes set inflight = inflight + 1 where id = %s", (node,))
            return [json.loads(n.payload)["k"] for n in listener.notifies(timeout=0.5)]

    assert "change" not in await asyncio.to_thread(kinds_after_update)
    client = await connect()
    channel = client.channel("watching")
    channel.on_postgres_changes("UPDATE", lambda _: None, table="nodes", schema="public")
    await subscribed(channel)
    assert "change" in await asyncio.to_thread(kinds_after_update)
    await client.close()
    await until(lambda: conn.execute("select count(*) from realtime.feed_subscriptions").fetchone() == (0,))
    assert "change" not in await asyncio.to_thread(kinds_after_update)
