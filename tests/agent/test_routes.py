"""The routes a node serves: what the agent finds its server serves (real llama-server and
llama-cpp-python, recorded vLLM, SGLang, Ollama and TGI), the owner's override, the front passing
exactly those on, and requests through gateway, agent and server on each route: the Responses API
on the real llama-server, rerank and audio on servers replaying recorded answers."""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import openai
import psycopg
import pytest
import respx

from neuralgrid.agent.backend import Backend
from neuralgrid.agent.front import FrontState, create_front
from neuralgrid.dev.fakenode import FakeNodeConfig, create_fake_node
from neuralgrid.protocol import signing
from neuralgrid.protocol.routes import DEFAULT_ROUTES, ECHO
from neuralgrid.server.app import create_app
from neuralgrid.server.serving import ThreadedServer
from neuralgrid.server.settings import Settings
from tests.agent.servers import SMOLLM2, real_server
from tests.agent.test_backends import a_stack
from tests.conftest import agent_command, agent_log, free_port, wait_for
from tests.gateway.replay import RECORDED, recorded, replay_app

OLDER = json.loads((Path(__file__).parents[1] / "data" / "recorded_backends.json").read_text())
RERANKER = "BAAI/bge-reranker-v2-m3"
KEY = signing.node_key("ngn-test-secret")
LLAMA_CPP = ("chat/completions", "completions", "responses")


# What the agent finds -----------------------------------------------------------------------------


async def routes_found(url: str) -> tuple[str, ...]:
    backend = Backend(url)
    try:
        await backend.detect()
        info, warm = await backend.verify(await backend.models())
        assert warm, "the model answered no warm-up"
        assert info.routes is not None
        return info.routes
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("kind", "flags", "routes"),
    [
        ("llama.cpp", [], LLAMA_CPP),
        # Embeddings need --embeddings and a pooling model: SmolLM2's own pooling is none (HTTP 400).
        ("llama.cpp", ["--embeddings"], LLAMA_CPP),
        ("llama.cpp", ["--embeddings", "--pooling", "mean"], (*LLAMA_CPP[:2], "embeddings", "responses")),
        # Its OpenAPI document lists /v1/embeddings, which a model not loaded for them fails.
        ("llama-cpp-python", [], ("chat/completions", "completions")),
    ],
)
async def test_the_agent_finds_what_a_real_server_serves(
    kind: str, flags: list[str], routes: tuple[str, ...], tmp_path: Path
) -> None:
    server = real_server(kind, free_port(), tmp_path / "server.log")
    server.args += flags
    server.start()
    try:
        assert await routes_found(server.url) == routes
    finally:
        server.kill()


def mock_recorded(base: str, responses: dict[str, Any]) -> None:
    """Each recorded GET and POST answered as recorded; every other path a FastAPI 404."""
    for route, answer in responses.items():
        method, path = route.split(" ", 1)
        if "json" in answer:
            respx.request(method, base + path.split(" (")[0]).respond(answer["status"], json=answer["json"])
        elif "base64" in answer:
            content = base64.b64decode(answer["base64"])
            respx.request(method, base + path).respond(answer["status"], content=content)
        else:
            respx.request(method, base + path).respond(answer["status"], text=answer.get("text", ""))
    respx.route(host=base.split("//")[1].split(":")[0]).respond(404, json={"detail": "Not Found"})


async def detected(base: str, version: str | None = None) -> tuple[str, tuple[str, ...]]:
    """The kind the agent finds at `base`, and the routes it finds that kind serves."""
    backend = Backend(base)
    try:
        info = await backend.detect()
        version = version or info.version
        return info.kind, await backend.kind.routes(backend, backend.identity, version, None)
    finally:
        await backend.aclose()


@pytest.mark.parametrize("server", [name for name in RECORDED if not name.startswith("_")])
@respx.mock
async def test_the_agent_finds_what_recorded_servers_serve(server: str) -> None:
    """vLLM lists what its model's tasks allow (a cross-encoder: rerank and score, Whisper: audio,
    a chat model: chat, completions, responses); llama.cpp with --reranking answers rerank."""
    mock_recorded("http://gpu:8000", RECORDED[server]["responses"])
    kind, routes = await detected("http://gpu:8000")
    assert (kind, routes) == (server.split("-")[0], tuple(RECORDED[server]["routes"]))


