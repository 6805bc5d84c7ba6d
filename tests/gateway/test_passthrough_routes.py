"""The routes beyond chat, each passed to a node that serves it, through the same pipeline as chat
(admission, limits, failover, metering, job records), with the official SDK as the client.

Rerank, score and audio come from servers replaying recorded answers in vLLM's and llama.cpp's
shapes (tests/gateway/replay.py); the Responses API from the fake node here, and from the real
llama-server behind an agent in tests/agent/test_routes.py."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psycopg
import pytest

from neuralgrid.server.serving import ThreadedServer
from tests.conftest import LLAMA8, make_node, wait_for
from tests.gateway.replay import RECORDED, recorded, replay_app

RERANKER = "BAAI/bge-reranker-v2-m3"
WHISPER = "openai/whisper-large-v3"
TTS = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
RERANK = RECORDED["vllm-reranker"]["responses"]["POST /v1/rerank"]["request"]
SCORE = RECORDED["vllm-reranker"]["responses"]["POST /v1/score"]["request"]
AUDIO = b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00\x80\x3e\x00\x00\x00\x7d\x00\x00\x02\x00\x10\x00data\x00\x00\x00\x00\xff\xfe"
RESPONSES = ("chat/completions", "completions", "responses")


@pytest.fixture
def replay(conn: psycopg.Connection) -> Iterator[Any]:
    """Factory: a replayed server (its recording's name) registered as an online node holding its
    model and serving its recorded routes."""
    started: list[ThreadedServer] = []

    def start(server: str, name: str | None = None, **fields: Any) -> tuple[ThreadedServer, uuid.UUID]:
        app = ThreadedServer(replay_app(server)).start()
        started.append(app)
        recording = RECORDED[server]
        fields.setdefault("routes", recording["routes"])
        node = make_node(conn, name, models={recording["model"]: "loaded"}, endpoint_url=app.url, **fields)
        return app, node

    yield start
    for app in started:
        app.stop()


def post(gateway: str, key: str, path: str, headers: Any = None, **kwargs: Any) -> httpx.Response:
    sent = {**dict(headers or {}), "authorization": f"Bearer {key}"}
    return httpx.post(f"{gateway}/v1{path}", headers=sent, timeout=20, **kwargs)


def last_job(conn: psycopg.Connection) -> tuple[Any, ...]:
    row = wait_for(
        lambda: conn.execute(
            "select status, prompt_tokens, completion_tokens, cost_usd::float8, node_id from jobs"
            " where status <> 'running' order by created_at desc limit 1"
        ).fetchone()
    )
    return tuple(row)


# The Responses API ------------------------------------------------------------------------------


def test_a_response_is_the_nodes_own_and_is_billed_from_its_usage(
    conn: psycopg.Connection, client: openai.OpenAI, fake_nodes: Any
) -> None:
    node = fake_nodes(routes=RESPONSES)
    raw = client.responses.with_raw_response.create(model=LLAMA8, input="Say hello", max_output_tokens=7)
    answer = raw.parse()
    assert raw.headers["x-neuralgrid-node"] == str(node.node_id)
    assert answer.output_text and answer.usage is not None and answer.usage.output_tokens == 7
    assert node.server.app.state.last_body["max_output_tokens"] == 7  # the Responses API's own field
    status, prompt, completion, cost, _ = last_job(conn)
    assert (status, prompt, completion) == (
        "succeeded",
        answer.usage.input_tokens,
        answer.usage.output_tokens,
    )
    assert cost == pytest.approx((prompt * 0.05 + completion * 0.10) / 1e6)  # the catalog's LLAMA8 prices


def test_a_streamed_response_ends_with_response_completed_and_is_billed_from_it(
    conn: psycopg.Connection, client: openai.OpenAI, fake_nodes: Any
) -> None:
    fake_nodes(routes=RESPONSES)
    with client.responses.create(model=LLAMA8, input="Say hello", max_output_tokens=5, stream=True) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 5
    usage = events[-1].response.usage  # type: ignore[union-attr]
    assert usage is not None
    status, prompt, completion, _, _ = last_job(conn)
    assert (status, prompt, completion) == ("succeeded", usage.input_tokens, usage.output_tokens)


def test_a_response_stream_a_node_drops_ends_with_the_responses_apis_error_event(
    conn: psycopg.Connection, client: openai.OpenAI, fake_nodes: Any
) -> None:
    """No node goes on with it (Responses streams are not resumed): the SDK sees an `error` event, the
    only way the Responses API ends a stream that failed, and the job is the node's failure."""
    node = fake_nodes(routes=RESPONSES, drop_after_chunks=2)  # after 2 of its 5 text deltas
    with client.responses.create(model=LLAMA8, input="Say hello", max_output_tokens=5, stream=True) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds.count("response.output_text.delta") == 2
    assert kinds[-1] == "error"
    assert events[-1].code == "upstream_dropped"  # type: ignore[union-attr]
    assert "dropped the stream" in events[-1].message  # type: ignore[union-attr]
    status, _, completion, _, node_id = last_job(conn)
    assert (status, completion, node_id) == ("failed", 2, node.node_id)


def test_a_budget_caps_a_response_by_its_own_field(
    conn: psycopg.Connection, gateway: str, fake_nodes: Any
) -> None:
    node = fake_nodes(routes=RESPONSES)
    key = conn.execute("select api_key from create_api_key('capped', null, null, 0.0001)").fetchone()
    assert key is not None
    resp = post(
        gateway, key[0], "/responses", json={"model": LLAMA8, "input": "Say hello", "max_output_tokens": 5000}
    )
    assert resp.status_code == 200, resp.text
    # $0.0001 pays for about 1,000 tokens of LLAMA8's answer at $0.10 per million: the node was told.
    assert node.server.app.state.last_body["max_output_tokens"] < 1000
    assert "max_tokens" not in node.server.app.state.last_body


# Rerank and score --------------------------------------------------------------------------------


@pytest.mark.parametrize("server", ["vllm-reranker", "llama.cpp-reranker"])
def test_rerank_is_the_nodes_answer_in_its_own_shape_and_metered(
    server: str, conn: psycopg.Connection, gateway: str, api_key: str, replay: Any
) -> None:
    app, node = replay(server)
    resp = post(gateway, api_key, "/rerank", json=RERANK)
    assert resp.status_code == 200, resp.text
    assert resp.json() == recorded(server, "POST /v1/rerank")
    assert resp.headers["x-neuralgrid-node"] == str(node)
    assert [json.loads(seen.body) for seen in app.app.state.seen] == [RERANK]
    usage = resp.json()["usage"]
    assert last_job(conn)[:3] == ("succeeded", usage["prompt_tokens"], 0)
    # The official SDK has no rerank method: its generic post, as vLLM's docs show.
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=api_key, max_retries=0) as sdk:
        ranked = sdk.post("/rerank", body=RERANK, cast_to=httpx.Response)
    assert ranked.json() == recorded(server, "POST /v1/rerank")


