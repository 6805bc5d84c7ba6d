"""Several gateways on one database: a tunneled node answers through any of them (the gateway holding
its tunnel relays for the others), a dead gateway costs its tunneled nodes nothing, the forwarding
route takes signed requests from gateways only, and the request path runs through pgbouncer.

Gateway A runs in its own process (`neuralgrid up`), so it can be killed; B and C run in this one.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from websockets.sync.client import connect

from neuralgrid.dev.fakenode import FakeNodeConfig, create_fake_node
from neuralgrid.gateway import peers
from neuralgrid.protocol import signing
from neuralgrid.protocol.tunnel import Data, End, Err, Req, Start, encode, gateway_frame
from neuralgrid.server.app import create_app
from neuralgrid.server.serving import ThreadedServer
from neuralgrid.server.settings import Settings
from tests.conftest import (
    LLAMA8,
    free_port,
    node_row,
    register_tunnel_node,
    running_agent,
    stream_chat,
    tunnel_url,
    wait_for,
)
from tests.pgbouncer import SESSION, TRANSACTION, Bouncer, pgbouncer
from tests.slots import JOB_SLOTS

SECRET = "multi-gateway-test-secret-0123456789abcdef"  # NEURALGRID_JWT_SECRET, shared by all three
PLAIN = {"model": LLAMA8, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
STREAM = {**PLAIN, "max_tokens": 4, "stream": True}


@dataclass
class Gateways:
    a: str
    b: str
    c: str
    a_process: subprocess.Popen[bytes]

    def kill_a(self) -> None:
        self.a_process.send_signal(signal.SIGKILL)
        self.a_process.wait(timeout=10)


@contextmanager
def three_gateways(db_url: str, home: Path, **env: str) -> Iterator[Gateways]:
    """A in its own process (it sweeps too), B (sweeping every 0.2 s) and C in this one; same
    database, same secret. `env` adds settings to all three."""
    # One machine: the three share a spool folder, so a killed gateway's unwritten jobs are written by
    # the others (journal.py).
    common: dict[str, Any] = {
        "NEURALGRID_JWT_SECRET": SECRET,
        "NEURALGRID_FIRST_BYTE_TIMEOUT_S": "5",
        "NEURALGRID_SPOOL_DIR": str(home / "spool"),
        **env,
    }
    a_port = free_port()
    a_env = {**os.environ, **common, "DATABASE_URL": db_url, "NEURALGRID_HOME": str(home)}
    a_env["NEURALGRID_PORT"] = str(a_port)
    a = subprocess.Popen(
        [sys.executable, "-m", "neuralgrid.cli", "up", "--demo", "0"],
        env=a_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with ExitStack() as stack:
        stack.callback(_end, a)
        servers = []
        for sweep in (True, False):
            port = free_port()
            settings = Settings(**common, NEURALGRID_PORT=port, NEURALGRID_SWEEP_INTERVAL_S=0.2)
            servers.append(
                stack.enter_context(ThreadedServer(create_app(settings, db_url, sweep=sweep), port=port))
            )
        a_url = f"http://127.0.0.1:{a_port}"
        wait_for(lambda: _ready(a_url), timeout=30)
        yield Gateways(a_url, servers[0].url, servers[1].url, a)


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def gateway_id(conn: psycopg.Connection, url: str) -> uuid.UUID:
    row = wait_for(
        lambda: conn.execute("select id from private.gateways where internal_url = %s", (url,)).fetchone()
    )
    return uuid.UUID(str(row[0]))


def route_of(conn: psycopg.Connection, node: Any) -> uuid.UUID | None:
    row = conn.execute("select gateway_id from private.tunnel_routes where node_id = %s", (node,)).fetchone()
    return None if row is None else uuid.UUID(str(row[0]))


def reputation(conn: psycopg.Connection, node: Any) -> tuple[Any, ...]:
    """What a failure would change: failures, failures in a row, cooldown."""
    row = conn.execute(
        "select failures, consecutive_failures, cooldown_until from nodes where id = %s", (node,)
    ).fetchone()
    assert row is not None
    return tuple(row)


def counted_failed(gateway: str, node: Any) -> bool:
    """Whether the gateway's /metrics counts an attempt of the node as failed."""
    metrics = httpx.get(f"{gateway}/metrics", timeout=10).text
    return f'neuralgrid_node_outcomes_total{{node="{node}",outcome="failed"}}' in metrics


def ask(gateway: str, key: str, body: dict[str, Any] = PLAIN) -> httpx.Response:
    return httpx.post(
        f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=20
    )