@pytest.mark.parametrize(
    ("server", "version", "routes"),
    [
        ("ollama", None, (*DEFAULT_ROUTES, "responses")),  # v0.33.0-rc2: /v1/responses since v0.13.3
        ("ollama", "0.13.2", DEFAULT_ROUTES),
        ("tgi", None, ("chat/completions", "completions")),  # no embeddings: TGI generates only
        ("sglang", None, DEFAULT_ROUTES),  # its recorded OpenAPI document lists no route: as before
    ],
)
@respx.mock
async def test_the_agent_knows_what_other_servers_serve(
    server: str, version: str | None, routes: tuple[str, ...]
) -> None:
    mock_recorded("http://gpu:8000", OLDER[server]["responses"])
    assert await detected("http://gpu:8000", version) == (server, routes)


@respx.mock
async def test_the_owners_routes_replace_what_the_agent_would_find() -> None:
    mock_recorded("http://gpu:8000", RECORDED["vllm-reranker"]["responses"])
    backend = Backend("http://gpu:8000", routes=("rerank",))
    try:
        await backend.detect()
        info, warm = await backend.verify(await backend.models())
    finally:
        await backend.aclose()
    assert (info.routes, warm) == (("rerank",), [RERANKER])
    # No route probed: the warm-up alone, on the one route the owner named.
    posts = [call.request.url.path for call in respx.calls if call.request.method == "POST"]
    assert [path for path in posts if path.startswith("/v1/")] == ["/v1/rerank"]


def test_the_routes_option_is_checked_in_one_line() -> None:
    args = agent_command("http://127.0.0.1:9", "ng-x", "http://127.0.0.1:9", "--routes", "responses,teleport")
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: --routes: 'teleport' is not a route a node can serve; known: chat/completions, completions,"
        " embeddings, responses, rerank, score, audio/transcriptions, audio/translations, audio/speech"
    ]
    helped = subprocess.run([*args[:5], "--help"], capture_output=True, text=True, timeout=60)
    assert "NEURALGRID_NODE_ROUTES" in helped.stdout


# The front: exactly the advertised routes -----------------------------------------------------------


def test_the_front_passes_on_the_advertised_routes_and_nothing_else() -> None:
    config = FakeNodeConfig(models=(RERANKER,), routes=("chat/completions", "responses"))
    with ThreadedServer(create_fake_node(config)) as server:
        front = FrontState(Backend(server.url), key=KEY)
        front.backend.info = dataclasses.replace(front.backend.info, routes=config.routes)
        with ThreadedServer(create_front(front)) as agent:
            for path, status in [
                ("/v1/responses", 200),
                ("/v1/chat/completions", 200),
                ("/v1/embeddings", 404),  # served by the server, not advertised: never reaches it
                ("/v1/rerank", 404),
                ("/v1/models", 404),
            ]:
                body = json.dumps(
                    {"model": RERANKER, "input": "hi", "messages": [{"role": "user", "content": "hi"}]}
                )
                headers = {
                    signing.HEADER: signing.sign(KEY, path, body.encode()),
                    "content-type": "application/json",
                }
                resp = httpx.post(agent.url + path, content=body, headers=headers)
                assert resp.status_code == status, (path, resp.text)
                if status == 404:
                    assert "does not serve" in resp.json()["error"]["message"]
            assert server.app.state.requests == 2
            # A content type that is no header value never reaches the server either.
            empty = b"{}"
            odd = {
                signing.HEADER.encode(): signing.sign(KEY, "/v1/responses", empty).encode(),
                b"content-type": b"a\xe9b",
            }
            assert httpx.post(agent.url + "/v1/responses", content=empty, headers=odd).status_code == 400