def test_score_is_the_nodes_answer_and_metered(
    conn: psycopg.Connection, client: openai.OpenAI, replay: Any
) -> None:
    replay("vllm-reranker")
    answer = client.post("/score", body=SCORE, cast_to=httpx.Response)
    assert answer.json() == recorded("vllm-reranker", "POST /v1/score")
    assert last_job(conn)[:3] == ("succeeded", answer.json()["usage"]["prompt_tokens"], 0)


# Audio ------------------------------------------------------------------------------------------


def test_a_transcription_passes_the_upload_to_the_node_unchanged(
    conn: psycopg.Connection, client: openai.OpenAI, gateway: str, api_key: str, replay: Any
) -> None:
    app, node = replay("vllm-whisper")
    text = client.audio.transcriptions.create(model=WHISPER, file=("hello.wav", AUDIO, "audio/wav"))
    assert text.text == recorded("vllm-whisper", "POST /v1/audio/transcriptions")["text"]
    # The very bytes the client sent, boundary and all.
    upload = httpx.Request(
        "POST", "http://x", files={"file": ("hello.wav", AUDIO, "audio/wav")}, data={"model": WHISPER}
    )
    body = upload.read()
    # Translations by raw HTTP: the official SDK marks audio.translations.create deprecated.
    resp = post(
        gateway,
        api_key,
        "/audio/translations",
        content=body,
        headers={"content-type": upload.headers["content-type"]},
    )
    assert resp.status_code == 200 and resp.json() == recorded("vllm-whisper", "POST /v1/audio/translations")
    seen = app.app.state.seen[-1]
    assert (seen.path, seen.content_type, seen.body) == (
        "/v1/audio/translations",
        upload.headers["content-type"],
        body,
    )
    assert last_job(conn)[0] == "succeeded" and last_job(conn)[4] == node