def served_through(gateway: str, key: str, node: Any) -> None:
    """A plain answer and a stream, both from `node`, through `gateway`."""
    plain = ask(gateway, key)
    assert plain.status_code == 200, plain.text
    assert plain.headers["x-neuralgrid-node"] == str(node)
    assert plain.json()["usage"]["completion_tokens"] == 3
    with stream_chat(gateway, key, STREAM) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["x-neuralgrid-node"] == str(node)
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len([e for e in events if e.startswith("data: {")]) == 4


@pytest.fixture
def backend() -> Iterator[ThreadedServer]:
    with ThreadedServer(create_fake_node(FakeNodeConfig(models=(LLAMA8,), tokens_per_s=200))) as server:
        yield server


# Forwarding, and a gateway's death --------------------------------------------------------------


def test_a_tunneled_node_answers_through_every_gateway_and_outlives_the_one_it_dialled(
    conn: psycopg.Connection, db_url: str, operator_key: str, backend: ThreadedServer, tmp_path: Path
) -> None:
    conn.execute("update platform_settings set heartbeat_interval_s = 1, gateway_timeout_s = 4")
    with three_gateways(db_url, tmp_path) as gw:
        ids = {url: gateway_id(conn, url) for url in (gw.a, gw.b, gw.c)}
        gateways = f"{gw.a},{gw.b},{gw.c}"  # the agent dials the first, and the next when one goes
        with running_agent(conn, gateways, operator_key, backend.url, "nat-box", 24, "--tunnel"):
            node = node_row(conn, "nat-box")[0]
            wait_for(lambda: route_of(conn, node) == ids[gw.a])
            for gateway in (gw.b, gw.c, gw.a):  # B and C forward to A, which holds the tunnel
                served_through(gateway, operator_key, node)

            gw.kill_a()
            # The agent dials B at once; its heartbeats go to B too.
            wait_for(lambda: route_of(conn, node) == ids[gw.b], timeout=5)
            for gateway in (gw.b, gw.c):
                served_through(gateway, operator_key, node)
            # A's silence, once judged (4 s), takes nothing from the node: its route names B.
            time.sleep(4.5)
            assert node_row(conn, "nat-box")[1] == "online" and route_of(conn, node) == ids[gw.b]
            served_through(gw.c, operator_key, node)
            assert reputation(conn, node) == (0, 0, None)
            # The last jobs' endings are written behind: none running a moment later, none failed.
            unfinished = "select status, error, http_status from job_attempts where node_id = %s and status <> 'succeeded'"
            wait_for(lambda: ("running", None, None) not in conn.execute(unfinished, (node,)).fetchall())
            assert conn.execute(unfinished, (node,)).fetchall() == []


def test_no_gateway_blames_a_node_for_a_tunnel_it_cannot_reach(
    conn: psycopg.Connection, db_url: str, operator_key: str, tmp_path: Path
) -> None:
    """A dies holding the tunnel of a node that does not dial again, with a request of C's on it, and
    then B and C cannot reach the node. Its failures and cooldown stay as they were, until the sweep
    takes it offline."""
    conn.execute("update platform_settings set heartbeat_interval_s = 60, gateway_timeout_s = 4")
    with three_gateways(db_url, tmp_path) as gw:
        a_id = gateway_id(conn, gw.a)
        node = register_tunnel_node(gw.b, operator_key, "raw-box")
        secret = {"authorization": f"Bearer {node['node_secret']}"}
        with connect(tunnel_url(gw.a, node), additional_headers=secret) as ws, ThreadPoolExecutor(1) as pool:
            wait_for(lambda: route_of(conn, node["node_id"]) == a_id)
            in_flight = pool.submit(ask, gw.c, operator_key)
            request = gateway_frame(ws.recv(timeout=10))
            ws.send(encode(Start(id=request.id, status=200)))  # the status line, and no body yet...
            time.sleep(0.3)
            gw.kill_a()  # ...when A dies
            broken = in_flight.result(timeout=20)
            wait_for(lambda: _ready(gw.a) is False)
            lost = ask(gw.c, operator_key)
        # The only node could not be reached: the client hears so, in OpenAI's shape...
        for resp in (broken, lost):
            assert resp.status_code == 502, resp.text
            assert "the gateway holding the node's tunnel" in resp.json()["error"]["message"]
        # ...and the node is not to blame: its attempts ended cancelled, with the platform's 421.
        assert reputation(conn, node["node_id"]) == (0, 0, None)
        attempts = conn.execute(
            "select status, http_status from job_attempts where node_id = %s", (node["node_id"],)
        ).fetchall()
        assert attempts == [("cancelled", 421)] * 2
        assert not counted_failed(gw.c, node["node_id"])  # nor in the gateway's own metrics
        assert conn.execute(
            f"select {JOB_SLOTS} from nodes n where id = %s", (node["node_id"],)
        ).fetchone() == (0,)

        # A's silence judged (4 s, swept by B every 0.2 s): the route is forgotten, the node offline.
        wait_for(lambda: route_of(conn, node["node_id"]) is None, timeout=10)
        assert node_row(conn, "raw-box")[1] == "offline"
        # Made to look online with no gateway holding its tunnel: still no blame, from any gateway.
        conn.execute("update nodes set status = 'online', tunnel_connected = true where name = 'raw-box'")
        for gateway in (gw.b, gw.c):
            resp = ask(gateway, operator_key)
            assert resp.status_code == 502 and "no live gateway holds" in resp.json()["error"]["message"]
        assert reputation(conn, node["node_id"]) == (0, 0, None)


