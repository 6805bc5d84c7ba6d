"""Where a node stands on the map (issue 40: the README's recipe gives --region and no coordinates,
and the map said "without a location, not on the map"): at its region's city unless the owner gives
--latitude and --longitude, and the agent says which; a region the platform does not know leaves
the node unplaced, and the agent says how to place it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import psycopg
import pytest

from neuralgrid.dev.fakenode import create_fake_node
from neuralgrid.protocol.regions import REGIONS, located
from neuralgrid.server.serving import ThreadedServer
from tests.conftest import agent_command, agent_log, free_port, wait_for


@pytest.fixture
def backend() -> Iterator[str]:
    with ThreadedServer(create_fake_node()) as server:
        yield server.url


def test_nodes_run_by_the_recipe_are_placed_at_their_regions_city_and_the_agent_says_so(
    conn: psycopg.Connection, platform: str, operator_key: str, backend: str
) -> None:
    flags = {
        "recipe": ["--region", "eu-west"],  # the README's: a region, no coordinates
        "own-place": ["--region", "eu-west", "--latitude", "48.85", "--longitude", "2.35"],
        "elsewhere": ["--region", "moon-base"],
    }
    with ExitStack() as stack:
        logs: dict[str, Path] = {}
        for name, where in flags.items():
            logs[name] = agent_log(name)
            base = ["--name", name, "--price", "0.3", "--vram-gb", "24", "--tflops", "165"]
            args = agent_command(
                platform, operator_key, backend, *base, *where, "--listen-port", str(free_port())
            )
            out = stack.enter_context(logs[name].open("wb"))
            agent = stack.enter_context(subprocess.Popen(args, stdout=out, stderr=out))
            stack.callback(agent.terminate)
        online = "select name, latitude, longitude from nodes where status = 'online' order by name"
        rows = wait_for(lambda: len(found := conn.execute(online).fetchall()) == 3 and found, timeout=30)
    assert rows == [("elsewhere", None, None), ("own-place", 48.85, 2.35), ("recipe", *REGIONS["eu-west"])]
    said = {name: log.read_text() for name, log in logs.items()}
    assert "map: the node is at eu-west's location, 51.51, -0.13" in said["recipe"]
    assert "map: the node is at 48.85, 2.35" in said["own-place"]
    assert "region 'moon-base' is none of us-east, us-west" in said["elsewhere"]
    assert "--latitude and --longitude place it" in said["elsewhere"]


def test_one_coordinate_given_is_the_owners_and_the_gateway_judges_it() -> None:
    assert located("eu-west", 10.0, None)[:2] == (10.0, None)