def test_speech_is_the_nodes_audio_with_its_content_type(
    conn: psycopg.Connection, client: openai.OpenAI, replay: Any
) -> None:
    replay("vllm-omni-tts")
    audio = client.audio.speech.with_raw_response.create(model=TTS, input="Hello, grid!", voice="vivian")
    assert audio.headers["content-type"] == "audio/wav"
    assert audio.content == recorded("vllm-omni-tts", "POST /v1/audio/speech")
    assert last_job(conn)[:3] == ("succeeded", 0, 0)


# Models -----------------------------------------------------------------------------------------


def test_the_sdk_retrieves_a_model_with_the_routes_its_nodes_serve(
    client: openai.OpenAI, fake_nodes: Any, replay: Any
) -> None:
    fake_nodes(routes=RESPONSES)
    replay("vllm-reranker")
    llama = client.models.retrieve(LLAMA8)
    assert (llama.id, llama.object) == (LLAMA8, "model")
    extra = llama.model_extra or {}
    assert (extra["online_nodes"], extra["in_catalog"], extra["kind"]) == (1, True, "chat")
    assert extra["routes"] == ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    reranker = client.models.retrieve(RERANKER).model_extra or {}
    assert (reranker["in_catalog"], reranker["kind"], reranker["routes"]) == (
        False,
        None,
        ["/v1/rerank", "/v1/score"],
    )
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such/model")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


def test_a_model_lists_only_the_routes_its_kind_is_served_on(client: openai.OpenAI, fake_nodes: Any) -> None:
    """A chat model on a server that also answers /v1/embeddings: the gateway refuses embeddings of a
    chat model, so retrieving the model does not offer them."""
    fake_nodes()  # chat, completions and embeddings, as vLLM serves them
    routes = (client.models.retrieve(LLAMA8).model_extra or {})["routes"]
    assert routes == ["/v1/chat/completions", "/v1/completions"]
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=LLAMA8, input="hello")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such/model")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


# Bad input --------------------------------------------------------------------------------------


def form(*, file: bool = True, **fields: str) -> tuple[bytes, str]:
    """A multipart/form-data body (with or without the file) and its content type."""
    parts: list[tuple[str, tuple[str | None, bytes | str, str | None]]] = [
        (name, (None, value, None)) for name, value in fields.items()
    ]
    if file:
        parts.append(("file", ("a.wav", AUDIO, "audio/wav")))
    request = httpx.Request("POST", "http://x", files=parts)
    return request.read(), request.headers["content-type"]


