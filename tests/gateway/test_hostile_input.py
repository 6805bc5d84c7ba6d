"""Hostile and malformed input: always an OpenAI-shaped 4xx, never a 500, never a node's fault, and
never a bound larger than the budget or the model allows."""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jwt
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from neuralgrid.server.serving import ThreadedServer
from tests.conftest import LLAMA8, make_node, make_user, wait_for
from tests.slots import metric

CHAT = {"model": LLAMA8, "messages": [{"role": "user", "content": "hi"}]}

# (what is wrong, body or raw text). Each must be refused with a 4xx and an OpenAI-shaped error.
HOSTILE: list[tuple[str, Any]] = [
    ("nested 100,000 deep", "[" * 100_000 + "]" * 100_000),
    ("nested object 50,000 deep", '{"a":' * 50_000 + "1" + "}" * 50_000),
    ("NUL in the model", {**CHAT, "model": "llama\u0000"}),
    ("a control character in the model", {**CHAT, "model": "llama\n"}),
    ("max_tokens 2^63", {**CHAT, "max_tokens": 2**63}),
    ("max_tokens beyond the context", {**CHAT, "max_tokens": 10_000_000}),
    ("max_tokens a string", {**CHAT, "max_tokens": "12"}),
    (
        "max_completion_tokens Infinity",
        json.dumps({**CHAT, "max_completion_tokens": "INF"}).replace('"INF"', "Infinity"),
    ),
    ("max_completion_tokens a float", {**CHAT, "max_completion_tokens": 1.5}),
    ("n a string", {**CHAT, "n": "2"}),
    ("n zero", {**CHAT, "n": 0}),
    ("n huge", {**CHAT, "n": 10**20}),
    ("seed beyond int64", {**CHAT, "seed": 2**64}),
    ("stream_options a list", {**CHAT, "stream": True, "stream_options": [1]}),
    ("stream a string", {**CHAT, "stream": "false"}),
    (
        "temperature NaN",
        json.dumps({**CHAT, "temperature": "NAN"}).replace('"NAN"', "NaN"),
    ),
    ("messages not a list", {**CHAT, "messages": "hi"}),
    # Servers' own names for the answer's length and count: generated, never billed.
    ("llama.cpp's n_predict", {**CHAT, "max_tokens": 5, "n_predict": 400}),
    ("llama.cpp's n_cmpl", {**CHAT, "n_cmpl": 8}),
    ("Ollama's num_predict", {**CHAT, "num_predict": 400}),
    ("TGI's max_new_tokens", {**CHAT, "max_new_tokens": 400}),
    ("llama.cpp's n_probs", {**CHAT, "max_tokens": 5, "n_probs": 100_000}),
    # A server's own settings (a chat_parser that refers to itself crashed a real llama-server).
    (
        "a chat_parser",
        {**CHAT, "chat_parser": '{"parsers":[{"type":"sequence","children":[0]}],"rules":{},"root":0}'},
    ),
    ("a chat_format", {**CHAT, "chat_format": 1}),
    ("a slot of the server's", {**CHAT, "id_slot": 0}),
    # Guided decoding past its bounds (deep groups crashed a real llama-server; long sampler lists
    # slowed every request on it).
    (
        "a grammar nested 150,000 deep",
        {**CHAT, "grammar": "root ::= " + "(" * 150_000 + '"a"' + ")" * 150_000},
    ),
    ("a grammar of 100 KiB", {**CHAT, "grammar": 'root ::= "' + "a" * 100_000 + '"'}),
    ("a grammar that is not text", {**CHAT, "grammar": ["root ::= 'a'"]}),
    ("200,000 samplers", {**CHAT, "samplers": "t" * 200_000}),
    ("a body that is a list", [CHAT]),
    ("not JSON", "{"),
    ("not UTF-8", b"\xff\xfe{}"),
]


