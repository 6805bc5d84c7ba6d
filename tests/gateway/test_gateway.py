"""The gateway end to end: the official openai SDK -> gateway -> fake GPU nodes, metered in Postgres."""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from typing import Any

import httpx
import openai
import psycopg
import pytest
from openai.types.chat import ChatCompletionMessageParam
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from neuralgrid.server.serving import ThreadedServer
from tests.conftest import LLAMA8, free_port, make_node, stream_chat, wait_for
from tests.slots import JOB_SLOTS, written_behind

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello to the grid."}]


def chat(gateway: str, api_key: str, stream: bool = False) -> httpx.Response:
    """A short chat request, as it is: whatever the gateway answers."""
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 3, "stream": stream}
    headers = {"authorization": f"Bearer {api_key}"}
    return httpx.post(f"{gateway}/v1/chat/completions", headers=headers, json=body, timeout=20)


def job_rows(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    return conn.execute(
        "select status, attempts, prompt_tokens, completion_tokens, cost_usd::float8, error from jobs order by created_at"
    ).fetchall()


def test_chat_completion_is_routed_metered_and_explained(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI
) -> None:
    node = fake_nodes("node-a")
    raw = client.chat.completions.with_raw_response.create(model=LLAMA8, messages=MESSAGES, max_tokens=7)
    reply = raw.parse()
    assert reply.choices[0].message.content and reply.usage is not None
    assert reply.usage.completion_tokens == 7
    assert raw.headers["x-neuralgrid-node"] == str(node.node_id)
    assert raw.headers["x-neuralgrid-attempts"] == "1"
    assert float(raw.headers["x-neuralgrid-overhead-ms"]) >= 0
    rows = wait_for(lambda: [r for r in job_rows(conn) if r[0] == "succeeded"])
    status, attempts, prompt, completion, cost, error = rows[0]
    assert (status, attempts, prompt, completion, error) == (
        "succeeded",
        1,
        reply.usage.prompt_tokens,
        7,
        None,
    )
    assert cost == pytest.approx((prompt * 0.05 + 7 * 0.10) / 1e6)
    assert conn.execute(f"select {JOB_SLOTS}, successes from nodes n").fetchone() == (0, 1)


def test_completions_and_embeddings(conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI) -> None:
    fake_nodes(models={LLAMA8: "loaded", "BAAI/bge-large-en-v1.5": "loaded"})
    text = client.completions.create(model=LLAMA8, prompt="Once upon a time", max_tokens=4)
    assert text.choices[0].text and text.usage is not None and text.usage.completion_tokens == 4
    vectors = client.embeddings.create(model="BAAI/bge-large-en-v1.5", input=["one", "two"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 16
    wait_for(lambda: len([r for r in job_rows(conn) if r[0] == "succeeded"]) == 2)


def test_models_lists_catalog_and_served_models(fake_nodes: Any, client: openai.OpenAI) -> None:
    fake_nodes(models={"ollama/llama3:8b": "loaded"})
    ids = {m.id for m in client.models.list()}
    assert {"ollama/llama3:8b", LLAMA8, "BAAI/bge-large-en-v1.5"} <= ids


def test_models_say_since_when_they_are_served(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI
) -> None:
    fake_nodes(models={"ollama/llama3:8b": "loaded"})
    created = {m.id: m.created for m in client.models.list()}
    [catalog] = conn.execute(
        "select floor(extract(epoch from created_at))::bigint from models where id = %s", (LLAMA8,)
    ).fetchone() or [None]
    [registered] = conn.execute(
        "select floor(extract(epoch from min(n.created_at)))::bigint from nodes n"
        " join node_models nm on nm.node_id = n.id where nm.model_id = 'ollama/llama3:8b'"
    ).fetchone() or [None]
    # The catalog's when it is listed there, else when its first holder registered: never 0.
    assert created[LLAMA8] == catalog and created["ollama/llama3:8b"] == registered
    assert client.models.retrieve(LLAMA8).created == catalog > 0


def test_streaming_passes_chunks_through_and_meters(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI
) -> None:
    fake_nodes(tokens_per_s=200)
    stream = client.chat.completions.create(
        model=LLAMA8, messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    content = [c.choices[0].delta.content for c in chunks if c.choices]
    assert len(content) == 6 and all(content)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # Without include_usage the client gets no usage chunk, but the job is metered all the same.
    plain = list(client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=5, stream=True))
    assert all(c.choices for c in plain) and len(plain) == 5
    rows = wait_for(
        lambda: (
            [r for r in job_rows(conn) if r[0] == "succeeded"]
            if len(job_rows(conn)) == 2 and all(r[0] == "succeeded" for r in job_rows(conn))
            else None
        )
    )
    assert [r[3] for r in rows] == [6, 5]


def test_a_stream_read_to_done_is_a_success_however_late_the_node_hangs_up(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str
) -> None:
    """The client reads [DONE] and leaves at once, while the node (or the tunnel's end frame) is
    still to close the stream: the answer was whole, so the job succeeded; it was not cancelled."""
    fake_nodes(linger_after_done_s=2.0)
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with stream_chat(gateway, api_key, body) as resp:
        assert next(line for line in resp.iter_lines() if line == "data: [DONE]")
    status = wait_for(
        lambda: conn.execute("select status from jobs where status <> 'running'").fetchone(), 1.5
    )
    assert status == ("succeeded",)


def test_streaming_arrives_chunk_by_chunk(fake_nodes: Any, gateway: str, api_key: str) -> None:
    fake_nodes(tokens_per_s=10)  # a chunk every 100 ms
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 5, "stream": True}
    arrivals = []
    with stream_chat(gateway, api_key, body, timeout=10) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(arrivals) == 5 and min(gaps) > 0.05  # not buffered into one burst


def test_failover_when_the_first_node_refuses(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI
) -> None:
    dead = make_node(conn, "dead", vram_gb=24, endpoint_url=f"http://127.0.0.1:{free_port()}")
    alive = fake_nodes("alive", vram_gb=48)  # ranks second: less right-sized
    raw = client.chat.completions.with_raw_response.create(model=LLAMA8, messages=MESSAGES, max_tokens=3)
    assert raw.headers["x-neuralgrid-node"] == str(alive.node_id)
    assert raw.headers["x-neuralgrid-attempts"] == "2"
    failures, cooldown = conn.execute(
        "select failures, cooldown_until > now() from nodes where id = %s", (dead,)
    ).fetchone() or (0, False)
    assert failures == 1 and cooldown
    attempts = conn.execute("select node_id, status, error from job_attempts order by attempt").fetchall()
    assert attempts[0][0] == dead and attempts[0][1] == "failed"
    # What went wrong, never the node's address (an owner's IP and port, which no API role may read).
    assert attempts[0][2] == "could not connect: Connection refused"
    # The cooled-down node is avoided: the next request goes straight to the live one.
    again = client.chat.completions.with_raw_response.create(model=LLAMA8, messages=MESSAGES, max_tokens=3)
    assert again.headers["x-neuralgrid-attempts"] == "1"
    assert again.headers["x-neuralgrid-node"] == str(alive.node_id)


def test_a_nodes_redirect_is_not_followed(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI
) -> None:
    """A node must not be able to point the gateway at another address (an internal service)."""
    internal_hits: list[str] = []

    async def internal(request: Request) -> Response:
        internal_hits.append(request.url.path)
        return JSONResponse({"secret": True})

    async def redirect(request: Request) -> Response:
        return RedirectResponse(f"{inside.url}/metadata", status_code=307)

    with (
        ThreadedServer(
            Starlette(routes=[Route("/{path:path}", internal, methods=["GET", "POST"])])
        ) as inside,
        ThreadedServer(Starlette(routes=[Route("/{path:path}", redirect, methods=["POST"])])) as node,
    ):
        make_node(conn, "redirecting", vram_gb=24, endpoint_url=node.url)
        fine = fake_nodes("fine", vram_gb=48)  # ranks second: less right-sized
        raw = client.chat.completions.with_raw_response.create(model=LLAMA8, messages=MESSAGES, max_tokens=3)
    assert raw.headers["x-neuralgrid-node"] == str(fine.node_id) and internal_hits == []
    rows = conn.execute("select http_status from job_attempts where status = 'failed'").fetchall()
    assert rows == [(307,)]


@pytest.mark.parametrize("status", [500, 503, 429])
def test_failover_on_server_errors_and_throttling(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI, status: int
) -> None:
    broken = fake_nodes("broken", vram_gb=24, failure_rate=1.0, fail_status=status)
    fine = fake_nodes("fine", vram_gb=48)
    raw = client.chat.completions.with_raw_response.create(model=LLAMA8, messages=MESSAGES, max_tokens=3)
    assert raw.headers["x-neuralgrid-node"] == str(fine.node_id) and broken.requests == 1
    rows = conn.execute("select http_status from job_attempts where status = 'failed'").fetchall()
    assert rows == [(status,)]


def test_failover_of_a_stream_before_its_first_byte(fake_nodes: Any, client: openai.OpenAI) -> None:
    fake_nodes("broken", vram_gb=24, failure_rate=1.0)
    fake_nodes("fine", vram_gb=48)
    chunks = list(client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=4, stream=True))
    assert len(chunks) == 4


def test_a_stream_dropped_mid_way_ends_with_an_error_event(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str
) -> None:
    fake_nodes(drop_after_chunks=3)
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 10, "stream": True}
    with stream_chat(gateway, api_key, body, timeout=10) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert len(events) == 5 and events[-1] == "[DONE]"
    assert json.loads(events[3])["error"]["code"] == "upstream_dropped"
    row = wait_for(
        lambda: conn.execute(
            "select status, completion_tokens from jobs where status <> 'running'"
        ).fetchone()
    )
    assert row == ("failed", 3)