# Through gateway, agent and server ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "tunnel"])
def test_the_responses_api_on_the_real_llama_server_is_billed_from_its_usage(
    mode: str, pg_server: Any, template_db: str, tmp_path: Path
) -> None:
    with a_stack(pg_server, template_db, tmp_path, "llama.cpp", mode) as stack:
        assert stack.node("routes") == (list(LLAMA_CPP),)
        with stack.sdk() as sdk:
            stack.settle()
            answer = sdk.responses.create(
                model=SMOLLM2, input="Say hello", max_output_tokens=8, temperature=0
            )
            assert answer.output_text and answer.model == SMOLLM2  # never the owner's file path
            assert answer.usage is not None
            used = (answer.usage.input_tokens, answer.usage.output_tokens)
            assert wait_for(lambda: stack.jobs()[-1][0] != "running") and stack.jobs()[-1][:3] == (
                "succeeded",
                *used,
            )
            stack.settle()
            with sdk.responses.create(
                model=SMOLLM2, input="Count to five", max_output_tokens=6, stream=True
            ) as events:
                seen = list(events)
        kinds = [event.type for event in seen]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        usage = seen[-1].response.usage  # type: ignore[union-attr]
        # A delta may carry several tokens, or none show (CI saw 6 tokens in 2 deltas): the bill is
        # the server's usage, never a count of deltas.
        assert usage is not None and 1 <= kinds.count("response.output_text.delta") <= usage.output_tokens
        wait_for(lambda: len(stack.jobs()) == 2 and stack.jobs()[-1][0] != "running")
        status, prompt, completion, cost, _ = stack.jobs()[-1]
        assert (status, prompt, completion) == ("succeeded", usage.input_tokens, usage.output_tokens)
        assert cost == pytest.approx(
            (prompt * 0.01 + completion * 0.02) / 1e6
        )  # the catalog's SmolLM2 prices


@dataclasses.dataclass
class Joined:
    node_id: UUID
    server: ThreadedServer


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=60)


@contextmanager
def agents(
    conn: psycopg.Connection, gateway: str, key: str, servers: dict[str, tuple[Any, list[str]]]
) -> Iterator[dict[str, Joined]]:
    """A server (a Starlette app) and an agent in front of it for each name, once all are online."""
    with ExitStack() as cleanup:
        joined: dict[str, Joined] = {}
        for name, (app, flags) in servers.items():
            server = cleanup.enter_context(ThreadedServer(app))
            log = agent_log(name)
            base = f"--name {name} --region eu-west --price 0.3 --vram-gb 24 --tflops 165".split()
            args = agent_command(gateway, key, server.url, *base, "--listen-port", str(free_port()), *flags)
            with log.open("wb") as out:
                process = subprocess.Popen(args, stdout=out, stderr=out)
            cleanup.callback(_stop, process)
            try:
                row = wait_for(
                    lambda n=name: conn.execute(
                        "select id from nodes where name = %s and status = 'online'", (n,)
                    ).fetchone(),
                    timeout=60,
                )
            except AssertionError:
                raise AssertionError(f"{name} did not join: {log.read_text()[-3000:]}") from None
            joined[name] = Joined(row[0], server)
        yield joined