def test_a_holder_dying_mid_stream_is_not_the_nodes_failure(
    conn: psycopg.Connection, db_url: str, operator_key: str, tmp_path: Path
) -> None:
    """C streams from a node whose tunnel A holds; A dies after the stream's first event reached the
    client. The client's stream ends with an error event, and the node is not to blame: the job and
    its attempt end cancelled, its failures and cooldown stay as they were, its slot is free."""
    conn.execute("update platform_settings set heartbeat_interval_s = 60")
    first = {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "Hi"}}],
    }
    got_first = threading.Event()

    def read_stream(gateway: str) -> list[str]:
        with stream_chat(gateway, operator_key, STREAM) as resp:
            assert resp.status_code == 200, resp.read()
            events = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    got_first.set()
            return events

    with three_gateways(db_url, tmp_path) as gw:
        node = register_tunnel_node(gw.b, operator_key, "raw-box")
        secret = {"authorization": f"Bearer {node['node_secret']}"}
        with connect(tunnel_url(gw.a, node), additional_headers=secret) as ws, ThreadPoolExecutor(1) as pool:
            wait_for(lambda: route_of(conn, node["node_id"]) is not None)
            streamed = pool.submit(read_stream, gw.c)
            request = gateway_frame(ws.recv(timeout=10))
            ws.send(encode(Start(id=request.id, status=200, type="text/event-stream")))
            ws.send(encode(Data(id=request.id, b=f"data: {json.dumps(first)}\n\n")))
            assert got_first.wait(timeout=10)
            gw.kill_a()  # the holder dies with the stream under way
            events = streamed.result(timeout=20)
        assert json.loads(events[0][6:]) == first and events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert (
            error["code"] == "upstream_dropped"
            and "the gateway holding the node's tunnel" in error["message"]
        )
        jobs = wait_for(  # written once the stream is over
            lambda: conn.execute(
                "select status from jobs where node_id = %s and status <> 'running'", (node["node_id"],)
            ).fetchall()
        )
        assert reputation(conn, node["node_id"]) == (0, 0, None)
        attempts = conn.execute(
            "select status from job_attempts where node_id = %s", (node["node_id"],)
        ).fetchall()
        assert jobs == [("cancelled",)] and attempts == [("cancelled",)]
        assert not counted_failed(gw.c, node["node_id"])
        assert conn.execute(
            f"select {JOB_SLOTS} from nodes n where id = %s", (node["node_id"],)
        ).fetchone() == (0,)


def test_a_nodes_own_failure_through_another_gateway_is_still_its_own(
    conn: psycopg.Connection, db_url: str, operator_key: str, tmp_path: Path
) -> None:
    """Forwarding relays the agent's error as the node's: B counts it as it would a tunnel of its own."""
    conn.execute("update platform_settings set heartbeat_interval_s = 60")
    with three_gateways(db_url, tmp_path) as gw:
        node = register_tunnel_node(gw.b, operator_key, "raw-box")
        secret = {"authorization": f"Bearer {node['node_secret']}"}
        with connect(tunnel_url(gw.a, node), additional_headers=secret) as ws, ThreadPoolExecutor(1) as pool:
            wait_for(lambda: route_of(conn, node["node_id"]) is not None)
            answered = pool.submit(ask, gw.b, operator_key)
            request = gateway_frame(ws.recv(timeout=10))
            assert isinstance(request, Req) and request.path == "/v1/chat/completions"
            usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
            reply = json.dumps({"id": "x", "object": "chat.completion", "choices": [], "usage": usage})
            for frame in (Start(id=request.id, status=200), Data(id=request.id, b=reply), End(id=request.id)):
                ws.send(encode(frame))
            assert answered.result(timeout=20).json()["usage"]["total_tokens"] == 3

            failing = pool.submit(ask, gw.c, operator_key)
            request = gateway_frame(ws.recv(timeout=10))
            ws.send(encode(Err(id=request.id, message="the backend failed: out of memory")))
            resp = failing.result(timeout=20)
        assert resp.status_code == 502 and "out of memory" in resp.json()["error"]["message"]
        failures, in_a_row, cooldown = reputation(conn, node["node_id"])
        assert (failures, in_a_row) == (1, 1) and cooldown is not None


