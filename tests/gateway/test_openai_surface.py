"""What a client of OpenAI's API expects of the gateway beyond the answers: a spent budget that the
SDK does not retry, x-ratelimit-* headers, OpenAI-shaped 404s and 405s, streams no proxy buffers."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import httpx
import openai
import psycopg
import pytest
from fastapi import FastAPI
from openai.types.chat import ChatCompletionMessageParam

from neuralgrid.server.serving import ThreadedServer
from tests.conftest import LLAMA8, make_node, stream_chat, wait_for

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello to the grid."}]
EMBEDDER = "BAAI/bge-large-en-v1.5"


def new_key(
    conn: psycopg.Connection, rpm: int | None = None, tpm: int | None = None, budget: float | None = None
) -> str:
    row = conn.execute(
        "select api_key from create_api_key('surface', %s, %s, %s::numeric)", (rpm, tpm, budget)
    ).fetchone()
    assert row is not None
    return str(row[0])


def seconds(duration: str) -> float:
    """OpenAI's reset headers: Go durations such as 6m0s, 59.5s or 17ms."""
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?(?:(\d+)ms)?", duration)
    assert match and duration, duration
    minutes, secs, millis = match.groups()
    return int(minutes or 0) * 60 + float(secs or 0) + int(millis or 0) / 1000


def is_openai_error(resp: httpx.Response | Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# A spent budget ----------------------------------------------------------------------------------


def test_a_spent_budget_fails_at_once_with_the_sdks_default_retries(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str
) -> None:
    """insufficient_quota, as OpenAI answers it: a Retry-After would have the SDK wait and ask again
    (twice, by default) for a budget that does not come back."""
    fake_nodes()
    key = new_key(conn, budget=0)
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, timeout=20) as sdk:
        assert sdk.max_retries == 2  # the SDK's default
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.chat.completions.create(model=LLAMA8, messages=MESSAGES, max_tokens=5)
        assert time.monotonic() - started < 2
    err = refused.value
    assert err.code == "insufficient_quota" and err.type == "insufficient_quota"
    assert err.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in err.response.headers
    assert conn.execute("select count(*) from jobs").fetchone() == (0,)


# x-ratelimit-* -----------------------------------------------------------------------------------


def test_answers_tell_the_keys_rate_limits_as_openai_does(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str
) -> None:
    fake_nodes(max_concurrency=16)
    key = new_key(conn, rpm=3, tpm=10_000)
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=20) as sdk:
        raw = sdk.chat.completions.with_raw_response.create(model=LLAMA8, messages=MESSAGES, max_tokens=50)
    assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    # The window is back to its initial state once this request has left it: a minute from now.
    assert 59 <= seconds(raw.headers["x-ratelimit-reset-requests"]) <= 60
    assert raw.headers["x-ratelimit-limit-tokens"] == "10000"
    held = 10_000 - int(raw.headers["x-ratelimit-remaining-tokens"])
    assert 50 < held < 100  # the estimate: the body at four bytes a token and max_tokens
    assert 59 <= seconds(raw.headers["x-ratelimit-reset-tokens"]) <= 60

    # A stream carries them too.
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 5, "stream": True}
    with stream_chat(gateway, key, body) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-ratelimit-remaining-requests"] == "1"
        assert int(resp.headers["x-ratelimit-remaining-tokens"]) < 10_000 - held
        assert resp.read().endswith(b"data: [DONE]\n\n")


def test_refusals_after_admission_tell_the_keys_limits_too(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str
) -> None:
    """A spent budget (429) and a fleet with no node for the model (503) are refused after the key's
    limits admitted the request: their answers carry x-ratelimit-* as a served answer does."""
    fake_nodes(max_concurrency=16)
    url, body = f"{gateway}/v1/chat/completions", {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 2}
    spent = {"authorization": f"Bearer {new_key(conn, rpm=5, budget=0)}"}
    refused = httpx.post(url, json=body, headers=spent, timeout=20)
    assert is_openai_error(refused, 429)["code"] == "insufficient_quota"
    assert refused.headers["x-ratelimit-limit-requests"] == "5"
    assert refused.headers["x-ratelimit-remaining-requests"] == "4"
    conn.execute("update nodes set status = 'offline'")
    # Placed in SQL (a price cap under every lease's node), which knows at once that none is online.
    limited = {"authorization": f"Bearer {new_key(conn, rpm=5)}", "x-neuralgrid-max-price": "0.01"}
    none_online = httpx.post(url, json=body, headers=limited, timeout=20)
    assert none_online.status_code == 503, none_online.text
    assert none_online.headers["x-ratelimit-remaining-requests"] == "4"