def test_a_rerank_reaches_only_the_node_whose_agent_found_it(
    conn: psycopg.Connection, platform: str, operator_key: str
) -> None:
    servers = {
        "reranker": (replay_app("vllm-reranker"), []),
        "chatter": (create_fake_node(FakeNodeConfig(models=(RERANKER,))), ["--tunnel"]),
        "narrowed": (replay_app("vllm-reranker"), ["--routes", "rerank"]),  # the owner's choice: no score
    }
    with agents(conn, platform, operator_key, servers) as joined:
        routes: dict[str, list[str]] = dict(conn.execute("select name, routes from nodes").fetchall())
        assert routes == {
            "reranker": ["rerank", "score"],
            "chatter": [*DEFAULT_ROUTES, ECHO],  # the fake echoes a completion's prompt
            "narrowed": ["rerank"],
        }
        request = RECORDED["vllm-reranker"]["responses"]["POST /v1/rerank"]["request"]
        with openai.OpenAI(base_url=f"{platform}/v1", api_key=operator_key, max_retries=0) as sdk:
            placed = set()
            for _ in range(6):
                raw = sdk.post("/rerank", body=request, cast_to=httpx.Response)
                assert raw.json() == recorded("vllm-reranker", "POST /v1/rerank")
                placed.add(UUID(raw.headers["x-neuralgrid-node"]))
                wait_for(
                    lambda: (
                        conn.execute("select count(*) from jobs where status = 'running'").fetchone() == (0,)
                    )
                )
            assert placed <= {joined["reranker"].node_id, joined["narrowed"].node_id} and placed
            scored = sdk.post(
                "/score", body={"model": RERANKER, "text_1": "a", "text_2": ["b"]}, cast_to=httpx.Response
            )
            assert scored.headers["x-neuralgrid-node"] == str(joined["reranker"].node_id)
            chat = sdk.chat.completions.with_raw_response.create(
                model=RERANKER, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert chat.headers["x-neuralgrid-node"] == str(joined["chatter"].node_id)
        # The warm-up and the platform's requests: only on the routes each node advertises.
        for name, served in (("reranker", {"/v1/rerank", "/v1/score"}), ("narrowed", {"/v1/rerank"})):
            paths = {seen.path for seen in joined[name].server.app.state.seen}
            assert {path for path in paths if path.startswith("/v1/")} <= served


def test_audio_crosses_a_tunnel_byte_for_byte(
    conn: psycopg.Connection, platform: str, operator_key: str
) -> None:
    servers = {
        "whisper": (replay_app("vllm-whisper"), ["--tunnel"]),
        "voice": (replay_app("vllm-omni-tts"), ["--tunnel"]),
    }
    audio = bytes(range(256)) * 64  # every byte value: no text encoding survives it by accident
    with agents(conn, platform, operator_key, servers) as joined:
        with openai.OpenAI(base_url=f"{platform}/v1", api_key=operator_key, max_retries=0) as sdk:
            text = sdk.audio.transcriptions.create(
                model="openai/whisper-large-v3", file=("a.wav", audio, "audio/wav")
            )
            speech = sdk.audio.speech.with_raw_response.create(
                model="Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", input="Hello", voice="vivian"
            )
        assert text.text == recorded("vllm-whisper", "POST /v1/audio/transcriptions")["text"]
        upload = joined["whisper"].server.app.state.seen[-1]
        assert upload.content_type.startswith("multipart/form-data; boundary=") and audio in upload.body
        assert speech.headers["content-type"] == "audio/wav"
        assert speech.content == recorded("vllm-omni-tts", "POST /v1/audio/speech")


def test_audio_crosses_from_a_gateway_that_forwards_to_the_one_holding_the_tunnel(
    conn: psycopg.Connection, db_url: str, operator_key: str
) -> None:
    """Gateway C has no tunnel: it forwards to B, which holds it (gateway/forward.py), the upload's
    content type signed with it."""
    conn.execute("update platform_settings set heartbeat_interval_s = 0.3")
    common: dict[str, Any] = {"NEURALGRID_JWT_SECRET": "routes-test-secret-0123456789abcdef-0123"}
    with ExitStack() as stack:
        urls = []
        for sweep in (True, False):
            port = free_port()
            settings = Settings(**common, NEURALGRID_PORT=port, NEURALGRID_SWEEP_INTERVAL_S=0.1)
            urls.append(
                stack.enter_context(ThreadedServer(create_app(settings, db_url, sweep=sweep), port=port)).url
            )
        holder, other = urls
        servers = {
            "whisper": (replay_app("vllm-whisper"), ["--tunnel"]),
            "voice": (replay_app("vllm-omni-tts"), ["--tunnel"]),
        }
        audio = bytes(range(256)) * 64
        with agents(conn, holder, operator_key, servers) as joined:
            with openai.OpenAI(base_url=f"{other}/v1", api_key=operator_key, max_retries=0) as sdk:
                text = sdk.audio.transcriptions.create(
                    model="openai/whisper-large-v3", file=("a.wav", audio, "audio/wav")
                )
                speech = sdk.audio.speech.create(
                    model="Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", input="Hi", voice="x"
                )
            assert text.text == recorded("vllm-whisper", "POST /v1/audio/transcriptions")["text"]
            upload = joined["whisper"].server.app.state.seen[-1]
            assert upload.content_type.startswith("multipart/form-data; boundary=") and audio in upload.body
            assert speech.content == recorded("vllm-omni-tts", "POST /v1/audio/speech")
