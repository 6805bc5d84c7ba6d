"""Pre-warm through the agent: the gateway's heartbeat reply asks a node to load a model, the agent has
its server load it where the server can (llama-cpp-python serving several models, llama.cpp's router,
Ollama), refuses with a reason where it cannot (a server of one model), and says so in its next
heartbeat.

Real servers where they run here (tests/agent/servers.py); Ollama, which cannot, through answers
recorded from its source (tests/data/ollama_prewarm.json)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest
import respx

from neuralgrid.agent.backend import ONE_MODEL, Backend
from neuralgrid.agent.run import Agent, AgentConfig
from tests.agent.servers import SMOLLM2, RealServer, built, real_server
from tests.conftest import free_port, node_row, running_agent, wait_for

SECOND = "acme/smol-second"  # a second model on the same servers: SmolLM2 again, under another name
DATA = Path(__file__).parents[1] / "data"
OLLAMA = json.loads((DATA / "recorded_backends.json").read_text())["ollama"]["responses"]
OLLAMA_LOADS = json.loads((DATA / "ollama_prewarm.json").read_text())


def two_model_server(kind: str, tmp_path: Path) -> tuple[RealServer, list[str]]:
    """A real server that serves SMOLLM2 and can load SECOND on demand, and the agent's flags for it:
    llama-cpp-python with a config file of two models (it holds one at a time), or llama-server in
    router mode over a folder of two (each loaded in a server of its own)."""
    root, port = built(), free_port()
    if kind == "llama-cpp-python":
        config = tmp_path / "models.json"
        models = [
            {"model": str(root / "model.gguf"), "model_alias": alias, "n_ctx": 2048, "n_threads": 2}
            for alias in (SMOLLM2, SECOND)
        ]
        config.write_text(json.dumps({"host": "127.0.0.1", "port": port, "models": models}))
        args = [str(root / "venv" / "bin" / "python"), "-m", "llama_cpp.server", "--config_file", str(config)]
        return RealServer(kind, port, args, log=tmp_path / "server.log").start(), []
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("smol-a", "smol-b"):
        (folder / f"{name}.gguf").symlink_to(root / "model.gguf")
    args = [str(root / "bin" / "llama-server"), "--models-dir", str(folder), "--host", "127.0.0.1"]
    args += ["--port", str(port), "-c", "2048", "--threads", "2"]
    aliases = ["--model-alias", f"smol-a={SMOLLM2}", "--model-alias", f"smol-b={SECOND}"]
    return RealServer(kind, port, args, log=tmp_path / "server.log").start(), aliases


def states(conn: psycopg.Connection, node: UUID) -> dict[str, str]:
    rows = conn.execute("select model_id, state from node_models where node_id = %s", (node,)).fetchall()
    return dict(rows)


def outcomes(conn: psycopg.Connection, node: UUID) -> list[tuple[Any, ...]]:
    query = "select model_id, outcome, reason from prewarm_requests where node_id = %s order by id"
    return [tuple(r) for r in conn.execute(query, (node,)).fetchall()]


def refused_a_moment_ago(conn: psycopg.Connection, model: str) -> None:
    """A request for `model` in eu-west that found no node, recorded as the matcher records one."""
    conn.execute(
        "insert into jobs (model_id, policy, status, region, min_vram_gb, error, finished_at)"
        " values (%s, 'balanced', 'failed', 'eu-west', 1, %s, now())",
        (model, f"no capable node is online for {model}"),
    )


@pytest.mark.parametrize("kind", ["llama-cpp-python", "llama.cpp-router"])
def test_the_platform_asks_and_the_node_warms_a_second_model(
    kind: str, conn: psycopg.Connection, platform: str, operator_key: str, tmp_path: Path
) -> None:
    conn.execute("update platform_settings set prewarm_refresh_s = 0")
    server, aliases = two_model_server(kind, tmp_path)
    try:
        with running_agent(conn, platform, operator_key, server.url, "box", 24, *aliases) as agent:
            node = node_row(conn, "box")[0]
            # Warm on what the server holds; the second model available: it can load it, has not.
            wait_for(lambda: states(conn, node) == {SMOLLM2: "loaded", SECOND: "available"}, timeout=20)
            refused_a_moment_ago(conn, SECOND)
            wait_for(lambda: outcomes(conn, node) == [(SECOND, "loaded", None)], timeout=90)
            # llama-cpp-python let the first model go for the second; the router holds both.
            first = "available" if kind == "llama-cpp-python" else "loaded"
            wait_for(lambda: states(conn, node) == {SMOLLM2: first, SECOND: "loaded"}, timeout=20)
            # The next request for it is placed warm, and answered.
            answer = httpx.post(
                f"{platform}/v1/chat/completions",
                json={"model": SECOND, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                headers={"authorization": f"Bearer {operator_key}"},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            placed = conn.execute("select node_id, cold_start from jobs where status <> 'failed'").fetchall()
            assert placed == [(node, False)]
            assert agent.poll() is None
    finally:
        server.kill()


def test_a_server_of_one_model_is_never_held_to_serve_another(
    conn: psycopg.Connection, platform: str, operator_key: str, tmp_path: Path
) -> None:
    """A model a one-model server served once (its owner has since swapped the file) used to stay
    'available': the matcher sent it that model's requests, which the server answered with the
    other, and pre-warm asked it to load one it cannot (a refusal each time). Its agent says it can
    load nothing else, so such a row is forgotten at its next beat, and nothing is asked of it."""
    conn.execute("update platform_settings set prewarm_refresh_s = 0")
    server = real_server("llama.cpp", free_port(), tmp_path / "llama.log", alias=SMOLLM2).start()
    try:
        with running_agent(conn, platform, operator_key, server.url, "one"):
            node, registered = node_row(conn, "one")[0], node_row(conn, "one")[4]
            # After a beat the gateway has answered: an agent tells what its server can load only to a
            # gateway it has heard take pre-warm (at registration, its node's other rows went).
            # Beats come every 5 s; a CI run on a loaded machine once saw none within 15 s of a real
            # llama-server's registration (its probes answer slowly under load).
            wait_for(lambda: node_row(conn, "one")[4] > registered, timeout=30)
            conn.execute(
                "insert into node_models (node_id, model_id, state) values (%s, %s, 'available')",
                (node, SECOND),
            )
            refused_a_moment_ago(conn, SECOND)
            held = "select model_id from node_models where node_id = %s"
            wait_for(lambda: conn.execute(held, (node,)).fetchall() == [(SMOLLM2,)], timeout=10)
            assert node_row(conn, "one")[1] == "online" and outcomes(conn, node) == []
    finally:
        server.kill()


# Ollama: recorded answers ---------------------------------------------------------------------------


def ollama(base: str, generate: dict[str, Any]) -> respx.Route:
    """Ollama at `base` as recorded, whose /api/ps lists the second model once `generate` (a
    recorded answer to POST /api/generate) has loaded it. Returns the generate route."""
    for route in ("GET /api/version", "GET /api/tags", "GET /v1/models"):
        respx.get(base + route.split(" ")[1]).respond(OLLAMA[route]["status"], json=OLLAMA[route]["json"])
    loads = respx.post(base + "/api/generate", json=generate["request"]).respond(
        generate["status"], json=generate["json"]
    )
    after = OLLAMA_LOADS["GET /api/ps (after the load)"]["json"]
    respx.get(base + "/api/ps").mock(
        side_effect=lambda _: httpx.Response(
            200,
            json=after if loads.call_count and generate["status"] == 200 else OLLAMA["GET /api/ps"]["json"],
        )
    )
    respx.route(host=base.split("//")[1].split(":")[0]).respond(404, text="404 page not found")
    return loads


@respx.mock
async def test_ollama_loads_a_model_it_has_when_asked() -> None:
    loads = ollama("http://gpu:11434", OLLAMA_LOADS["POST /api/generate (loads)"])
    backend = Backend("http://gpu:11434")
    try:
        assert (await backend.detect()).kind == "ollama"
        await backend.models()
        assert await backend.model_states() == (["llama3.2:latest"], ["qwen2.5:7b"])
        assert await backend.load("llama3.2:latest") is None and not loads.called  # loaded already
        assert await backend.load("mistral:7b") == "the server does not have this model"
        assert await backend.load("qwen2.5:7b") is None
        assert loads.call_count == 1 and json.loads(loads.calls[0].request.content) == {"model": "qwen2.5:7b"}
        assert await backend.model_states() == (["llama3.2:latest", "qwen2.5:7b"], [])
    finally:
        await backend.aclose()


@respx.mock
async def test_ollama_refusing_a_load_is_reported_with_its_reason() -> None:
    ollama("http://gpu:11434", OLLAMA_LOADS["POST /api/generate (too big)"])
    backend = Backend("http://gpu:11434")
    try:
        await backend.detect()
        await backend.models()
        assert await backend.load("qwen2.5:7b") == (
            "the server did not load it: HTTP 500 model requires more system memory (5.5 GiB) than is"
            " available (3.1 GiB)"
        )
        assert await backend.model_states() == (["llama3.2:latest"], ["qwen2.5:7b"])
    finally:
        await backend.aclose()


@respx.mock
async def test_servers_of_one_model_cannot_load_another() -> None:
    respx.get("http://vllm:8000/version").respond(200, json={"version": "0.33.0"})
    respx.get("http://vllm:8000/v1/models").respond(200, json={"data": [{"id": "a"}]})
    respx.route(host="vllm").respond(404, json={"detail": "Not Found"})
    backend = Backend("http://vllm:8000")
    try:
        assert (await backend.detect()).kind == "vllm"
        await backend.models()
        assert await backend.model_states() is None
        assert await backend.load("b") == ONE_MODEL
    finally:
        await backend.aclose()


# The agent: one load at a time, never in the heartbeat's way, each answered once -------------------


async def test_a_load_runs_as_one_task_and_is_answered_once() -> None:
    config = AgentConfig("http://gateway:1", "token", "http://gpu:1", "box", "eu-west", 0.3)
    agent = Agent(config)
    asked: list[str] = []
    release = asyncio.Event()

    async def load(model: str) -> str | None:
        asked.append(model)
        await release.wait()  # a model that takes its time to load
        return None if model == "m" else "the server does not have this model"

    agent.backend.load = load  # type: ignore[method-assign]
    try:
        agent._prewarm(["m"], [])
        agent._prewarm(["m"], [])  # the next reply says it again while it loads: not started twice
        await asyncio.sleep(0)
        assert asked == ["m"] and agent._loading is not None and not agent._loading.done()
        release.set()
        await agent._loading
        assert agent._loaded == ["m"]
        agent._prewarm(["m"], [])  # said again before the answer reached the platform
        assert asked == ["m"]
        agent._prewarm(["x"], [])
        assert agent._loading is not None
        await agent._loading
        assert agent._refused == [{"model": "x", "reason": "the server does not have this model"}]
        agent._prewarm(["warm"], ["warm"])  # already loaded: answered without asking the server
        assert asked == ["m", "x"] and agent._loaded == ["m", "warm"]
    finally:
        await agent.backend.aclose()


# The heartbeat's new fields, through the gateway --------------------------------------------------


def test_the_heartbeat_reply_carries_the_load_and_new_fields_are_checked(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    conn.execute("update platform_settings set prewarm_refresh_s = 0")
    spec = {
        "name": "box",
        "gpu_model": "NVIDIA GeForce RTX 4090",
        "vram_gb": 24,
        "tflops": 165,
        "hourly_rate": 0.3,
        "region": "eu-west",
        "endpoint_url": "http://127.0.0.1:9",
        "models": [SMOLLM2],
    }
    node = httpx.post(f"{gateway}/v1/nodes", json=spec, headers={"authorization": f"Bearer {api_key}"}).json()
    url, auth = (
        f"{gateway}/v1/nodes/{node['node_id']}/heartbeat",
        {"authorization": f"Bearer {node['node_secret']}"},
    )

    def beat(**body: Any) -> httpx.Response:
        return httpx.post(url, json={"models": [SMOLLM2], **body}, headers=auth)

    # An agent from before pre-warm sends none of the new fields, and gets `load` it may ignore.
    assert beat().json() == {"node_id": node["node_id"], "status": "online", "load": []}
    assert beat(available=[SECOND]).json()["load"] == []  # no demand yet
    refused_a_moment_ago(conn, SECOND)
    # A beat that repeats the last is answered at once with what the last flush said (issue 41): the
    # flush after the demand asks for the load, and the next reply carries it.
    assert wait_for(lambda: beat(available=[SECOND]).json()["load"] == [SECOND], timeout=5)
    for bad in (
        {"available": ["m"] * 1001},
        {"loaded": ["m"] * 17},
        {"refused": [{"model": SECOND}]},
        {"refused": [{"model": SECOND, "reason": "x" * 201}]},
        {"refused": [{"model": SECOND, "reason": "line\nbreak"}]},
        {"refused": [{"model": SECOND, "reason": "why", "extra": 1}]},
    ):
        refused = beat(**bad)
        assert refused.status_code == 400, bad
    assert beat(refused=[{"model": SECOND, "reason": ONE_MODEL}]).json()["load"] == []
    row = conn.execute("select outcome, reason from prewarm_requests").fetchall()
    assert row == [("refused", ONE_MODEL)]