def _direct_answer(node: Any, path: str, body: dict[str, Any]) -> Any:
    """What a node answers when nothing breaks: the text a resumed stream must add up to."""
    resp = httpx.post(f"{node.server.url}{path}", json={**body, "stream": False}, timeout=10)
    resp.raise_for_status()
    return resp.json()["choices"][0]


def test_a_stream_dropped_mid_way_goes_on_on_another_node(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI
) -> None:
    flaky = fake_nodes("flaky", vram_gb=24, drop_after_chunks=4)  # ranks first: right-sized
    steady = fake_nodes("steady", vram_gb=48)
    body: dict[str, Any] = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 10}
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _direct_answer(steady, "/v1/chat/completions", body)["message"]["content"]
    assert len({c.id for c in chunks}) == 1  # one stream, as far as the client can tell
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10
    assert usage.prompt_tokens < 30  # the replayed text is not billed as prompt
    assert (flaky.requests, steady.requests) == (1, 2)  # the second: _direct_answer
    job = wait_for(
        lambda: conn.execute(
            "select status, attempts, completion_tokens, node_id, ttft_ms >= 0 and latency_ms >= ttft_ms"
            " from jobs where status <> 'running'"
        ).fetchone()
    )
    assert job == ("succeeded", 2, 10, steady.node_id, True)  # times: the node that finished
    attempts = conn.execute("select node_id, status, error from job_attempts order by attempt").fetchall()
    assert [(a[0], a[1]) for a in attempts] == [(flaky.node_id, "failed"), (steady.node_id, "succeeded")]
    assert "dropped the stream" in attempts[0][2]
    cooled = conn.execute(
        "select cooldown_until > now() from nodes where id = %s", (flaky.node_id,)
    ).fetchone()
    assert cooled == (True,)


