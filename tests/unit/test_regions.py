"""The regions' places (neuralgrid/protocol/regions.py) are the platform's regions: the simulator's,
and those the demo fleet's nodes stand in, each node near its region's city."""

from __future__ import annotations

import math

from neuralgrid.admin.fleet import read_fleet
from neuralgrid.dev.demo import DEMO_FLEET
from neuralgrid.protocol.regions import REGIONS
from neuralgrid.sim.physics import REGIONS as SIMULATED


def km(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Great-circle distance (haversine)."""
    (lat1, lon1), (lat2, lon2) = (map(math.radians, p) for p in (a, b))
    h = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return 2 * 6371 * math.asin(math.sqrt(h))


def test_the_regions_are_the_simulators() -> None:
    assert list(REGIONS) == SIMULATED


def test_every_demo_node_stands_near_its_regions_city() -> None:
    nodes = read_fleet(DEMO_FLEET)
    assert {n.region for n in nodes} == set(REGIONS)
    for node in nodes:
        assert node.latitude is not None and node.longitude is not None
        # Seoul is ap-northeast's farthest, 1,160 km from Tokyo.
        assert km((node.latitude, node.longitude), REGIONS[node.region]) < 1_200, node.name
