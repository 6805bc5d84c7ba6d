"""A fleet of real GPUs through a batching gateway (issue 41): each node's utilization and free VRAM
change every beat, and every beat after a node's first is written by the batch (its node_liveness
row), never through agent_heartbeat() into the node's row; a beat that changes only its load is
answered at once; the map shows each node's last load."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from neuralgrid.server.app import create_app
from neuralgrid.server.serving import ThreadedServer
from neuralgrid.server.settings import Settings
from tests.conftest import wait_for
from tests.gateway.test_heartbeat_batches import beat, register

FLUSH_S = 0.5
FLEET = 12
BEATS = 4


@pytest.fixture
def gateway(db_url: str) -> Iterator[str]:
    settings = Settings(NEURALGRID_HEARTBEAT_FLUSH_S=FLUSH_S, NEURALGRID_FIRST_BYTE_TIMEOUT_S=5)
    with ThreadedServer(create_app(settings, db_url, sweep=False)) as server:
        yield server.url


def load(k: int, i: int) -> dict[str, Any]:
    """Node i's load at its k-th beat: a different one every beat (exact in a float4)."""
    return {"gpu_utilization": ((k * 7 + i) % 16) / 16, "free_vram_gb": 0.25 * (k * 11 + i)}


def test_a_fleet_whose_load_changes_every_beat_is_written_by_the_batch(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    fleet: list[dict[str, Any]] = [register(gateway, api_key, f"gpu-{i}") for i in range(FLEET)]
    for i, node in enumerate(fleet):  # a node's first beat here: written as a change
        assert beat(gateway, node, **load(0, i)).status_code == 200
    rows = "select id::text, xmin::text from nodes order by id"
    written = conn.execute(rows).fetchall()
    for k in range(1, BEATS):
        for i, node in enumerate(fleet):
            started = time.monotonic()
            answer = beat(gateway, node, **load(k, i))
            assert answer.status_code == 200 and answer.json()["status"] == "online", answer.text
            # Nothing new but its load: answered at once, from the last flush.
            assert time.monotonic() - started < FLUSH_S / 2, "a beat that changed only its load waited"

    def shown() -> dict[str, tuple[float, float]]:
        found = conn.execute("select id::text, gpu_utilization, free_vram_gb from node_map").fetchall()
        return {r[0]: (r[1], r[2]) for r in found}

    last = {node["node_id"]: tuple(load(BEATS - 1, i).values()) for i, node in enumerate(fleet)}
    wait_for(lambda: shown() == last, timeout=FLUSH_S * 6)
    # No beat after each node's first wrote its row: all went into node_liveness.
    assert conn.execute(rows).fetchall() == written