# The forwarding route: gateways only ------------------------------------------------------------


def test_the_forwarding_route_refuses_what_no_gateway_signed(conn: psycopg.Connection, db_url: str) -> None:
    settings = Settings(NEURALGRID_JWT_SECRET=SECRET, NEURALGRID_PORT=free_port())
    key = peers.forwarding_key(settings)
    body = b'{"model": "x", "messages": []}'
    node = uuid.uuid4()
    with ThreadedServer(create_app(settings, db_url, sweep=False), port=settings.port) as gateway:
        me = gateway_id(conn, gateway.url)
        path = f"/internal/gateways/{me}/tunnels/{node}/v1/chat/completions"

        def post(target: str, signature: str | None, content: bytes = body) -> httpx.Response:
            headers = {signing.HEADER: signature} if signature is not None else {}
            return httpx.post(gateway.url + target, content=content, headers=headers)

        unsigned = post(path, None)
        assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "invalid_api_key"
        other = peers.forwarding_key(Settings(NEURALGRID_JWT_SECRET="another-deployment-secret-0123456789"))
        assert post(path, signing.sign(other, path, body)).status_code == 401  # another platform's gateway
        assert post(path, signing.sign(key, path, b"{}")).status_code == 401  # signed for another body
        elsewhere = f"/internal/gateways/{me}/tunnels/{uuid.uuid4()}/v1/chat/completions"
        assert post(path, signing.sign(key, elsewhere, body)).status_code == 401  # for another node
        assert post(path, signing.sign(key, path, body, now=time.time() - 120)).status_code == 401  # stale

        # The wait for the node is signed too: one changed on the way is refused, a bad one is a 400.
        waiting = path + "?first_byte_timeout_s=5.000"
        assert post(path + "?first_byte_timeout_s=900", signing.sign(key, waiting, body)).status_code == 401
        never = path + "?first_byte_timeout_s=nan"
        assert post(never, signing.sign(key, never, body)).status_code == 400

        signed = signing.sign(key, waiting, body)
        first = post(waiting, signed)
        # Signed, but this gateway holds no tunnel of that node: misdirected (the asker moves on).
        assert first.status_code == 421 and first.json()["error"]["code"] == "misdirected_request"
        assert post(waiting, signed).status_code == 401  # the same signature again: a replay
        # Signed for another gateway: refused here whatever tunnels this one holds.
        for_another = f"/internal/gateways/{uuid.uuid4()}/tunnels/{node}/v1/chat/completions"
        assert post(for_another, signing.sign(key, for_another, body)).status_code == 421

        # Only inference paths reach an agent, never anything else on its machine.
        for rest in ("v1/models", "admin/shutdown"):
            target = f"/internal/gateways/{me}/tunnels/{node}/{rest}"
            resp = post(target, signing.sign(key, target, body))
            assert resp.status_code == 400 and "is not forwarded" in resp.json()["error"]["message"]
        # Nor is the route part of the public API's description.
        assert not [p for p in httpx.get(f"{gateway.url}/openapi.json").json()["paths"] if "internal" in p]


# Through pgbouncer -------------------------------------------------------------------------------


@pytest.fixture
def bouncer(pg_server: Any, db_url: str, tmp_path: Path) -> Iterator[Bouncer]:
    database = str(conninfo_to_dict(db_url)["dbname"])
    with pgbouncer(pg_server.port, database, tmp_path) as running:
        yield running


