"""GPU probes through a real gateway: it probes every node with an agent, signed, over HTTP and over
a tunnel, checks the digests on its own CPU and records what it found in SQL.

- A real agent on this machine (no GPU) says so: no_gpu, with why; it keeps serving.
- A CPU that claims an RTX 4090 fills and digests honestly (NumPy standing in for CuPy, the arithmetic
  the agent runs on a GPU) but at a CPU's bandwidth: slow, suspect, then failed and out of the matcher.
- A liar that answers digests it never computed fails at once.
- An honest fill claiming a GPU the datasheet table does not know is proven on its data alone.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any
from uuid import UUID

import httpx
import numpy as np
import psycopg
import pytest

from neuralgrid.agent.backend import Backend
from neuralgrid.agent.front import FrontState, create_front
from neuralgrid.agent.gpu_probe import GpuProbeHost
from neuralgrid.dev.fakenode import FakeNodeConfig
from neuralgrid.server.serving import ThreadedServer
from tests.agent.servers import SMOLLM2
from tests.agent.test_backends import HEARTBEAT_S, FakeServer, join, make_server, platform
from tests.conftest import wait_for

FILL_SHARE = 0.002  # of a claimed 24 GB: 46 MiB, made and digested by NumPy in about a second


class Liar(GpuProbeHost):
    """Says it filled, and answers digests at once, computed from nothing."""

    async def answer(self, body: bytes) -> tuple[int, dict[str, Any]]:
        status, answer = await super().answer(body)
        if status == 200 and "digests" in answer:
            size = len(base64.b64decode(answer["digests"]))
            answer = {"digests": base64.b64encode(os.urandom(size)).decode()}
        return status, answer

    def _fill_now(self, plan: Any) -> Any:
        return np.zeros((plan.blocks, plan.words), dtype=np.uint64)  # nothing made


class InProcessNode:
    """A node whose agent front runs here with a given probe host, registered and kept beating."""

    def __init__(self, gateway: str, key: str, name: str, gpu_model: str, gpu: GpuProbeHost) -> None:
        self.server = FakeServer(FakeNodeConfig(models=(SMOLLM2,))).start()
        self.state = FrontState(Backend(self.server.url), gpu=gpu)
        self.front = ThreadedServer(create_front(self.state)).start()
        spec = {
            "name": name,
            "gpu_model": gpu_model,
            "vram_gb": 24,
            "tflops": 165,
            "hourly_rate": 0.3,
            "region": "eu-west",
            "endpoint_url": self.front.url,
            "models": [SMOLLM2],
        }
        answer = httpx.post(f"{gateway}/v1/nodes", json=spec, headers={"authorization": f"Bearer {key}"})
        assert answer.status_code == 201, answer.text
        registered = answer.json()
        self.id = UUID(registered["node_id"])
        self.state.key = bytes.fromhex(registered["request_key"])
        self.beat_url = f"{gateway}/v1/nodes/{self.id}/heartbeat"
        self.secret = {"authorization": f"Bearer {registered['node_secret']}"}
        self.stop = threading.Event()
        self.beating = threading.Thread(target=self._beat, daemon=True)
        self.beating.start()

    def _beat(self) -> None:
        with httpx.Client() as http:
            while not self.stop.wait(HEARTBEAT_S / 2):
                http.post(self.beat_url, json={"models": [SMOLLM2]}, headers=self.secret)

    def close(self) -> None:
        self.stop.set()
        self.beating.join()
        self.front.stop()
        self.server.kill()


def proof(conn: psycopg.Connection, node: UUID) -> tuple[str, str | None]:
    row = conn.execute("select state, reason from gpu_proofs where node_id = %s", (node,)).fetchone()
    return (str(row[0]), row[1]) if row else ("", None)


def settled(conn: psycopg.Connection, node: UUID, *states: str) -> tuple[str, str | None]:
    """The node's proof once in one of `states` (the gateway probes every 2 s, one node at a time)."""
    wait_for(lambda: proof(conn, node)[0] in states, 60)
    return proof(conn, node)


def rejected(conn: psycopg.Connection) -> dict[UUID, str | None]:
    rows = conn.execute(
        "select node_id, reject_reason from score_nodes(%s, p_policy => 'seed', p_explain => true)",
        (SMOLLM2,),
    ).fetchall()
    return dict(rows)


@pytest.fixture(scope="module")
def world(
    pg_server: Any, template_db: str, tmp_path_factory: Any
) -> Iterator[tuple[str, str, psycopg.Connection]]:
    with platform(
        pg_server, template_db, NEURALGRID_GPU_PROBES=True, NEURALGRID_GPU_PROBE_FILL_SHARE=FILL_SHARE
    ) as stack:
        yield stack


def test_nodes_are_probed_and_each_claim_meets_its_consequence(
    world: tuple[str, str, psycopg.Connection], tmp_path: Any
) -> None:
    gateway, key, conn = world
    with ExitStack() as cleanup:
        nodes = {}
        for name, model, host in [
            ("cpu-4090", "NVIDIA GeForce RTX 4090", GpuProbeHost(np, "a CPU")),
            ("liar", "NVIDIA H100 80GB HBM3", Liar(np, "NVIDIA H100 80GB HBM3")),
            ("acme", "Acme Tensor 1", GpuProbeHost(np, "Acme Tensor 1")),
        ]:
            node = InProcessNode(gateway, key, name, model, host)
            cleanup.callback(node.close)
            nodes[name] = node.id
        server = make_server("fake", tmp_path)
        cleanup.callback(server.kill)
        agent, real = join(gateway, key, conn, server, "real-agent", "tunnel")
        cleanup.callback(agent.stop)

        _, reason = settled(conn, real, "no_gpu")
        assert reason and ("CuPy" in reason or "no NVIDIA GPU" in reason), reason

        _, reason = settled(conn, nodes["liar"], "failed")
        assert reason is not None and "blocks checked are not what the fill makes" in reason

        _, reason = settled(conn, nodes["acme"], "proven")
        assert reason == "no datasheet bandwidth known for Acme Tensor 1"

        _, reason = settled(conn, nodes["cpu-4090"], "suspect")
        assert reason is not None and "of a NVIDIA GeForce RTX 4090's 1008 GB/s" in reason
        gbps = conn.execute("select gbps from gpu_proofs where node_id = %s", (nodes["cpu-4090"],)).fetchone()
        assert gbps is not None and 0 < gbps[0] < 100.8  # a CPU's bandwidth, measured by the gateway
        conn.execute("update gpu_proofs set next_probe_at = now() where node_id = %s", (nodes["cpu-4090"],))
        settled(conn, nodes["cpu-4090"], "failed")

        explained = rejected(conn)
        assert explained[nodes["liar"]] == explained[nodes["cpu-4090"]] == "its GPU failed its probe"
        assert explained[nodes["acme"]] is None and explained[real] is None
        outcomes = conn.execute(
            "select outcome, count(*) from gpu_probes where node_id = %s group by 1", (nodes["cpu-4090"],)
        ).fetchall()
        assert outcomes == [("slow", 2)]
        metrics = httpx.get(f"{gateway}/metrics").text
        assert 'neuralgrid_gpu_probes_total{outcome="wrong"} 1.0' in metrics
        assert 'neuralgrid_gpu_probes_total{outcome="no_gpu"}' in metrics