def test_a_dropped_completion_stream_goes_on_with_the_prompt_plus_the_text_so_far(
    fake_nodes: Any, client: openai.OpenAI
) -> None:
    fake_nodes("flaky", vram_gb=24, drop_after_chunks=3)
    steady = fake_nodes("steady", vram_gb=48)
    body: dict[str, Any] = {"model": LLAMA8, "prompt": "Once upon a time", "max_tokens": 8}
    chunks = list(client.completions.create(**body, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _direct_answer(steady, "/v1/completions", body)["text"]


def test_a_resumed_stream_that_drops_again_with_no_node_left_ends_with_an_error_event(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str
) -> None:
    fake_nodes("first", vram_gb=24, drop_after_chunks=3)
    fake_nodes("second", vram_gb=48, drop_after_chunks=2)
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 10, "stream": True}
    with stream_chat(gateway, api_key, body, timeout=10) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert len(events) == 3 + 2 + 2 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "upstream_dropped"
    row = wait_for(
        lambda: conn.execute(
            "select status, attempts, completion_tokens from jobs where status <> 'running'"
        ).fetchone()
    )
    assert row == ("failed", 2, 5)  # what the client received from both nodes is metered
    statuses = conn.execute("select status from job_attempts order by attempt").fetchall()
    assert statuses == [("failed",), ("failed",)]


def test_a_resume_the_next_node_fails_ends_with_an_error_event_and_is_metered(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str
) -> None:
    fake_nodes("first", vram_gb=24, drop_after_chunks=3)
    second = fake_nodes("second", vram_gb=48, failure_rate=1.0)
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 10, "stream": True}
    with stream_chat(gateway, api_key, body, timeout=10) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert len(events) == 3 + 2 and json.loads(events[-2])["error"]["code"] == "upstream_dropped"
    row = wait_for(
        lambda: conn.execute(
            "select status, attempts, completion_tokens, ttft_ms >= 0 from jobs where status <> 'running'"
        ).fetchone()
    )
    assert row == ("failed", 2, 3, True) and second.requests == 1
    outcome = f'neuralgrid_node_outcomes_total{{node="{second.node_id}",outcome="failed"}}'
    lines = httpx.get(f"{gateway}/metrics").text.splitlines()
    assert [line.split()[-1] for line in lines if line.startswith(outcome)] == ["1.0"]  # counted once


