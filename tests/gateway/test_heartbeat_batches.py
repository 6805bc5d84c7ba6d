"""Heartbeats in batches (issue 41), through a real gateway: a beat is refused at once when its secret
or node is wrong, answered at once from the last flush when it repeats its node's last beat (and
written within a flush), and answered once written when it says anything new."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from neuralgrid.server.app import create_app
from neuralgrid.server.serving import ThreadedServer
from neuralgrid.server.settings import Settings
from tests.conftest import LLAMA8, wait_for

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
FLUSH_S = 0.5


@pytest.fixture
def batching_gateway(db_url: str) -> Iterator[str]:
    settings = Settings(NEURALGRID_HEARTBEAT_FLUSH_S=FLUSH_S, NEURALGRID_FIRST_BYTE_TIMEOUT_S=5)
    with ThreadedServer(create_app(settings, db_url, sweep=False)) as server:
        yield server.url


def register(gateway: str, key: str, name: str = "box") -> dict[str, Any]:
    spec = {
        "name": name,
        "gpu_model": "NVIDIA GeForce RTX 4090",
        "vram_gb": 24,
        "tflops": 165,
        "hourly_rate": 0.3,
        "region": "eu-west",
        "endpoint_url": "https://node.example.com",
        "models": [LLAMA8],
    }
    answer = httpx.post(f"{gateway}/v1/nodes", json=spec, headers={"authorization": f"Bearer {key}"})
    assert answer.status_code == 201, answer.text
    node: dict[str, Any] = answer.json()
    return node


def beat(gateway: str, node: dict[str, Any], secret: str | None = None, **body: Any) -> httpx.Response:
    auth = {"authorization": f"Bearer {secret or node['node_secret']}"}
    return httpx.post(
        f"{gateway}/v1/nodes/{node['node_id']}/heartbeat",
        json={"models": [LLAMA8], **body},
        headers=auth,
        timeout=10,
    )


def liveness(conn: psycopg.Connection, node: dict[str, Any]) -> Any:
    row = conn.execute("select last_heartbeat_at from node_liveness where node_id = %s", (node["node_id"],))
    found = row.fetchone()
    return None if found is None else found[0]


def test_a_repeated_beat_is_answered_at_once_and_written_within_a_flush(
    conn: psycopg.Connection, batching_gateway: str, api_key: str
) -> None:
    node = register(batching_gateway, api_key)
    first = beat(batching_gateway, node)  # a node's first beat here: answered once written
    assert first.status_code == 200, first.text
    assert first.json() == {"node_id": node["node_id"], "status": "online", "load": []}
    written = liveness(conn, node)
    assert written is not None, "the first beat was answered before it was written"
    row_before = conn.execute(
        "select xmin::text, updated_at from nodes where id = %s", (node["node_id"],)
    ).fetchone()

    time.sleep(0.05)
    started = time.monotonic()
    again = beat(batching_gateway, node)
    assert again.status_code == 200 and again.json()["status"] == "online"
    assert time.monotonic() - started < FLUSH_S / 2, "a beat that says nothing new waited for its flush"
    wait_for(lambda: liveness(conn, node) > written, timeout=FLUSH_S * 4)
    # Nothing but the node's liveness was written: not its row, not its models.
    assert (
        conn.execute("select xmin::text, updated_at from nodes where id = %s", (node["node_id"],)).fetchone()
        == row_before
    )


def test_a_beat_that_says_something_new_is_answered_once_written(
    conn: psycopg.Connection, batching_gateway: str, api_key: str
) -> None:
    conn.execute(
        "insert into node_models (node_id, model_id, state) select id, %s, 'available' from nodes", (QWEN,)
    )
    node = register(batching_gateway, api_key)
    assert beat(batching_gateway, node).status_code == 200
    warmer = beat(batching_gateway, node, models=[LLAMA8, QWEN], queue_depth=2)
    assert warmer.status_code == 200, warmer.text
    # Written before the answer: no wait here.
    states: dict[str, str] = dict(
        conn.execute(
            "select model_id, state from node_models where node_id = %s", (node["node_id"],)
        ).fetchall()
    )
    assert states == {LLAMA8: "loaded", QWEN: "loaded"}
    assert conn.execute("select queue_depth from nodes where id = %s", (node["node_id"],)).fetchone() == (2,)
    leaving = beat(batching_gateway, node, status="draining", models=[LLAMA8, QWEN], queue_depth=2)
    assert leaving.json()["status"] == "draining"
    assert conn.execute("select status from nodes where id = %s", (node["node_id"],)).fetchone() == (
        "draining",
    )


def test_a_wrong_secret_or_node_is_refused_at_once(
    db_url: str, conn: psycopg.Connection, api_key: str
) -> None:
    settings = Settings(NEURALGRID_HEARTBEAT_FLUSH_S=4)  # a refusal that waited for a flush would show
    with ThreadedServer(create_app(settings, db_url, sweep=False)) as server:
        gateway = server.url
        node = register(gateway, api_key)
        assert beat(gateway, node).status_code == 200
        for secret, node_id, status in (
            ("ngn-not-the-secret", node["node_id"], 403),
            (None, "00000000-0000-4000-8000-000000000000", 404),
        ):
            started = time.monotonic()
            refused = beat(gateway, {**node, "node_id": node_id}, secret=secret)
            assert refused.status_code == status, refused.text
            assert time.monotonic() - started < 2, "a refusal waited for a flush"
        assert refused.json()["error"]["message"] == "no node 00000000-0000-4000-8000-000000000000"

        # Registered again (a reinstall): the database tells the gateway, which refuses the old secret
        # from then on and takes the new one.
        again = register(gateway, api_key)
        wait_for(lambda: beat(gateway, node).status_code == 403, timeout=2)
        assert beat(gateway, again).status_code == 200


def test_a_rule_the_database_keeps_refuses_that_beat_alone(
    conn: psycopg.Connection, batching_gateway: str, api_key: str
) -> None:
    """Specs the body's schema takes but a node's rules refuse (the node's table keeps them): the beat
    is answered with the database's 400 once its flush ran, and its neighbours in the batch are written."""
    bad, good = register(batching_gateway, api_key, "bad"), register(batching_gateway, api_key, "good")
    conn.execute("update nodes set gpu_count = 64 where name = 'bad'")
    specs = {"gpu_model": "NVIDIA GeForce RTX 4090", "gpu_count": 65, "vram_gb": 24, "tflops": 165}
    refused = beat(batching_gateway, bad, specs=specs)
    assert refused.status_code in (400, 422), refused.text
    assert beat(batching_gateway, good).json()["status"] == "online"
    assert liveness(conn, good) is not None


def test_a_gateway_that_stops_writes_what_it_holds(
    db_url: str, conn: psycopg.Connection, api_key: str
) -> None:
    settings = Settings(NEURALGRID_HEARTBEAT_FLUSH_S=3)
    with ThreadedServer(create_app(settings, db_url, sweep=False)) as server:
        node = register(server.url, api_key)
        assert beat(server.url, node).status_code == 200  # written (its flush, up to 3 s)
        first = liveness(conn, node)
        time.sleep(0.05)
        assert beat(server.url, node).status_code == 200  # answered at once, written by a later flush
        assert liveness(conn, node) == first
    # Stopped before that flush came: the gateway flushed on its way out.
    assert liveness(conn, node) > first


def test_a_node_leaving_service_is_written_at_once_not_at_the_next_flush(
    db_url: str, conn: psycopg.Connection, api_key: str
) -> None:
    """A draining or offline beat is what a stopping agent waits for, twice: with a flush a second
    away each, agents took 1.1 s longer to stop, and the matcher kept the node a flush longer (as it
    did a node whose server stopped answering)."""
    settings = Settings(NEURALGRID_HEARTBEAT_FLUSH_S=3)
    with ThreadedServer(create_app(settings, db_url, sweep=False)) as server:
        node = register(server.url, api_key)
        assert beat(server.url, node).status_code == 200
        # What each beat says, and the node's status and backend_up as written.
        leaving: list[tuple[dict[str, Any], tuple[str, bool]]] = [
            ({"backend_up": False}, ("offline", False)),  # its server stopped answering
            ({}, ("online", True)),  # back: not leaving, answered at its flush (its wait not timed)
            ({"status": "draining"}, ("draining", True)),
            ({"status": "offline", "models": []}, ("offline", True)),
        ]
        for body, written in leaving:
            started = time.monotonic()
            answer = beat(server.url, node, **body)
            assert answer.status_code == 200, answer.text
            if body:
                assert time.monotonic() - started < 1.5, f"a beat saying {body} waited for its flush"
            row = conn.execute("select status, backend_up from nodes where id = %s", (node["node_id"],))
            assert row.fetchone() == written, body