@pytest.mark.parametrize(("case", "body"), HOSTILE, ids=[case for case, _ in HOSTILE])
def test_hostile_bodies_get_a_4xx_in_openais_shape(
    gateway: str, api_key: str, fake_nodes: Any, case: str, body: Any
) -> None:
    node = fake_nodes()
    content = (
        body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    )
    resp = httpx.post(
        f"{gateway}/v1/chat/completions",
        content=content,
        headers={"authorization": f"Bearer {api_key}", "content-type": "application/json"},
        timeout=30,
    )
    assert 400 <= resp.status_code < 500, (case, resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    assert error["message"] and error["type"], case
    assert node.requests == 0, case  # no node was troubled with it


@pytest.mark.parametrize("given", ["", [], [""], [[]]], ids=["text", "list", "text in a list", "tokens"])
def test_nothing_to_embed_is_a_400_as_openai_answers_it(
    gateway: str, api_key: str, fake_nodes: Any, given: Any
) -> None:
    """Empty input was passed on: a node answered no embedding, billed a token, and the SDK raised
    `No embedding data received` (a new user's trial)."""
    node = fake_nodes()
    resp = httpx.post(
        f"{gateway}/v1/embeddings",
        json={"model": "BAAI/bge-large-en-v1.5", "input": given},
        headers={"authorization": f"Bearer {api_key}"},
        timeout=30,
    )
    assert resp.status_code == 400, resp.text
    assert (
        resp.json()["error"]["type"] == "invalid_request_error" and "input" in resp.json()["error"]["message"]
    )
    assert node.requests == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"model": LLAMA8, "input": "hi", "n_predict": 400}, "n_predict"),
        ("/v1/completions", {"model": LLAMA8, "prompt": "hi", "n": 2, "best_of": 4}, "best_of"),
    ],
)
def test_generation_beyond_what_is_billed_is_refused_on_every_route(
    gateway: str, api_key: str, fake_nodes: Any, path: str, body: dict[str, Any], param: str
) -> None:
    node = fake_nodes()
    resp = httpx.post(gateway + path, json=body, headers={"authorization": f"Bearer {api_key}"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text[:300]
    assert node.requests == 0


def test_best_of_as_many_as_n_is_n_answers(gateway: str, api_key: str, fake_nodes: Any) -> None:
    fake_nodes()
    body = {"model": LLAMA8, "prompt": "hi", "n": 2, "best_of": 2, "max_tokens": 3}
    resp = httpx.post(gateway + "/v1/completions", json=body, headers={"authorization": f"Bearer {api_key}"})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2, resp.text[:300]


def test_an_error_names_the_rule_the_value_broke(gateway: str, api_key: str) -> None:
    """Found trying the API: five `stop` sequences were refused as "Input should be a valid string"
    (the first of the union's two types), where the rule is at most four."""
    body = {**CHAT, "stop": ["a", "b", "c", "d", "e"]}
    resp = httpx.post(
        f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {api_key}"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop", resp.text
    assert "at most 4" in resp.json()["error"]["message"], resp.text


def test_max_tokens_null_is_the_default_the_hold_assumed(
    conn: psycopg.Connection, gateway: str, fake_nodes: Any
) -> None:
    """The review's case: `"max_tokens": null` held 512 tokens but the node got null (unbounded on vLLM)."""
    node = fake_nodes()
    key = conn.execute("select api_key from create_api_key('budgeted', null, null, 1.0)").fetchone()
    assert key is not None
    resp = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={**CHAT, "max_tokens": None, "max_completion_tokens": None},
        headers={"authorization": f"Bearer {key[0]}"},
    )
    assert resp.status_code == 200, resp.text
    sent = node.server.app.state.last_body
    assert sent["max_tokens"] == 512 and "max_completion_tokens" not in sent


def test_one_request_cannot_spend_more_than_the_budget_left(
    conn: psycopg.Connection, gateway: str, fake_nodes: Any
) -> None:
    """The review's case: a fresh $0.01 key asked for 1,000,000 tokens and was charged $0.10. Now the
    node is told to stop at what the budget pays for, and the key is charged at most its budget."""
    node = fake_nodes(context_length=2_000_000)
    conn.execute("update models set context_length = 2000000 where id = %s", (LLAMA8,))
    (secret,) = conn.execute("select api_key from create_api_key('k', null, null, 0.01)").fetchone() or ("",)
    resp = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={**CHAT, "max_tokens": 1_000_000},
        headers={"authorization": f"Bearer {secret}"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    (price,) = conn.execute("select output_usd_per_mtok from models where id = %s", (LLAMA8,)).fetchone() or (
        0,
    )
    affordable = int(0.01 * 1e6 / float(price))  # less the prompt's share
    assert 0.99 * affordable < node.server.app.state.last_body["max_tokens"] < affordable
    spent = wait_for(
        lambda: conn.execute("select spent_usd from api_keys where name = 'k' and spent_usd > 0").fetchone()
    )
    assert float(spent[0]) <= 0.01


def test_a_request_the_budget_cannot_hold_is_told_what_was_weighed(
    conn: psycopg.Connection, gateway: str, fake_nodes: Any
) -> None:
    """The refusal had said the budget "cannot pay for this request's prompt and one token of
    answer" of a prompt it could pay for (a new user's trial): it is the hold that it cannot cover,
    the prompt reckoned from the request's size, with what requests under way hold apart."""
    fake_nodes()
    (secret,) = conn.execute("select api_key from create_api_key('k', null, null, 0.0001)").fetchone() or (
        "",
    )
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 40_000}]}
    resp = httpx.post(
        f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {secret}"}, timeout=30
    )
    assert resp.status_code == 429, resp.text
    message = resp.json()["error"]["message"]
    assert "$0.000100, with $0.000000 more held for requests under way" in message, message
    assert "cannot cover this request's hold" in message and "one token per 4 of its" in message