def test_three_gateways_through_pgbouncer(
    conn: psycopg.Connection,
    operator_key: str,
    backend: ThreadedServer,
    bouncer: Bouncer,
    tmp_path: Path,
) -> None:
    """The request path (keys, matching, completions, tunnel routes) pooled per transaction; LISTEN
    and the sweepers per session. Enough requests that a prepared statement would have surfaced."""
    conn.execute("update platform_settings set heartbeat_interval_s = 1")
    pooled = {
        "NEURALGRID_DB_TRANSACTION_POOLER": "true",
        "NEURALGRID_SESSION_DATABASE_URL": bouncer.url(SESSION),
        "NEURALGRID_DB_POOL_SIZE": "4",
        "NEURALGRID_REQUEST_POOL_SIZE": "2",
    }
    home = tmp_path / "home"
    home.mkdir()
    before = bouncer.stat(TRANSACTION, "total_xact_count")
    with three_gateways(bouncer.url(TRANSACTION), home, **pooled) as gw:
        with running_agent(conn, gw.a, operator_key, backend.url, "nat-box", 24, "--tunnel"):
            node = node_row(conn, "nat-box")[0]
            for _ in range(4):
                for gateway in (gw.b, gw.c):
                    served_through(gateway, operator_key, node)
            # The request path went through the transaction pool...
            assert bouncer.stat(TRANSACTION, "total_xact_count") - before > 8 * 2
            # ...and LISTEN through the session pool: a key revoked in SQL is refused by B and C at once.
            (extra,) = conn.execute("select api_key from create_api_key('short-lived')").fetchone() or ("",)
            for gateway in (gw.b, gw.c):
                assert ask(gateway, extra).status_code == 200  # cached by each gateway now
            conn.execute("update api_keys set revoked_at = now() where name = 'short-lived'")
            for gateway in (gw.b, gw.c):
                wait_for(lambda g=gateway: ask(g, extra).status_code == 401, timeout=5)
            listening = [p for p in bouncer.show("pools") if p["database"] == SESSION]
            assert listening and int(listening[0]["cl_active"]) >= 3 * 2  # each gateway's two LISTENs
        assert reputation(conn, node) == (0, 0, None)


# Heartbeats in batches through several gateways (issue 41) ----------------------------------------


def test_two_gateways_batch_the_same_nodes_beats(
    conn: psycopg.Connection, db_url: str, operator_key: str
) -> None:
    """Agents beat through whichever gateway answers: two gateways batching beats of the same nodes at
    the same moment take their rows in one order (no deadlock, no beat refused), a node's last beat
    never goes back in time, and a node registered again through one gateway has its old secret
    refused by the other (the database tells every gateway)."""
    settings = Settings(NEURALGRID_JWT_SECRET=SECRET, NEURALGRID_HEARTBEAT_FLUSH_S=0.3)
    with (
        ThreadedServer(create_app(settings, db_url, sweep=False)) as b,
        ThreadedServer(create_app(settings, db_url, sweep=False)) as c,
    ):
        nodes = []
        for i in range(24):
            spec = {
                "name": f"box-{i}",
                "gpu_model": "NVIDIA GeForce RTX 4090",
                "vram_gb": 24,
                "tflops": 165,
                "hourly_rate": 0.3,
                "region": "eu-west",
                "endpoint_url": f"https://box-{i}.example.com",
                "models": [LLAMA8],
            }
            auth = {"authorization": f"Bearer {operator_key}"}
            nodes.append(httpx.post(f"{b.url}/v1/nodes", json=spec, headers=auth).json())

        def beat(gateway: str, node: dict[str, Any], secret: str | None = None) -> int:
            auth = {"authorization": f"Bearer {secret or node['node_secret']}"}
            url = f"{gateway}/v1/nodes/{node['node_id']}/heartbeat"
            return httpx.post(url, json={"models": [LLAMA8]}, headers=auth, timeout=10).status_code

        stamps: list[Any] = []
        with ThreadPoolExecutor(16) as pool:
            for _ in range(4):
                answers = list(
                    pool.map(lambda args: beat(*args), [(g, n) for n in nodes for g in (b.url, c.url)])
                )
                assert set(answers) == {200}, answers
                time.sleep(0.4)  # a flush of each gateway's
                stamps.append(
                    dict(
                        conn.execute("select node_id::text, last_heartbeat_at from node_liveness").fetchall()
                    )
                )
        assert set(stamps[-1]) == {n["node_id"] for n in nodes}
        for earlier, later in itertools.pairwise(stamps):
            assert all(later[n] >= at for n, at in earlier.items())
        online = conn.execute("select count(*) from nodes where status = 'online'").fetchone()
        assert online == (len(nodes),)

        # Registered again through B: C refuses the old secret too, and takes the new one.
        spec["name"] = "box-23"
        again = httpx.post(
            f"{b.url}/v1/nodes", json=spec, headers={"authorization": f"Bearer {operator_key}"}
        ).json()
        wait_for(lambda: beat(c.url, nodes[-1]) == 403, timeout=3)
        assert beat(c.url, again) == 200
