"""Small worlds for the simulator's tests: the database's catalog and weights, hand-built fleets."""

from __future__ import annotations

import numpy as np
import psycopg
import pytest

from neuralgrid.sim.physics import GPU_BY_NAME, REGIONS
from neuralgrid.sim.report import World
from neuralgrid.sim.scenarios import MODEL_IDS, Fleet


@pytest.fixture
def world(conn: psycopg.Connection) -> World:
    return World.load(conn)


def fleet_of(*nodes: tuple[str, str, list[str]], rate: list[float] | None = None) -> Fleet:
    """Nodes as (GPU, region, models loaded at the start), at the GPU table's prices and slots; every
    node's heartbeats at 0, 5, 10 s..."""
    gpus = [GPU_BY_NAME[gpu] for gpu, _, _ in nodes]
    return Fleet.at_rest(
        gpu=[g.name for g in gpus],
        vram_gb=[g.vram_gb for g in gpus],
        tflops=[g.tflops for g in gpus],
        hourly_rate=rate or [g.usd_per_hour for g in gpus],
        region=[REGIONS.index(region) for _, region, _ in nodes],
        max_concurrency=[g.slots for g in gpus],
        bandwidth_gb_s=[g.bandwidth_gb_s for g in gpus],
        warm=[[MODEL_IDS.index(m) for m in models] for _, _, models in nodes],
        heartbeat_phase=np.zeros(len(nodes)),
    )