@pytest.mark.parametrize("gateway_settings", [{"NEURALGRID_RESUME_STREAMS": False}])
def test_resuming_streams_can_be_turned_off(fake_nodes: Any, gateway: str, api_key: str) -> None:
    fake_nodes("flaky", vram_gb=24, drop_after_chunks=3)
    steady = fake_nodes("steady", vram_gb=48)
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 10, "stream": True}
    with stream_chat(gateway, api_key, body, timeout=10) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "upstream_dropped" and steady.requests == 0


def test_all_nodes_failing_is_a_502_and_a_failed_job(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI
) -> None:
    fake_nodes(failure_rate=1.0)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=LLAMA8, messages=MESSAGES)
    assert err.value.status_code == 502 and err.value.body["code"] == "upstream_failed"  # type: ignore[index]
    assert conn.execute("select status from jobs").fetchone() == ("failed",)


@pytest.mark.parametrize("status", [503, 502, 429])
def test_the_same_unavailable_answer_from_two_nodes_is_still_the_nodes_fault(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI, status: int
) -> None:
    """Draining, loading, unreachable or overloaded servers answer alike: that says nothing against
    the request (only the same 500 twice does, see test_backends.py)."""
    fake_nodes("a", failure_rate=1.0, fail_status=status)
    fake_nodes("b", failure_rate=1.0, fail_status=status)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=LLAMA8, messages=MESSAGES)
    assert err.value.status_code == 502
    assert conn.execute("select failures from nodes order by name").fetchall() == [(1,), (1,)]


@pytest.mark.parametrize("gateway_settings", [{"NEURALGRID_FIRST_BYTE_TIMEOUT_S": 0.3}])
def test_a_slow_node_times_out_with_504(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI
) -> None:
    """A whole answer of 5 tokens from a node measured at 100 a second is given 0.3 + 3 x 0.05 s."""
    node = fake_nodes(latency_s=2)
    conn.execute("update nodes set ewma_tokens_per_s = 100 where id = %s", (node.node_id,))
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=5)
    assert err.value.status_code == 504