def test_a_rate_limited_request_tells_the_limits_it_hit(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str
) -> None:
    fake_nodes(max_concurrency=16)
    key = new_key(conn, rpm=2)
    url, auth = f"{gateway}/v1/chat/completions", {"authorization": f"Bearer {key}"}
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 2}
    first = httpx.post(url, json=body, headers=auth, timeout=20)
    assert httpx.post(url, json=body, headers=auth, timeout=20).status_code == 200
    refused = httpx.post(url, json=body, headers=auth, timeout=20)
    assert is_openai_error(refused, 429)["code"] == "rate_limit_exceeded"
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # Room again when the first leaves the minute (Retry-After); empty when the second does.
    assert 55 <= int(refused.headers["retry-after"]) <= 60
    assert 55 < seconds(refused.headers["x-ratelimit-reset-requests"]) <= 60
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    # A key without a tpm limit is told nothing about tokens.
    assert not any(h.endswith("-tokens") for h in refused.headers if h.startswith("x-ratelimit"))

    tokens = new_key(conn, tpm=100)
    alone = httpx.post(url, json={**body, "max_tokens": 60}, headers={"authorization": f"Bearer {tokens}"})
    assert alone.status_code == 200 and "x-ratelimit-limit-requests" not in alone.headers
    sdk = openai.OpenAI(base_url=f"{gateway}/v1", api_key=tokens, max_retries=0, timeout=20)
    with sdk, pytest.raises(openai.RateLimitError) as limited:
        sdk.chat.completions.with_raw_response.create(model=LLAMA8, messages=MESSAGES, max_tokens=60)
    headers = limited.value.response.headers
    assert headers["x-ratelimit-limit-tokens"] == "100" and int(headers["x-ratelimit-remaining-tokens"]) <= 40
    assert 55 < seconds(headers["x-ratelimit-reset-tokens"]) <= 60


def test_a_key_without_limits_gets_no_rate_limit_headers(
    fake_nodes: Any, client: openai.OpenAI, gateway: str, api_key: str
) -> None:
    fake_nodes()
    raw = client.chat.completions.with_raw_response.create(model=LLAMA8, messages=MESSAGES, max_tokens=2)
    assert not [h for h in raw.headers if h.startswith("x-ratelimit")]
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 2, "stream": True}
    with stream_chat(gateway, api_key, body) as resp:
        assert resp.status_code == 200 and not [h for h in resp.headers if h.startswith("x-ratelimit")]


# 404 and 405 -------------------------------------------------------------------------------------


def test_every_404_and_405_is_openai_shaped(gateway: str, api_key: str, client: openai.OpenAI) -> None:
    auth = {"authorization": f"Bearer {api_key}"}
    assert is_openai_error(httpx.get(f"{gateway}/v1/no/such/thing", headers=auth), 404)["code"] == "not_found"
    assert is_openai_error(httpx.get(f"{gateway}/nothing-here"), 404)["code"] == "not_found"
    wrong = httpx.get(f"{gateway}/v1/chat/completions", headers=auth)
    assert is_openai_error(wrong, 405)["code"] == "method_not_allowed" and wrong.headers["allow"] == "POST"
    is_openai_error(httpx.delete(f"{gateway}/v1/models", headers=auth), 405)
    # A trailing slash is another path, not a redirect with no body (Starlette's default).
    assert is_openai_error(httpx.delete(f"{gateway}/v1/keys/", headers=auth), 404)["code"] == "not_found"
    assert is_openai_error(httpx.post(f"{gateway}/v1/chat/completions/", headers=auth), 404)
    with pytest.raises(openai.NotFoundError) as missing:
        client.files.list()  # a route the gateway does not have
    assert missing.value.code == "not_found"
    # A known route's 404 names what was not found: not a model here.
    beat = httpx.post(f"{gateway}/v1/nodes/{uuid.uuid4()}/heartbeat", json={"models": []}, headers=auth)
    error = is_openai_error(beat, 404)
    assert (error["param"], error["code"]) == ("node_id", "not_found")
    garbled = httpx.post(f"{gateway}/v1/nodes/not-a-node/heartbeat", json={}, headers=auth)
    assert is_openai_error(garbled, 400)["param"] == "path.node_id"  # as a query's are "query.days"
    # The web pages are still pages.
    page = httpx.get(f"{gateway}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    is_openai_error(httpx.get(f"{gateway}/static/no-such-file.js"), 404)


def test_a_nodes_404_or_405_reaches_the_client_openai_shaped(
    conn: psycopg.Connection, client: openai.OpenAI, gateway: str, api_key: str
) -> None:
    """A server without a route (FastAPI's {"detail": ...}) or taking another method there: the
    client's error is OpenAI's shape all the same, plain or streamed."""
    server = FastAPI()

    @server.get("/v1/completions")
    async def get_only() -> dict[str, str]:
        return {}

    with ThreadedServer(server) as node:
        make_node(conn, "routeless", endpoint_url=node.url, models={LLAMA8: "loaded", EMBEDDER: "loaded"})
        with pytest.raises(openai.NotFoundError) as missing:
            client.embeddings.create(model=EMBEDDER, input="hello")
        assert missing.value.response.json()["error"]["message"] == "the node answered: Not Found"
        with pytest.raises(openai.APIStatusError) as wrong:
            client.completions.create(model=LLAMA8, prompt="Once", max_tokens=2)
        assert wrong.value.status_code == 405
        is_openai_error(wrong.value.response, 405)
        body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 2, "stream": True}
        with stream_chat(gateway, api_key, body) as resp:
            resp.read()
            is_openai_error(resp, 404)


