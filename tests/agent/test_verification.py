"""Model verification against real servers: a gateway with a referee (the reference GGUF in
llama-cpp-python) challenges every node that claims SmolLM2, each behind a real agent. The honest
llama-server is verified and keeps serving; a llama-server running the same model with layers pruned
and the fake node (canned answers) fail within a few challenges and get no more traffic, their held
earnings forfeited; the owner's evidence says why.

A share of real traffic is audited the same way (here all of it).

The cheats are real: scripts/backends.sh builds model-pruned.gguf with llama.cpp's llama-quantize.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import openai
import psycopg
import pytest
from openai.types.chat import ChatCompletionMessageParam

from neuralgrid.server.app import create_app
from neuralgrid.server.serving import ThreadedServer
from neuralgrid.server.settings import Settings
from tests.agent.servers import SMOLLM2, RealServer, built
from tests.agent.test_backends import AgentProcess, join, make_server
from tests.conftest import clone_database, free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
CHALLENGE_EVERY_S = 0.3  # every state's mean wait between challenges: the test's minute is their hour


@contextmanager
def running_referee(log: Path, *models: Path) -> Iterator[str]:
    """The referee in llama-cpp-python's venv, holding `models`; yields its URL once it lists them."""
    root = built()
    port = free_port()
    # One thread: llama.cpp's threads spin while they wait for each other, and beside the servers on a
    # machine of two cores, two of them slowed every process on it tenfold.
    args = [
        str(root / "venv" / "bin" / "python"),
        "-m",
        "neuralgrid.verify.referee",
        "--port",
        str(port),
        "--threads",
        "1",
    ]
    for model in models:
        args += ["--model", str(model)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("ab") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"the referee exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"the referee did not start: {log.read_text()[-2000:]}"
            try:
                if httpx.get(f"{url}/v1/artifacts", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        process.kill()
        process.wait(timeout=10)


def llama_server(tmp: Path, model: Path, *extra: str, parallel: int = 2) -> RealServer:
    """A real llama-server of `model` (a cheat's file, say), started."""
    port = free_port()
    args = [
        str(built() / "bin" / "llama-server"),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    args += ["-c", str(2048 * parallel), "-np", str(parallel), "--threads", "1", *extra]
    return RealServer("llama.cpp", port, args, log=tmp / f"llama-server-{port}.log").start()


def stop_all(agents: dict[str, AgentProcess]) -> None:
    """Tells every agent to stop at once: each drains the challenge it serves (seconds on one
    thread), and one after the other the cross-checks' four took 19 to 31 s."""
    for agent in agents.values():
        if agent.process.poll() is None:
            agent.process.terminate()


@dataclass
class World:
    gateway: str
    key: str
    conn: psycopg.Connection
    nodes: dict[str, UUID]
    agents: dict[str, AgentProcess]

    def state(self, name: str) -> str | None:
        row = self.conn.execute(
            "select state from model_checks where node_id = %s and model_id = %s", (self.nodes[name], SMOLLM2)
        ).fetchone()
        return None if row is None else str(row[0])


@contextmanager
def a_world(
    pg_server: Any,
    template_db: str,
    tmp: Path,
    servers: dict[str, Callable[[], Any]],
    referee: bool = True,
    **settings: Any,
) -> Iterator[World]:
    """A gateway (with a referee of the pinned GGUF, or none) on a fresh database whose every
    challenge comes about every CHALLENGE_EVERY_S, and each of `servers` (started by its function)
    behind a real agent, its node online."""
    root = built()
    name = clone_database(pg_server, template_db)
    try:
        with ExitStack() as cleanup, psycopg.connect(pg_server.url(name), autocommit=True) as conn:
            conn.execute(
                "update platform_settings set heartbeat_interval_s = 0.5, challenge_unverified_s = %s,"
                " challenge_suspect_s = %s, challenge_verified_s = %s",
                (CHALLENGE_EVERY_S,) * 3,
            )
            key = conn.execute("select api_key from create_api_key('developer')").fetchone()
            assert key is not None
            if referee:
                url = cleanup.enter_context(running_referee(tmp / "referee.log", root / "model.gguf"))
                settings["NEURALGRID_REFEREE_URL"] = url
            settings = {"NEURALGRID_SWEEP_INTERVAL_S": 0.1, "NEURALGRID_FIRST_BYTE_TIMEOUT_S": 30, **settings}
            app = create_app(Settings(**settings), pg_server.url(name))
            gateway = cleanup.enter_context(ThreadedServer(app)).url
            nodes, agents = {}, {}
            for label, start in servers.items():
                server = start()
                cleanup.callback(server.kill)
                agent, node_id = join(gateway, str(key[0]), conn, server, label, "direct")
                cleanup.callback(agent.stop)
                nodes[label], agents[label] = node_id, agent
            cleanup.callback(stop_all, agents)  # first
            yield World(gateway, str(key[0]), conn, nodes, agents)
    finally:
        with psycopg.connect(pg_server.url(), autocommit=True) as admin:
            admin.execute(f"drop database {name} with (force)")


@pytest.fixture(scope="module")
def world(pg_server: Any, template_db: str, tmp_path_factory: Any) -> Iterator[World]:
    tmp: Path = tmp_path_factory.mktemp("verification")
    root = built()
    servers = {
        "honest": lambda: llama_server(tmp, root / "model.gguf"),
        "pruned": lambda: llama_server(tmp, root / "model-pruned.gguf"),
        "canned": lambda: make_server("fake", tmp),
    }
    with a_world(pg_server, template_db, tmp, servers, NEURALGRID_AUDIT_SHARE=1.0) as made:
        yield made


@pytest.mark.filterwarnings("default:the honest node failed a challenge")
def test_cheats_fail_within_a_few_challenges_and_the_honest_node_is_verified(world: World) -> None:
    def states() -> dict[str, str | None]:
        return {label: world.state(label) for label in world.nodes}

    try:
        wait_for(lambda: states() == {"honest": "verified", "pruned": "failed", "canned": "failed"}, 240)
    except AssertionError:
        raise AssertionError(f"states: {states()}") from None
    rows = world.conn.execute(
        "select n.name, c.challenges, c.failures from model_checks c join nodes n on n.id = c.node_id"
    ).fetchall()
    checks = {name: (challenges, failures) for name, challenges, failures in rows}
    # The sequential test allows an honest node a failed challenge now and then (a near-tie its
    # batch tipped, text that tokenizes back otherwise: docs/security.md measured 6 in 2,000 before
    # the reference split answers again, none in 450 after); CI met one (2026-12-07). One such
    # is allowed, and its evidence shown, to be scored again; any other reason is a fault here.
    honest = [
        d
        for (d,) in world.conn.execute(
            "select c.detail from model_challenges c where c.node_id = %s and not c.passed",
            (world.nodes["honest"],),
        )
    ]
    assert checks["honest"][1] == len(honest) <= 1, honest
    for detail in honest:
        assert "not the model's greedy choice" in detail["reason"], detail
        warnings.warn(f"the honest node failed a challenge: {json.dumps(detail)}", stacklevel=1)
    for cheat in ("pruned", "canned"):
        challenges, failures = checks[cheat]
        # Failed by two failures in a row, or a third after passes between (bench verify measures how
        # many challenges it takes).
        assert failures in (2, 3) and challenges <= 6, (cheat, checks[cheat])
    reasons = world.conn.execute(
        "select n.name, c.detail ->> 'reason' from model_challenges c join nodes n on n.id = c.node_id"
        " where not c.passed"
    ).fetchall()
    assert {name for name, _ in reasons} - {"honest"} == {"pruned", "canned"}
    assert all(
        "not the model's greedy choice" in (reason or "") or "refused" in (reason or "")
        for _, reason in reasons
    )
    # A failed challenge keeps what it asked, what the node answered and each token's gap, to be
    # scored again; an audit of a user's request keeps none of the user's text.
    kept = world.conn.execute(
        "select c.detail from model_challenges c where not c.passed and c.detail ->> 'finish_reason' is not null"
    ).fetchall()
    challenged = [d for (d,) in kept if not d.get("audit")]
    assert challenged and all(
        d["messages"][-1]["role"] == "user" and isinstance(d["answer"], str) and max(d["gaps"]) > 1
        for d in challenged
    ), challenged
    assert all("answer" not in d and "messages" not in d for (d,) in kept if d.get("audit"))


def test_only_the_verified_node_serves_traffic_and_the_cheats_forfeit_their_held_earnings(
    world: World,
) -> None:
    wait_for(lambda: world.state("canned") == "failed" and world.state("pruned") == "failed", 240)
    # The referee (one thread) scores the audits below: the verified node's challenges, one every
    # 0.3 s, kept it busy past the minute they are given on a loaded machine (2026-12-07).
    world.conn.execute("update platform_settings set challenge_verified_s = 3600")
    sdk = openai.OpenAI(base_url=f"{world.gateway}/v1", api_key=world.key, max_retries=3, timeout=60)
    colour: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]
    for _ in range(3):  # whole answers and streams
        whole = sdk.chat.completions.with_raw_response.create(
            model=SMOLLM2, messages=colour, max_tokens=4, temperature=0
        )
        assert whole.headers["x-neuralgrid-node"] == str(world.nodes["honest"])
        streamed = sdk.chat.completions.with_raw_response.create(
            model=SMOLLM2, messages=colour, max_tokens=4, temperature=0, stream=True
        )
        assert streamed.headers["x-neuralgrid-node"] == str(world.nodes["honest"])
        assert "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
    rows = world.conn.execute(
        "select n.name, count(*) filter (where e.forfeited_at is null), count(*) filter (where e.forfeited_at is not null)"
        " from earnings e join nodes n on n.id = e.node_id group by n.name"
    ).fetchall()
    earned = {name: (kept, lost) for name, kept, lost in rows}
    assert earned["honest"][0] > 0 and earned["honest"][1] == 0  # its challenges paid, nothing lost
    for cheat in ("pruned", "canned"):  # paid for what they answered, then forfeited all of it
        assert earned[cheat][0] == 0 and earned[cheat][1] > 0, (cheat, earned)
    metrics = httpx.get(f"{world.gateway}/metrics", timeout=10).text
    assert 'neuralgrid_model_checks{state="failed"} 2.0' in metrics
    assert 'neuralgrid_challenges_total{verdict="failed"}' in metrics
    # Each greedy answer above, whole or streamed, was audited after it was delivered
    # (NEURALGRID_AUDIT_SHARE=1): scored as a challenge, and passed.
    wait_for(
        lambda: 'verdict="audit passed"} 6.0' in httpx.get(f"{world.gateway}/metrics", timeout=10).text, 60
    )