def _lying_node() -> Starlette:
    """A node that answers "hi" and bills ten million tokens each way, the most Usage.parse takes."""

    async def chat(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": LLAMA8,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                ],
                "usage": {
                    "prompt_tokens": 10_000_000,
                    "completion_tokens": 10_000_000,
                    "total_tokens": 20_000_000,
                },
            }
        )

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_a_node_cannot_bill_more_than_the_request_could_use(conn: psycopg.Connection, gateway: str) -> None:
    """A security review's case: a node reported 10M prompt and 10M completion tokens for "hi", and a
    $1 key was charged $15 (its owner paid 85% of it). A node's account is bounded by the request:
    its answer by max_tokens, its prompt by a token a byte plus a chat template's worth; and no
    charge takes a key past its budget."""
    with ThreadedServer(_lying_node()) as node:
        make_node(conn, "liar", endpoint_url=node.url, max_concurrency=8)
        for budget in (None, 0.0001):
            name = f"k{budget}"
            (secret,) = conn.execute(
                "select api_key from create_api_key(%s, null, null, %s::numeric)", (name, budget)
            ).fetchone() or ("",)
            body = {**CHAT, "max_tokens": 5}
            resp = httpx.post(
                f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {secret}"}
            )
            assert resp.status_code == 200, resp.text
            prompt, completion, spent = wait_for(
                lambda: conn.execute(
                    "select j.prompt_tokens, j.completion_tokens, k.spent_usd from jobs j"
                    " join api_keys k on k.id = j.api_key_id where k.name = %s and j.status <> 'running'",
                    (name,),  # noqa: B023 (read at once, in this iteration)
                ).fetchone()
            )
            assert completion == 5 and prompt <= len(json.dumps(body)) + 1100, (prompt, completion)
            assert budget is None or spent <= budget


