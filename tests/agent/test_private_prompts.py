"""Private prompts at the node: the agent passes its server the cache fields it takes (the key's
`cache_salt` to vLLM and SGLang, `cache_prompt` to llama-server) and strips the cache counts from the
answers of servers whose cache every key shares, against raw servers and a real llama-server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from neuralgrid.agent.backend import Backend
from neuralgrid.agent.front import FrontState
from neuralgrid.agent.servers import llama_server, ollama, sglang, vllm
from neuralgrid.agent.servers.base import ServerKind
from tests.agent.servers import SMOLLM2
from tests.agent.test_backends import a_stack
from tests.agent.test_front import CHAT, chat, raw_server, read_request

USAGE = {
    "prompt_tokens": 9,
    "completion_tokens": 2,
    "total_tokens": 11,
    "prompt_tokens_details": {"cached_tokens": 8},
}
TIMINGS = {"cache_n": 8, "prompt_n": 1, "prompt_ms": 0.5}
ANSWER = {
    "id": "x",
    "choices": [{"index": 0, "message": {"content": "hi"}}],
    "usage": USAGE,
    "timings": TIMINGS,
}
LAST_EVENT = {"id": "x", "choices": [], "usage": USAGE, "timings": TIMINGS}
FIELDS = {"cache_salt": "c2FsdA", "cache_prompt": False}  # as the gateway sends them (shared cache off)


async def forwarded(kind: ServerKind, stream: bool) -> tuple[dict[str, Any], bytes, str | None]:
    """What a server of `kind` was sent for a chat request with the gateway's cache fields, and the
    answer (and its length) the gateway got back."""
    seen: list[bytes] = []
    if stream:
        sent = b"data: " + json.dumps(LAST_EVENT).encode() + b"\n\ndata: [DONE]\n\n"
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(sent)
    else:
        sent = json.dumps(ANSWER).encode()
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(sent)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(head + sent)
        await writer.drain()

    async with raw_server(handle) as url:
        front = FrontState(Backend(url))
        front.backend.kind = kind
        try:
            answer = await front.forward(CHAT, chat(stream, **FIELDS))
            body = b"".join([chunk async for chunk in answer.chunks])
            length = None if answer.length is None else str(answer.length)
            await answer.aclose()
        finally:
            await front.backend.aclose()
    return json.loads(seen[0]), body, length


def answer_of(body: bytes, stream: bool) -> dict[str, Any]:
    if not stream:
        return dict(json.loads(body))
    return next(json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("kind", "takes", "isolated"),
    [
        (vllm.KIND, {"cache_salt"}, True),
        (sglang.KIND, {"cache_salt"}, True),
        (llama_server.KIND, {"cache_prompt"}, False),
        (ollama.KIND, set(), False),
    ],
    ids=lambda x: getattr(x, "name", None),
)
async def test_a_server_gets_the_cache_fields_it_takes_and_shared_counts_are_stripped(
    kind: ServerKind, takes: set[str], isolated: bool, stream: bool
) -> None:
    sent, body, length = await forwarded(kind, stream)
    assert {field for field in FIELDS if field in sent} == takes
    assert all(sent[field] == FIELDS[field] for field in takes)
    got = answer_of(body, stream)
    if isolated:  # its counts are the key's own: they pass as the server wrote them
        assert got["usage"] == USAGE and got["timings"] == TIMINGS
    else:
        assert "timings" not in got
        assert got["usage"] == {**USAGE, "prompt_tokens_details": {"cached_tokens": 0}}
    if not stream:
        assert length == str(len(body))  # rewritten, its length still told


def test_a_real_llama_servers_cache_counts_never_reach_another_key(
    pg_server: Any, template_db: str, tmp_path: Path
) -> None:
    """Two keys send the same long prompt to a node on llama-server: the server finds the second
    in its cache (asked directly, it says so), and neither key's answer tells."""
    prompt = "Summarise the quarterly report of Acme Widgets Ltd for the board. " * 8
    body = {"model": SMOLLM2, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    with a_stack(pg_server, template_db, tmp_path, "llama.cpp", "direct") as stack:
        other = stack.conn.execute("select api_key from create_api_key('other')").fetchone()
        assert other is not None
        stack.settle()
        answers = []
        for key in (stack.key, str(other[0]), stack.key):
            for stream in (False, True):
                resp = httpx.post(
                    f"{stack.gateway}/v1/chat/completions",
                    json={**body, "stream": stream},
                    headers={"authorization": f"Bearer {key}"},
                    timeout=60,
                )
                assert resp.status_code == 200, resp.text
                answers.append(resp.text)
        assert not any("timings" in text or "prompt_progress" in text for text in answers)
        assert not any('"cached_tokens": 0' not in text and "cached_tokens" in text for text in answers)

        # The server did keep the prompt: asked directly, it finds it cached, unless told not to.
        def cached(**extra: Any) -> int:
            direct = {**body, "model": stack.server.served, **extra}
            answer = httpx.post(f"{stack.server.url}/v1/chat/completions", json=direct, timeout=60).json()
            return int(answer["timings"]["cache_n"])

        assert cached() > 100
        assert cached(cache_prompt=False) == 0  # what the shared cache off (NEURALGRID_SHARED_CACHE) asks
