"""The agent's count of an answer of several choices (n > 1), each choice's text by the server's
tokenizer, against servers that write their usage in the ways servers do (a reviewer's cases)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

from neuralgrid.agent.backend import Backend
from neuralgrid.agent.front import FrontState
from tests.agent.test_front import CHAT, LLAMA8, SERVED, chat, raw_server, read_request

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}  # one choice's, as llama-server says
STREAM: dict[str, Any] = {"stream": True, "n": 2, "stream_options": {"include_usage": True}}
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def ev(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def delta(i: int, text: str, **extra: Any) -> dict[str, Any]:
    return {"id": "x", "choices": [{"index": i, "delta": {"content": text}}], **extra}


def finish(i: int, **extra: Any) -> dict[str, Any]:
    return {"id": "x", "choices": [{"index": i, "delta": {}, "finish_reason": "length"}], **extra}


def serve(body: bytes, content_type: bytes, cut: bool) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        writer.write(b"%x\r\n%s\r\n" % (len(body), body))
        await writer.drain()
        if cut:  # broken off before the chunked body's end
            await asyncio.sleep(0.05)
            writer.transport.abort()
            return
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return handle


async def relayed(
    body: bytes,
    request: bytes,
    content_type: bytes = b"text/event-stream",
    cut: bool = False,
    path: str = CHAT,
    **state: Any,
) -> tuple[bytes, Exception | None]:
    """What the agent sends on of the server's `body`, counting a word a token, and the error that
    ended it, if one did."""
    async with raw_server(serve(body, content_type, cut)) as url:
        front = FrontState(Backend(url), **state)
        front.backend.info = dataclasses.replace(front.backend.info, tokenize=True)

        async def count(model: str, text: str) -> int:
            return len(text.split())

        front.backend.count_tokens = count  # type: ignore[method-assign]
        got: list[bytes] = []
        error: Exception | None = None
        try:
            answer = await front.forward(path, request)
            try:
                async for chunk in answer.chunks:
                    got.append(chunk)
            except Exception as err:
                error = err
            await answer.aclose()
        finally:
            await front.backend.aclose()
    return b"".join(got), error


def payloads(out: bytes) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]


def usages(out: bytes) -> list[dict[str, Any]]:
    return [p["usage"] for p in payloads(out) if p.get("usage")]


async def test_a_usage_a_choice_becomes_one_usage_of_every_choice() -> None:
    """llama-server: a usage event after each choice's end, each of that choice alone."""
    sse = b"".join(
        [ev(delta(0, "a b")), ev(delta(1, "c d e")), ev({"id": "x", "choices": [], "usage": USAGE})]
    )
    sse += ev({"id": "x", "choices": [], "usage": USAGE}) + b"data: [DONE]\n\n"
    out, error = await relayed(sse, chat(**STREAM))
    assert error is None and out.endswith(b"data: [DONE]\n\n")
    assert usages(out) == [{"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}]


async def test_usage_that_rides_with_a_choice_does_not_hold_the_choice_back() -> None:
    """Usage in a finish chunk, or in every chunk (vLLM's continuous_usage_stats): each event goes
    on at once, without it; the one usage, recounted, before [DONE]."""
    sse = b"".join([ev(delta(0, "a", usage=USAGE)), ev(delta(1, "b", usage=USAGE))])
    sse += ev(finish(0, usage=USAGE)) + ev(finish(1, usage=USAGE)) + b"data: [DONE]\n\n"
    out, _ = await relayed(sse, chat(**STREAM))
    sent = [c for p in payloads(out) for c in p["choices"]]
    assert [c["delta"].get("content") for c in sent] == ["a", "b", None, None]
    assert [c["index"] for c in sent if c.get("finish_reason")] == [0, 1]
    assert usages(out) == [{"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}]


async def test_reasoning_is_counted_and_never_less_than_the_server_said() -> None:
    choices = [
        {"index": i, "message": {"content": "ok", "reasoning_content": "think " * 9}} for i in range(2)
    ]
    usage = {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
    body = json.dumps({"id": "x", "model": LLAMA8, "choices": choices, "usage": usage}).encode()
    out, _ = await relayed(body, chat(n=2), content_type=b"application/json")
    assert json.loads(out)["usage"]["completion_tokens"] == 20


async def test_what_cannot_be_read_passes_as_it_came() -> None:
    sse = b"".join([ev(delta(0, "a")), ev({"id": "x", "choices": 1}), ev(delta(1, "b"))])
    sse += ev({"id": "x", "choices": [], "usage": USAGE}) + b"data: [DONE]\n\n"
    out, error = await relayed(sse, chat(**STREAM))
    assert error is None and out.endswith(b"data: [DONE]\n\n")
    body = json.dumps({"id": "x", "choices": 1, "usage": USAGE}).encode()
    out, error = await relayed(body, chat(n=2), content_type=b"application/json")
    assert error is None and json.loads(out)["usage"] == USAGE


async def test_a_stream_broken_off_still_sends_the_usage_it_had() -> None:
    sse = b"".join([ev(delta(0, "a b")), ev(delta(1, "c d")), ev({"id": "x", "choices": [], "usage": USAGE})])
    out, error = await relayed(sse, chat(**STREAM), cut=True)
    assert error is not None
    assert usages(out) == [{"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}]


async def test_the_servers_name_never_shows_and_completions_are_counted() -> None:
    sse = b"".join([ev({**delta(i, "a b"), "model": SERVED}) for i in range(2)])
    sse += ev({"id": "x", "model": SERVED, "choices": [], "usage": USAGE}) + b"data: [DONE]\n\n"
    out, _ = await relayed(sse, chat(**STREAM), served_names={LLAMA8: SERVED})
    assert SERVED.encode() not in out and usages(out)[0]["completion_tokens"] == 4
    plain = [{"index": i, "message": {"role": "assistant", "content": "a b c"}} for i in range(2)]
    body = json.dumps({"id": "x", "model": SERVED, "choices": plain, "usage": USAGE}).encode()
    out, _ = await relayed(body, chat(n=2), content_type=b"application/json", served_names={LLAMA8: SERVED})
    assert json.loads(out)["model"] == LLAMA8 and json.loads(out)["usage"]["completion_tokens"] == 6
    texts = b"".join(ev({"id": "x", "choices": [{"index": i, "text": "w " * (i + 1)}]}) for i in range(2))
    sse = (texts + ev({"id": "x", "choices": [], "usage": USAGE}) + b"data: [DONE]\n\n").replace(
        b"\n", b"\r\n"
    )
    request = json.dumps({"model": "m", "prompt": "hi", **STREAM}).encode()
    out, _ = await relayed(sse, request, path="/v1/completions")
    assert usages(out)[0]["completion_tokens"] == 3 and out.endswith(b"data: [DONE]\n\n")