def test_errors_are_openai_shaped(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str, client: openai.OpenAI
) -> None:
    auth = {"authorization": f"Bearer {api_key}"}
    url = f"{gateway}/v1/chat/completions"
    cases = [
        (httpx.post(url, content=b"{nope", headers=auth), 400),
        (httpx.post(url, json={"model": LLAMA8}, headers=auth), 400),
        (httpx.post(url, json={"model": LLAMA8, "messages": MESSAGES, "max_tokens": 0}, headers=auth), 400),
        (httpx.post(url, json={"model": LLAMA8, "messages": MESSAGES}), 401),
        (
            httpx.post(
                url, json={"model": LLAMA8, "messages": MESSAGES}, headers={"authorization": "Bearer ng-nope"}
            ),
            401,
        ),
        (httpx.post(url, json={"model": "no/such-model", "messages": MESSAGES}, headers=auth), 404),
        (httpx.post(url, content=b"x" * 2_000_000, headers=auth), 413),
        (httpx.post(url, json={"model": LLAMA8, "messages": MESSAGES}, headers=auth), 503),
        (
            httpx.post(
                url,
                json={"model": LLAMA8, "messages": MESSAGES},
                headers={**auth, "x-neuralgrid-max-price": "cheap"},
            ),
            400,
        ),
        (httpx.post(url, content=b'{"model": "m", "messages": [], "temperature": NaN}', headers=auth), 400),
        (
            httpx.post(
                url,
                json={"model": LLAMA8, "messages": MESSAGES},
                headers={**auth, "x-neuralgrid-max-price": "nan"},
            ),
            400,
        ),
    ]
    for resp, status in cases:
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert cases[5][0].json()["error"]["param"] == "model"
    assert cases[7][0].headers["retry-after"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no/such-model", messages=MESSAGES)
    # Bad requests store nothing but their own failed job (the 503): no node slot is left claimed.
    assert job_rows(conn) == [("failed", 0, 0, 0, 0.0, f"no capable node is online for {LLAMA8}")]


def test_a_price_cap_no_node_meets_and_a_key_that_is_not_bearer_say_so(
    fake_nodes: Any, gateway: str, api_key: str
) -> None:
    """Found as a new user: a cap below every node's price was "no capable node is online", read as
    the fleet down; `Authorization: Basic ...` was "missing API key", though a header was sent."""
    fake_nodes()  # some $0.3 an hour
    url = f"{gateway}/v1/chat/completions"
    body = {"model": LLAMA8, "messages": MESSAGES}
    capped = {"authorization": f"Bearer {api_key}", "x-neuralgrid-max-price": "0.01"}
    resp = httpx.post(url, json=body, headers=capped)
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == (
        f"no capable node is online for {LLAMA8} within the price cap of $0.01/h (x-neuralgrid-max-price)"
    )
    resp = httpx.post(url, json=body, headers={"authorization": "Basic YWxhZGRpbjpvcGVuc2VzYW1l"})
    assert resp.status_code == 401
    assert resp.json()["error"]["message"].startswith("the Authorization header is not a bearer key")
    assert "YWxh" not in resp.text


def test_revoked_keys_are_refused(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI, api_key: str
) -> None:
    fake_nodes()
    client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=2)  # now cached
    conn.execute("update api_keys set revoked_at = now()")

    def refused() -> bool:
        try:
            client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=2)
        except openai.AuthenticationError:
            return True
        return False

    started = time.monotonic()
    wait_for(refused, timeout=2)
    assert time.monotonic() - started < 1.0


def test_rate_limit_per_key(conn: psycopg.Connection, fake_nodes: Any, gateway: str) -> None:
    fake_nodes(max_concurrency=64)
    key = (conn.execute("select api_key from create_api_key('limited', 3)").fetchone() or ("",))[0]
    limited = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)
    for _ in range(3):
        limited.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        limited.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=1)
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_usage_endpoint_reports_the_keys_totals(
    conn: psycopg.Connection, fake_nodes: Any, client: openai.OpenAI, gateway: str, api_key: str
) -> None:
    fake_nodes(context_length=100)
    for _ in range(3):
        client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.BadRequestError):  # the node refuses it: a request, ended cancelled
        client.chat.completions.create(model=LLAMA8, messages=[{"role": "user", "content": "hi " * 200}])
    written_behind(gateway)
    wait_for(
        lambda: conn.execute("select count(*) = 0 from jobs where status = 'running'").fetchone() == (True,)
    )
    usage = httpx.get(f"{gateway}/v1/usage", headers={"authorization": f"Bearer {api_key}"}).json()
    assert (usage["requests"], usage["succeeded"], usage["completion_tokens"]) == (4, 3, 12)
    # Every request is counted in one of its ends (found trying the API: 12 requests, 9 + 0 shown).
    assert (usage["failed"], usage["cancelled"], usage["running"]) == (0, 1, 0)
    assert usage["cost_usd"] == pytest.approx(usage["spent_usd"]) and usage["cost_usd"] > 0