def test_a_prompt_of_media_by_url_is_bounded_by_the_models_context(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """A review's case: an image given by URL is a few bytes of the request and a thousand tokens or
    more of the prompt, so a node's honest count was cut to a token a byte (plus 1,024). A prompt
    with media by reference is bounded by what any prompt is: the model's context. Media inline (a
    data: URL) is bytes of the request, and keeps the tighter bound."""
    (context,) = conn.execute("select context_length from models where id = %s", (LLAMA8,)).fetchone() or (0,)
    with ThreadedServer(_lying_node()) as node:
        make_node(conn, "vision", endpoint_url=node.url, max_concurrency=8)
        for url in ("https://example.com/cat.png", "data:image/png;base64,iVBORw0KGgo="):
            parts = [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": url}},
            ]
            body = {"model": LLAMA8, "messages": [{"role": "user", "content": parts}], "max_tokens": 5}
            resp = httpx.post(
                f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {api_key}"}
            )
            assert resp.status_code == 200, resp.text
        prompts = wait_for(
            lambda: (
                [
                    p
                    for (p,) in conn.execute(
                        "select prompt_tokens from jobs where status = 'succeeded' order by created_at"
                    ).fetchall()
                ]
                if len(conn.execute("select 1 from jobs where status = 'succeeded'").fetchall()) == 2
                else None
            )
        )
        assert prompts[0] == context and prompts[1] < 1500, prompts


def _batch_node() -> Starlette:
    """A completions server answering each of a list of prompts, max_tokens each, as vLLM does."""

    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        prompts, most = body["prompt"], body["max_tokens"]
        choices = [{"index": i, "text": "x" * most, "finish_reason": "length"} for i in range(len(prompts))]
        usage = {"prompt_tokens": len(prompts), "completion_tokens": most * len(prompts)}
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "choices": choices, "usage": usage})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_a_batch_of_prompts_is_billed_for_every_answer(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """A review's case: a completion of 64 prompts was bounded (and held, and counted for tpm) as one
    answer of max_tokens, so the node's honest count of 64 was billed as 1."""
    with ThreadedServer(_batch_node()) as node:
        make_node(conn, "batch", endpoint_url=node.url)
        body = {"model": LLAMA8, "prompt": ["Write an essay"] * 8, "max_tokens": 16}
        resp = httpx.post(
            f"{gateway}/v1/completions", json=body, headers={"authorization": f"Bearer {api_key}"}
        )
        assert resp.status_code == 200, resp.text
        (completion,) = wait_for(
            lambda: conn.execute("select completion_tokens from jobs where status = 'succeeded'").fetchone()
        )
        assert completion == 8 * 16


def _flooding_node() -> Starlette:
    """A node that streams a token's event, then ten thousand empty ones: bytes a gateway must read
    one event at a time, and no answer has."""

    async def chat(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": LLAMA8}
            token = {**chunk, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
            yield f"data: {json.dumps(token)}\n\n".encode()
            for _ in range(100):
                yield b"data:a\n\n" * 100
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_a_stream_of_more_events_than_its_answer_has_is_cut_off(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """A security review's case: 4 MiB of tiny events cost a gateway 16 s of CPU, and heartbeats
    timed out meanwhile. A stream may have two events a token it may answer, and 1,024 more."""
    with ThreadedServer(_flooding_node()) as node:
        make_node(conn, "flood", endpoint_url=node.url)
        body = {**CHAT, "max_tokens": 5, "stream": True}
        with httpx.stream(
            "POST",
            f"{gateway}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {api_key}"},
        ) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data:")]
        assert len(lines) < 1100 and "more events than its answer's 1034" in lines[-2], lines[-2:]
        status, error = wait_for(
            lambda: conn.execute("select status, error from jobs where status <> 'running'").fetchone()
        )
        assert status == "failed" and "more events" in error


SECRET = "test-secret-of-the-project-0123456789abcdef"


def bearer(claims: dict[str, Any]) -> dict[str, str]:
    return {"authorization": f"Bearer {jwt.encode(claims, SECRET, algorithm='HS256')}"}


@pytest.mark.parametrize("gateway_settings", [{"NEURALGRID_JWT_SECRET": SECRET}])
def test_user_tokens_and_key_names_are_checked(conn: psycopg.Connection, gateway: str) -> None:
    user = make_user(conn)
    good = {"sub": str(user), "role": "authenticated", "aud": "authenticated", "exp": int(time.time()) + 60}
    refused_tokens = [
        {k: v for k, v in good.items() if k != "exp"},  # never expires: refused, as Realtime does
        {**good, "sub": "not-a-uuid"},
        {**good, "sub": 42},
        {**good, "exp": int(time.time()) - 5},
    ]
    for claims in refused_tokens:
        resp = httpx.get(f"{gateway}/v1/keys", headers=bearer(claims))
        assert resp.status_code == 401 and resp.json()["error"]["message"], claims
    for name in ("a\u0000b", "line\nbreak"):
        resp = httpx.post(f"{gateway}/v1/keys", json={"name": name}, headers=bearer(good))
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "name", resp.text
    assert (
        httpx.post(f"{gateway}/v1/keys", json={"name": "laptop ☕"}, headers=bearer(good)).status_code == 201
    )
    assert httpx.get(f"{gateway}/v1/keys", headers=bearer(good)).json()["data"][0]["name"] == "laptop ☕"


@pytest.mark.parametrize("gateway_settings", [{"NEURALGRID_JWT_SECRET": SECRET}])
def test_a_key_is_created_as_asked_or_not_at_all(conn: psycopg.Connection, gateway: str) -> None:
    """Found trying the API: `{"rpm": -5}` (a misspelt limit) made a key with no limit at all, a budget
    below the ledger's 4 decimals became $0, out-of-range numbers came back in Postgres's words, and
    malformed JSON was "1: JSON decode error" naming a parameter "1"."""
    user = make_user(conn)
    claims = {"sub": str(user), "role": "authenticated", "aud": "authenticated", "exp": int(time.time()) + 60}
    url, auth = f"{gateway}/v1/keys", bearer(claims)
    refused = [
        ({"name": "k", "rpm": 5}, "rpm"),
        ({"name": "k", "budget_usd": 0.000001}, "budget_usd"),
        ({"name": "k", "budget_usd": 1e12}, "budget_usd"),
        ({"name": "k", "tpm_limit": 2**31}, "tpm_limit"),
        # A billing review's: each made a key, with the value converted.
        ({"name": "k", "rpm_limit": True}, "rpm_limit"),
        ({"name": "k", "rpm_limit": "10"}, "rpm_limit"),
        ({"name": "k", "tpm_limit": 1.0}, "tpm_limit"),
        ({"name": "k", "budget_usd": "1_000"}, "budget_usd"),
        ({"name": "k", "budget_usd": " 5 "}, "budget_usd"),
        ({"name": "k", "budget_usd": True}, "budget_usd"),
    ]
    for body, param in refused:
        resp = httpx.post(url, json=body, headers=auth)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)
    resp = httpx.post(url, content=b'{"name": ', headers={**auth, "content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] is None
    assert resp.json()["error"]["message"].startswith("the request body is not valid JSON")
    for sent in ({"content": b'{"name": "k"}'}, {"json": ["k"]}, {}):  # not as JSON, not an object, none
        resp = httpx.post(url, headers=auth, **sent)
        assert resp.status_code == 400 and "must be a JSON object" in resp.json()["error"]["message"], (
            resp.text
        )
    assert conn.execute("select count(*) from api_keys").fetchone() == (0,)  # nothing made
    made = httpx.post(url, json={"name": "k", "rpm_limit": 5, "budget_usd": 0.25}, headers=auth)
    assert made.status_code == 201, made.text
    row = conn.execute("select rpm_limit, budget_usd from api_keys").fetchone()
    assert row is not None and (row[0], float(row[1])) == (5, 0.25)


def test_a_node_listing_a_model_twice_holds_it_once(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """Found by the fuzz: a repeated model made registration a 500 (ON CONFLICT met its row twice)."""
    spec = {
        "name": "twice",
        "gpu_model": "L4",
        "vram_gb": 24,
        "tflops": 121,
        "hourly_rate": 0.4,
        "region": "eu",
    }
    body = {**spec, "endpoint_url": "tunnel:twice", "models": [LLAMA8, LLAMA8]}
    resp = httpx.post(f"{gateway}/v1/nodes", json=body, headers={"authorization": f"Bearer {api_key}"})
    assert resp.status_code == 201, resp.text
    held = conn.execute(
        "select count(*) from node_models m join nodes n on n.id = m.node_id where n.name = 'twice'"
    ).fetchone()
    assert held == (1,)


# What is not the client's doing: still an answer in OpenAI's shape, never Starlette's plain text ------


def test_a_bug_is_a_500_in_openais_shape(
    gateway: str, api_key: str, fake_nodes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neuralgrid.gateway.pipeline.place import Placement

    async def broken(self: Placement, admitted: Any) -> Any:
        raise RuntimeError("a bug in placement")

    fake_nodes()
    monkeypatch.setattr(Placement, "place", broken)
    resp = httpx.post(
        f"{gateway}/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {api_key}"}
    )
    assert resp.status_code == 500
    assert resp.json()["error"] == {
        "message": "the gateway failed on this request; it has been logged",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


def test_a_database_that_stops_answering_is_a_503_in_openais_shape(
    conn: psycopg.Connection, gateway: str, api_key: str, fake_nodes: Any
) -> None:
    """Every connection the gateway holds is cut under it (as a database restart does): the next
    request that must ask Postgres (a price cap under every leased node's) gets a 503 the SDK
    retries, and is answered from Postgres again once the pools reconnect (no node that cheap: a 503
    that says so). One its leases serve is served meanwhile."""
    fake_nodes()
    auth = {"authorization": f"Bearer {api_key}"}
    capped = {**auth, "x-neuralgrid-max-price": "0.01"}

    def served_from_a_lease() -> bool:  # the first request of a lane is placed in SQL, the lease behind
        assert httpx.post(f"{gateway}/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
        return metric(gateway, "neuralgrid_leased_placements_total") > 0

    wait_for(served_from_a_lease)
    conn.execute(
        "select pg_terminate_backend(pid) from pg_stat_activity"
        " where datname = current_database() and pid <> pg_backend_pid() and backend_type = 'client backend'"
    )
    assert httpx.post(f"{gateway}/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
    resp = httpx.post(f"{gateway}/v1/chat/completions", json=CHAT, headers=capped)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "database_unavailable" and resp.headers["retry-after"] == "1"

    def answered() -> bool:
        resp = httpx.post(f"{gateway}/v1/chat/completions", json=CHAT, headers=capped)
        return resp.status_code == 503 and resp.json()["error"]["code"] != "database_unavailable"

    wait_for(answered, timeout=15)


def _huge_node(status: int) -> Starlette:
    """A node whose answer is 80 MiB of one byte, sent in 1 MiB pieces."""

    async def chat(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for _ in range(80):
                yield b"x" * (1 << 20)

        return StreamingResponse(body(), status_code=status, media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.mark.parametrize("status", [200, 500])
def test_a_node_cannot_fill_the_gateways_memory_with_one_answer(
    conn: psycopg.Connection, gateway: str, api_key: str, status: int
) -> None:
    """A security review's case: a node's 1 GiB answer took a gateway from 117 MiB to 2 GiB, and
    1 GiB of a 500's body was read only to keep its first 200 bytes. A whole answer past
    NEURALGRID_MAX_ANSWER_BYTES (64 MiB) is the node's failure; of a refusal, 200 bytes are read."""
    with ThreadedServer(_huge_node(status)) as node:
        make_node(conn, "huge", endpoint_url=node.url)
        tracemalloc.start()  # the gateway runs in this process (a thread): its memory is counted here
        try:
            resp = httpx.post(
                f"{gateway}/v1/chat/completions",
                json=CHAT,
                headers={"authorization": f"Bearer {api_key}"},
                timeout=60,
            )
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert resp.status_code == 502, resp.text[:300]
        # The node's server (also here) holds one 1 MiB piece at a time.
        assert peak < (150 << 20 if status == 200 else 16 << 20), peak >> 20
        (error,) = conn.execute("select error from job_attempts").fetchone() or ("",)
        assert ("larger than 64 MiB" in error) if status == 200 else error == "HTTP 500: " + "x" * 200


@pytest.mark.parametrize("shared", ["strip", "off"])
def test_a_client_cannot_name_another_keys_cache_salt(
    conn: psycopg.Connection, gateway_settings: dict[str, Any], fake_nodes: Any, request: Any, shared: str
) -> None:
    """Every generation request reaches its node with its own key's prompt-cache salt, whatever salt
    the client sent (one copied from another key's requests would read that key's cache), and with
    the shared cache off, told to skip the cache."""
    gateway_settings["NEURALGRID_SHARED_CACHE"] = shared
    gateway = request.getfixturevalue("gateway")
    node = fake_nodes()
    keys = [conn.execute("select api_key from create_api_key(%s)", (name,)).fetchone() for name in "ab"]
    salts = []
    for key in (keys[0], keys[1], keys[0]):
        assert key is not None
        resp = httpx.post(
            f"{gateway}/v1/chat/completions",
            json={**CHAT, "cache_salt": "the-other-keys", "cache_prompt": True},
            headers={"authorization": f"Bearer {key[0]}"},
        )
        assert resp.status_code == 200, resp.text
        sent = node.server.app.state.last_body
        salts.append(sent["cache_salt"])
        assert sent["cache_prompt"] is (shared != "off")
    assert salts[0] == salts[2] != salts[1] and "the-other-keys" not in salts
