"""The embedded Realtime server through supabase-js (realtime-js, vsn 2.0.0) under Node, as the web
map uses it: node changes, database broadcasts, client broadcasts (binary frames), presence, and a
private topic it has no right to."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from realtime import AsyncRealtimeClient

from neuralgrid.server.settings import PLACEHOLDER_SECRET
from neuralgrid.server.stack import api_key, user_token
from tests.conftest import make_node, make_user

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "js" / "realtime_client.mjs"
ANON = api_key(PLACEHOLDER_SECRET, "anon")

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (ROOT / "node_modules" / "@supabase" / "supabase-js").exists(),
    reason="needs Node and npm's @supabase/supabase-js (./dev test installs them)",
)


class NodeClient:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            ["node", "--experimental-websocket", str(SCRIPT), *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.seen: list[dict[str, Any]] = []

    def read_until(self, key: str, predicate: Any = lambda v: True, timeout: float = 15) -> Any:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        for item in self.seen:
            if key in item and predicate(item[key]):
                return item[key]
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"node client exited; saw {self.seen}")
            item = json.loads(line)
            self.seen.append(item)
            if key in item and predicate(item[key]):
                return item[key]
        raise AssertionError(f"no {key} in {self.seen}")

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send({"quit": True})
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        if self.proc.stdin:
            self.proc.stdin.close()


# The script sends its broadcast on node-map, which is read-only by default (the platform's own
# topic); this test opens it to clients to keep realtime-js's binary broadcast frames covered, and
# test_supabase_js_cannot_write_to_the_map checks the default.
@pytest.mark.parametrize("gateway_settings", [{"NEURALGRID_REALTIME_READ_ONLY_TOPICS": []}])
def test_supabase_js_subscribes_receives_broadcasts_and_presence(
    gateway: str, conn: psycopg.Connection
) -> None:
    owner, stranger = make_user(conn), make_user(conn)
    node = make_node(conn, "js-node", owner_id=owner)
    client = NodeClient(gateway, ANON, user_token(PLACEHOLDER_SECRET, stranger, None), str(owner))
    try:
        ready = client.read_until("ready")
        assert ready == {"map": "SUBSCRIBED", "lobby": "SUBSCRIBED", "spy": "CHANNEL_ERROR"}

        conn.execute("update public.nodes set status = 'offline' where id = %s", (node,))
        event = client.read_until("broadcast", lambda m: m["event"] == "node_update")
        assert event["payload"]["node"]["status"] == "offline"
        change = client.read_until("change")
        assert change["eventType"] == "UPDATE" and change["new"]["status"] == "offline"
        assert "endpoint_url" not in change["new"]

        # A client broadcast travels as realtime-js's binary frame and comes back (self: true).
        client.send({"broadcast": {"event": "js-hello", "payload": {"n": 1}}})
        assert client.read_until("sent") == "ok"
        assert client.read_until("broadcast", lambda m: m["event"] == "js-hello")["payload"] == {"n": 1}

        # Presence across the two official clients: the Python one sees supabase-js and vice versa.
        async def python_side() -> dict[str, Any]:
            py = AsyncRealtimeClient(
                f"{gateway.replace('http', 'ws')}/realtime/v1", token=ANON, auto_reconnect=False
            )
            await py.connect()
            lobby = py.channel("lobby", {"config": {"presence": {"key": "py", "enabled": True}}})  # type: ignore[arg-type]
            lobby.on_presence_sync(lambda: None)
            await lobby.subscribe()
            await lobby.track({"via": "python"})
            deadline = time.monotonic() + 10
            while "js" not in lobby.presence_state() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            state = dict(lobby.presence_state())
            await asyncio.sleep(0.5)  # let supabase-js see our join before we leave
            await py.close()
            return state

        state = asyncio.run(python_side())
        assert state["js"][0]["via"] == "supabase-js"
        client.read_until("presence", lambda s: "py" in s)

        conn.execute("update public.nodes set status = 'online' where id = %s", (node,))
        client.read_until(
            "broadcast", lambda m: m["event"] == "node_update" and m["payload"]["node"]["status"] == "online"
        )
        assert not any("leaked" in item for item in client.seen)  # nothing from the owner's private topic
    finally:
        client.close()


def test_supabase_js_cannot_write_to_the_map(gateway: str, conn: psycopg.Connection) -> None:
    """realtime-js's binary broadcast on the platform's node-map topic is refused: it never comes
    back (self: true), while the platform's own node_update after it does."""
    owner, stranger = make_user(conn), make_user(conn)
    node = make_node(conn, "js-readonly", owner_id=owner)
    client = NodeClient(gateway, ANON, user_token(PLACEHOLDER_SECRET, stranger, None), str(owner))
    try:
        assert client.read_until("ready")["map"] == "SUBSCRIBED"
        client.send({"broadcast": {"event": "node_update", "payload": {"node": {"status": "fake"}}}})
        client.read_until("sent")
        conn.execute("update public.nodes set status = 'offline' where id = %s", (node,))
        client.read_until(
            "broadcast", lambda m: m["event"] == "node_update" and m["payload"]["node"]["status"] == "offline"
        )
        statuses = [
            item["broadcast"]["payload"]["node"]["status"] for item in client.seen if "broadcast" in item
        ]
        assert statuses == ["offline"]
    finally:
        client.close()