def test_health_ready_metrics_and_docs(fake_nodes: Any, client: openai.OpenAI, gateway: str) -> None:
    fake_nodes()
    client.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=2)
    assert httpx.get(f"{gateway}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{gateway}/readyz").json() == {"status": "ready"}
    metrics = httpx.get(f"{gateway}/metrics").text
    for name in (
        "neuralgrid_requests_total",
        "neuralgrid_matcher_seconds",
        "neuralgrid_attempts_total",
        "neuralgrid_overhead_seconds",
        "neuralgrid_node_outcomes_total",
    ):
        assert name in metrics
    assert 'neuralgrid_attempts_total{outcome="succeeded"} 1.0' in metrics
    assert "/v1/chat/completions" in httpx.get(f"{gateway}/openapi.json").text


def test_metrics_label_routes_not_paths(fake_nodes: Any, gateway: str, api_key: str) -> None:
    """A scanner's random paths and every node's own URL count under a bounded set of route templates."""
    node = fake_nodes()
    with httpx.Client(base_url=gateway) as http:
        for i in range(300):
            http.get(f"/scan/{i}/wp-admin.php")
            http.post(f"/v1/nodes/{uuid.uuid4()}/heartbeat", json={})
        http.post(f"/v1/nodes/{node.node_id}/heartbeat", json={})
        metrics = http.get("/metrics").text
    endpoints = set(re.findall(r'neuralgrid_requests_total\{endpoint="([^"]*)"', metrics))
    assert endpoints == {"unmatched", "/v1/nodes/{node_id}/heartbeat"}, endpoints
    assert "wp-admin" not in metrics and str(node.node_id) not in metrics.split("neuralgrid_node_outcomes")[0]


def test_a_node_refusing_a_stream_passes_the_refusal_through_without_blame(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str
) -> None:
    node = fake_nodes(failure_rate=1.0, fail_status=400)  # the backend rejects a parameter
    body = {"model": LLAMA8, "messages": MESSAGES, "stream": True}
    resp = httpx.post(
        f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {api_key}"}
    )
    assert resp.status_code == 400 and "failed on purpose" in resp.json()["error"]["message"]
    row = wait_for(lambda: conn.execute("select status from jobs where status <> 'running'").fetchone())
    assert row == ("cancelled",)
    state = conn.execute(
        f"select {JOB_SLOTS}, failures, cooldown_until from nodes n where id = %s", (node.node_id,)
    )
    assert state.fetchone() == (0, 0, None)  # no cooldown for the client's mistake