BAD_JSON: list[tuple[str, dict[str, Any], str | None]] = [
    ("/responses", {"input": "hi"}, "model"),
    ("/responses", {"model": 7, "input": "hi"}, "model"),
    ("/responses", {"model": LLAMA8}, "input"),
    ("/responses", {"model": LLAMA8, "input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
    (
        "/responses",
        {"model": LLAMA8, "input": "hi", "previous_response_id": "resp_1"},
        "previous_response_id",
    ),
    ("/rerank", {"model": RERANKER, "query": "q"}, "documents"),
    ("/rerank", {"model": RERANKER, "query": "q", "documents": []}, "documents"),
    ("/rerank", {"model": RERANKER, "query": 3, "documents": ["d"]}, "query"),
    ("/score", {"model": RERANKER, "text_1": "a"}, None),
    ("/audio/speech", {"model": TTS}, "input"),
    ("/audio/speech", {"model": TTS, "input": "hi", "stream_format": "sse"}, "stream_format"),
    ("/audio/speech", {"model": TTS, "input": "hi", "speed": 9}, "speed"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_JSON)
def test_bad_json_is_an_openai_shaped_400_that_no_node_sees(
    path: str, body: dict[str, Any], param: str | None, gateway: str, api_key: str, replay: Any
) -> None:
    app, _ = replay("vllm-reranker")
    resp = post(gateway, api_key, path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param) and error["message"]
    assert "Value error" not in error["message"], "a validator's own words, without pydantic's prefix"
    assert app.app.state.seen == []


@pytest.mark.parametrize(
    ("upload", "param", "says"),
    [
        (form(file=False, model=WHISPER), "file", "no `file`"),
        (form(model=""), "model", "model"),
        (form(), "model", "model"),
        (form(model=WHISPER, stream="true"), "stream", "stream"),
        (form(model=WHISPER, response_format="mp3"), "response_format", "response_format"),
        ((json.dumps({"model": WHISPER}).encode(), "application/json"), "file", "multipart/form-data"),
        ((b"--x\r\nnot a form", "multipart/form-data"), "file", "malformed"),
    ],
)
def test_a_bad_upload_is_an_openai_shaped_400_that_no_node_sees(
    upload: tuple[bytes, str], param: str, says: str, gateway: str, api_key: str, replay: Any
) -> None:
    app, _ = replay("vllm-whisper")
    body, content_type = upload
    resp = httpx.post(
        f"{gateway}/v1/audio/transcriptions",
        content=body,
        headers={"authorization": f"Bearer {api_key}", "content-type": content_type},
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert app.app.state.seen == []


@pytest.mark.parametrize("path", ["/audio/transcriptions", "/responses", "/rerank"])
def test_a_body_over_the_limit_is_a_413(path: str, gateway: str, api_key: str, replay: Any) -> None:
    app, _ = replay("vllm-whisper")
    big = b"x" * (1_048_576 + 1)
    resp = post(
        gateway, api_key, path, content=big, headers={"content-type": "multipart/form-data; boundary=x"}
    )
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert app.app.state.seen == []


def test_a_catalog_model_is_served_only_on_the_routes_of_its_kind(
    conn: psycopg.Connection, gateway: str, api_key: str, replay: Any
) -> None:
    conn.execute(
        "insert into models (id, min_vram_gb, context_length, kind) values (%s, 2, 8192, 'rerank'),"
        " ('an/embedder', 2, 8192, 'embedding')",
        (RERANKER,),
    )
    replay("vllm-reranker", routes=["chat/completions", "rerank", "score"])
    chat = {"model": RERANKER, "messages": [{"role": "user", "content": "hi"}]}
    error = post(gateway, api_key, "/chat/completions", json=chat).json()["error"]
    assert (
        error["param"] == "model"
        and "is a rerank model: it does not serve /v1/chat/completions" in error["message"]
    )
    assert post(gateway, api_key, "/rerank", json=RERANK).status_code == 200
    embed = {**chat, "model": "an/embedder"}
    error = post(gateway, api_key, "/chat/completions", json=embed).json()["error"]
    assert "is an embedding model: it does not serve" in error["message"]  # not "a embedding"


# Routing ----------------------------------------------------------------------------------------


def test_a_route_no_online_node_serves_is_said_apart_from_a_busy_fleet(
    conn: psycopg.Connection, gateway: str, api_key: str, fake_nodes: Any, replay: Any
) -> None:
    fake_nodes(models={RERANKER: "loaded"})  # holds the model, serves chat, completions, embeddings
    resp = post(gateway, api_key, "/rerank", json=RERANK)
    error = resp.json()["error"]
    assert (resp.status_code, error["code"], resp.headers["x-should-retry"]) == (
        503,
        "route_not_served",
        "false",
    )
    assert error["message"] == f"no online node serves /v1/rerank for {RERANKER}"
    # A node that serves it, but full: the request waits for its slot, and is told the fleet is busy.
    _, node = replay("vllm-reranker", max_concurrency=1, inflight=1)
    started = time.monotonic()
    busy = post(gateway, api_key, "/rerank", json=RERANK)
    assert (busy.status_code, busy.json()["error"]["code"]) == (503, "no_capacity")
    assert time.monotonic() - started >= 0.5  # it waited in line (the queue's deadline)
    conn.execute("update nodes set inflight = 0 where id = %s", (node,))
    assert post(gateway, api_key, "/rerank", json=RERANK).status_code == 200


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    """A short queue deadline, so that a busy fleet answers within the test."""
    return {
        "NEURALGRID_KEY_CACHE_TTL_S": 30,
        "NEURALGRID_FIRST_BYTE_TIMEOUT_S": 5,
        "NEURALGRID_QUEUE_TIMEOUT_S": 0.5,
    }


def test_a_rerank_goes_only_to_the_node_serving_it_and_chat_to_the_other(
    gateway: str, api_key: str, fake_nodes: Any, replay: Any
) -> None:
    chat_node = fake_nodes(
        "chat-node", models={RERANKER: "loaded"}, hourly_rate=0.01
    )  # cheaper: ranked first
    _, reranker = replay("vllm-reranker", "rerank-node", hourly_rate=3)
    for _ in range(6):
        assert post(gateway, api_key, "/rerank", json=RERANK).headers["x-neuralgrid-node"] == str(reranker)
    chat = {"model": RERANKER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(3):
        assert post(gateway, api_key, "/chat/completions", json=chat).headers["x-neuralgrid-node"] == str(
            chat_node.node_id
        )