def test_a_prompt_past_the_nodes_context_is_openais_context_length_exceeded(
    fake_nodes: Any, client: openai.OpenAI
) -> None:
    """llama-server's refusal reached the client with its own type (`exceed_context_size_error`) and
    advice for the server's owner ("try increasing it"), a new user's trial found: OpenAI's SDKs
    and clients read `context_length_exceeded`."""
    fake_nodes(context_length=64)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=LLAMA8, messages=[{"role": "user", "content": "word " * 500}], max_tokens=4
        )
    error = refused.value.response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        None,
    )
    assert (
        error["message"].startswith("request (")
        and "exceeds the available context size (64 tokens)" in error["message"]
    )
    assert "increasing" not in error["message"]


# Streams -----------------------------------------------------------------------------------------


def test_streams_tell_proxies_not_to_buffer_or_cache(fake_nodes: Any, gateway: str, api_key: str) -> None:
    fake_nodes()
    body = {"model": LLAMA8, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with stream_chat(gateway, api_key, body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        assert resp.headers["x-accel-buffering"] == "no"


def test_the_user_field_is_recorded_and_usage_tells_end_users_apart(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str
) -> None:
    fake_nodes()
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=api_key, max_retries=0) as sdk:
        for user in ("alice", "alice", "bob", None):
            sdk.chat.completions.create(
                model=LLAMA8, messages=MESSAGES, max_tokens=4, user=user or openai.omit
            )
        streamed = sdk.chat.completions.create(
            model=LLAMA8,
            messages=MESSAGES,
            max_tokens=4,
            user="bob",
            stream=True,
            stream_options={"include_usage": True},
        )
        assert [chunk for chunk in streamed]
    # Jobs served from leases are written behind: in the ledger moments after their answers.
    ended = "select end_user, count(*) from jobs where status <> 'running' group by 1 order by 1 nulls last"
    wait_for(lambda: conn.execute(ended).fetchall() == [("alice", 2), ("bob", 2), (None, 1)])
    auth = {"authorization": f"Bearer {api_key}"}
    per_user = {
        user: httpx.get(f"{gateway}/v1/usage", params={"user": user}, headers=auth).json()
        for user in ("alice", "bob", "nobody")
    }
    assert [(u["user"], u["requests"], u["completion_tokens"]) for u in per_user.values()] == [
        ("alice", 2, 8),
        ("bob", 2, 8),
        ("nobody", 0, 0),
    ]
    assert httpx.get(f"{gateway}/v1/usage", headers=auth).json()["requests"] == 5


@pytest.mark.parametrize("user", ["x" * 257, "line\nbreak", "nul\x00"])
def test_a_user_field_that_is_not_one_short_line_is_a_400(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str, user: str
) -> None:
    fake_nodes()
    body = {"model": LLAMA8, "messages": MESSAGES, "user": user}
    resp = httpx.post(
        f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {api_key}"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "user", resp.text
    usage = httpx.get(
        f"{gateway}/v1/usage", params={"user": user}, headers={"authorization": f"Bearer {api_key}"}
    )
    assert usage.status_code == 400 and "error" in usage.json(), usage.text
    assert conn.execute("select count(*) from jobs").fetchone() == (0,)