def test_implausible_usage_from_a_node_is_not_believed() -> None:
    from neuralgrid.protocol.sse import Usage

    assert Usage.parse({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == Usage(3, 4)
    for bad in (-1, 10**12, [1], "7", 1.5, True):
        assert Usage.parse({"usage": {"prompt_tokens": bad, "completion_tokens": 1}}) is None


def test_an_answer_nested_too_deeply_to_read_still_ends_its_job(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """Nodes are not trusted: an answer Python's JSON reader cannot take (nested past its recursion
    limit) is passed on unread, with no usage, and its job ends: its slot free once its end is
    written (behind the answer: leases are on)."""
    deep = b'{"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    async def answer(request: Request) -> Response:
        return Response(deep, media_type="application/json")

    with ThreadedServer(Starlette(routes=[Route("/{path:path}", answer, methods=["POST"])])) as node:
        node_id = make_node(conn, "nested", vram_gb=24, endpoint_url=node.url)
        resp = chat(gateway, api_key)
        assert resp.status_code == 200 and resp.content == deep
        written_behind(gateway)
        row = conn.execute(f"select {JOB_SLOTS} from nodes n where id = %s", (node_id,)).fetchone()
        assert row == (0,)
    assert conn.execute("select status, completion_tokens from jobs").fetchall() == [("succeeded", 0)]


def test_a_stream_refused_by_the_node_has_its_slot_free_when_the_refusal_arrives(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """A 4xx the node answers a stream with is the client's (passed on), and its job ends as any
    answer's does: its slot free once its end is written (behind the answer: leases are on)."""

    async def refuse(request: Request) -> Response:
        return JSONResponse({"error": {"message": "bad request", "type": "invalid_request_error"}}, 400)

    with ThreadedServer(Starlette(routes=[Route("/{path:path}", refuse, methods=["POST"])])) as node:
        node_id = make_node(conn, "refusing", vram_gb=24, endpoint_url=node.url)
        for _ in range(5):
            resp = chat(gateway, api_key, stream=True)
            assert resp.status_code == 400
            written_behind(gateway)
            # The ending is handed to the journal just after the answer, by a task of its own: the
            # journal can be empty a moment before it comes (seen once in a clean clone's run).
            wait_for(
                lambda: (
                    conn.execute(f"select {JOB_SLOTS} from nodes n where id = %s", (node_id,)).fetchone()
                    == (0,)
                )
            )


def test_a_stream_event_nested_too_deeply_to_read_is_passed_on(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """An event the gateway cannot read (nested past Python's recursion limit) goes on as it came,
    counted as a token; the stream ends as it should and the job with it, succeeded."""
    deep = b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n"
    tail = [
        b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
        b"data: [DONE]\n\n",
    ]

    async def stream(request: Request) -> Response:
        return Response(deep + b"".join(tail), media_type="text/event-stream")

    with ThreadedServer(Starlette(routes=[Route("/{path:path}", stream, methods=["POST"])])) as node:
        make_node(conn, "nested", vram_gb=24, endpoint_url=node.url)
        resp = chat(gateway, api_key, stream=True)
    assert resp.status_code == 200 and resp.content.startswith(deep) and resp.content.endswith(tail[1])
    assert wait_for(lambda: conn.execute("select status from jobs").fetchall() == [("succeeded",)])


def test_an_answer_with_infinity_in_its_logprobs_is_metered(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """Python servers write -Infinity where a token's probability is zero (not standard JSON, but what
    they send): the answer's usage is still read and charged, plain and streamed."""
    choice = b'"logprobs": {"content": [{"token": "a", "logprob": -Infinity}]}'
    usage = b'"usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}'
    plain = (
        b'{"id": "x", "object": "chat.completion", "choices": [{"index": 0, '
        + choice
        + b', "message": {"role": "assistant", "content": "abc"}, "finish_reason": "stop"}], '
        + usage
        + b"}"
    )
    events = (
        b'data: {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, '
        + choice
        + b', "delta": {"content": "abc"}}]}\n\n'
        + b'data: {"id": "x", "object": "chat.completion.chunk", "choices": [], '
        + usage
        + b"}\n\n"
        + b"data: [DONE]\n\n"
    )

    async def answer(request: Request) -> Response:
        streamed = json.loads(await request.body()).get("stream")
        return (
            Response(events, media_type="text/event-stream")
            if streamed
            else Response(plain, media_type="application/json")
        )

    with ThreadedServer(Starlette(routes=[Route("/{path:path}", answer, methods=["POST"])])) as node:
        make_node(conn, "python", vram_gb=24, endpoint_url=node.url)
        for stream in (False, True):
            resp = chat(gateway, api_key, stream=stream)
            assert resp.status_code == 200
    assert wait_for(
        lambda: len(conn.execute("select 1 from jobs where status = 'succeeded'").fetchall()) == 2
    )
    assert conn.execute("select prompt_tokens, completion_tokens from jobs").fetchall() == [(5, 3), (5, 3)]
