"""A small OpenAI-compatible inference server with knobs, standing in for a GPU node.

Tests and `neuralgrid up --demo` run it on loopback ports. It answers chat, completions, embeddings
and (when told to serve it) OpenAI's Responses API, streams as SSE, with deterministic text, and can
be told to be slow, to fail, or to drop a stream half-way, so that the gateway's failover and
metering can be exercised for real. A route it is not told to serve is refused as the server it
mimics refuses one (`routes`).

By default it behaves like vLLM where the platform cares. `FakeNodeConfig.like()` makes it behave
like llama.cpp's server or llama-cpp-python's instead, in each way the backend conformance suite
(tests/test_backends.py) found them to differ, and the suite holds each preset against the real
server: the endpoints that identify it, its parallelism, usage in streams, whether it continues an
open assistant message, what it answers to bad parameters, whether a new request cuts a stream, and
which routes it serves. A prompt past its context is refused as llama-server refuses one (HTTP 400,
with the status as the error's `code`, a shape the gateway turns into OpenAI's).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from neuralgrid.protocol.routes import DEFAULT_ROUTES
from neuralgrid.protocol.routes import Route as ApiRoute  # starlette's Route is the app's own

WORDS = ("grid", "node", "token", "light", "river", "stone", "cloud", "signal", "orbit", "amber")


# How each server differs from the fake's default (vLLM-like), as tests/test_backends.py measured.
LIKE: dict[str, dict[str, Any]] = {
    "vllm": {},
    # Started without --embeddings or --reranking: chat, completions and the Responses API.
    "llama.cpp": {"parallel": 4, "echoes": False, "routes": ("chat/completions", "completions", "responses")},
    "llama-cpp-python": {
        "usage_in_streams": False,
        "continues": False,
        "parallel": 1,
        "interrupts": True,
        "bad_request_status": 500,
        "routes": ("chat/completions", "completions"),  # embeddings only for a model loaded for them
    },
}
# What each route's request is, to the fake (its answers' shapes).
KINDS = {
    "chat/completions": "chat",
    "completions": "completion",
    "embeddings": "embedding",
    "responses": "responses",
}


@dataclass
class FakeNodeConfig:
    """The knobs. Change them on a running node (tests do) through `app.state.config`."""

    models: tuple[str, ...] = ("meta-llama/Llama-3.1-8B-Instruct",)
    latency_s: float = 0.0  # before the first byte
    tokens_per_s: float = 0.0  # 0: as fast as possible
    failure_rate: float = 0.0  # share of requests answered with fail_status
    fail_status: int = 500
    drop_after_chunks: int | None = None  # close a stream after this many chunks
    default_max_tokens: int = 16
    # Where its answers end of themselves, as a model's do at its end-of-sequence token (finish_reason
    # "stop"), in words; max_tokens cuts them shorter, and `ignore_eos` (vLLM's and llama.cpp's) runs
    # them to max_tokens. None: every answer runs to max_tokens (or default_max_tokens).
    answer_words: int | None = None
    name: str = "fake-node"
    kind: str = "vllm"  # whose identifying endpoints it serves: vllm, llama.cpp or llama-cpp-python
    usage_in_streams: bool = True  # send usage in a stream that asks for it
    continues: bool = True  # honour continue_final_message (else: a new answer)
    echoes: bool = True  # a completion's `echo` puts its prompt before its text (else: ignored)
    parallel: int = 0  # requests run at once; more wait their turn (0: no limit)
    interrupts: bool = False  # a new request ends a running stream early, without a finish_reason
    bad_request_status: int = 400  # the answer to a parameter of the wrong type
    linger_after_done_s: float = 0.0  # keep a stream open this long after [DONE] before ending it
    context_length: int = 8192  # an answer stops where the context is full, as a real server's does
    # The OpenAI routes it serves, of the ones it can answer: chat, completions, embeddings, responses.
    routes: tuple[ApiRoute, ...] = DEFAULT_ROUTES

    @classmethod
    def like(cls, kind: str, **knobs: Any) -> FakeNodeConfig:
        """A fake that behaves like `kind` ("llama.cpp" or "llama-cpp-python"), as measured."""
        return cls(**{"kind": kind, **LIKE[kind], **knobs})


def _answer(prompt: object, n: int) -> list[str]:
    """This node's answer to a prompt: n words picked by the prompt's hash."""
    start = int.from_bytes(hashlib.sha256(json.dumps(prompt).encode()).digest()[:4], "big")
    return [WORDS[(start + i * 7) % len(WORDS)] + " " for i in range(n)]


def _text_tokens(body: dict[str, Any], n: int, continues: bool = True, ends: int | None = None) -> list[str]:
    """The next n words, fewer where the whole answer ends after `ends` words. A request that
    continues this node's own answer exactly (chat: vLLM's `continue_final_message` with the answer
    so far; completions: the prompt plus the answer so far) gets the rest of that answer, as a model
    would; anything else is a new prompt."""
    prompt = body.get("messages") or body.get("prompt")

    def rest(prompt: object, done: int) -> list[str]:
        whole = done + n if ends is None else max(done, min(done + n, ends))
        return _answer(prompt, whole)[done:]

    if isinstance(prompt, list) and prompt and body.get("continue_final_message") and continues:
        so_far = prompt[-1].get("content") if isinstance(prompt[-1], dict) else None
        if isinstance(so_far, str):
            done = len(so_far.split())
            if "".join(_answer(prompt[:-1], done)).rstrip() == so_far.rstrip():
                return rest(prompt[:-1], done)
    elif isinstance(prompt, str):
        original, done = prompt, 0
        while word := next((w for w in WORDS if original.endswith(w + " ")), None):
            original, done = original[: -len(word) - 1], done + 1
            if "".join(_answer(original, done)) == prompt[len(original) :]:
                return rest(original, done)
    return rest(prompt, 0)


def _count_prompt_tokens(body: dict[str, object]) -> int:
    text = json.dumps(body.get("messages") or body.get("prompt") or body.get("input") or "")
    return max(1, len(text) // 4)


def _not_served(config: FakeNodeConfig, path: str) -> JSONResponse:
    """A route the fake is not told to serve, refused as the server it mimics refuses it."""
    if config.kind == "llama.cpp" and path == "/v1/embeddings":
        message = "This server does not support embeddings. Start it with `--embeddings`"
        return JSONResponse({"error": {"code": 501, "message": message, "type": "not_supported_error"}}, 501)
    if config.kind == "llama-cpp-python" and path == "/v1/embeddings":
        message = "Llama model must be created with embedding=True to call this method"
        return JSONResponse({"error": {"message": message, "type": "internal_server_error"}}, 500)
    if config.kind == "llama.cpp":
        return JSONResponse(
            {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}, 404
        )
    return JSONResponse({"detail": "Not Found"}, 404)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "code": status}}, status)


async def _models(request: Request) -> Response:
    config: FakeNodeConfig = request.app.state.config
    if config.interrupts:  # llama-cpp-python's GET /v1/models waits for the model, cutting a stream
        request.app.state.fake.interrupt()
    data = [{"id": m, "object": "model", "created": 0, "owned_by": config.name} for m in config.models]
    return JSONResponse({"object": "list", "data": data})


async def _generate(request: Request, kind: str) -> Response:
    config: FakeNodeConfig = request.app.state.config
    if request.url.path.removeprefix("/v1/") not in config.routes:
        return _not_served(config, request.url.path)
    request.app.state.requests += 1
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return _error(400, "body is not JSON")
    request.app.state.last_body = body  # what the gateway sent, for tests to read
    if config.failure_rate and random.random() < config.failure_rate:
        return _error(config.fail_status, f"{config.name} failed on purpose")
    for param in ("temperature", "top_p"):
        if param in body and (isinstance(body[param], bool) or not isinstance(body[param], int | float)):
            return _error(config.bad_request_status, f"{param} must be a number")
    state: _State = request.app.state.fake
    if config.interrupts:  # what llama-cpp-python does to a running stream when another request comes
        state.interrupt()
    slot = await state.take_slot(config.parallel)
    try:
        return await _answer_request(config, state, body, kind, slot)
    except BaseException:
        slot.release()
        raise


def _too_long(prompt_tokens: int, context_length: int) -> dict[str, Any]:
    message = (  # llama-server's own words (tools/server, llama-cpp-python 0.3.36's build)
        f"request ({prompt_tokens} tokens) exceeds the available context size ({context_length} tokens),"
        " try increasing it"
    )
    error = {"code": 400, "message": message, "type": "exceed_context_size_error"}
    return {"error": {**error, "n_prompt_tokens": prompt_tokens, "n_ctx": context_length}}


async def _answer_request(
    config: FakeNodeConfig, state: _State, body: dict[str, Any], kind: str, slot: _Slot
) -> Response:
    if config.latency_s:
        await asyncio.sleep(config.latency_s)
    model = str(body.get("model", config.models[0]))
    prompt_tokens = _count_prompt_tokens(body)
    if kind == "embedding":
        slot.release()
        return JSONResponse(_embeddings(body, model, prompt_tokens))
    if prompt_tokens > config.context_length:  # refused as llama-server refuses it, in its shape
        slot.release()
        return JSONResponse(_too_long(prompt_tokens, config.context_length), status_code=400)
    ends = None if body.get("ignore_eos") else config.answer_words
    asked = int(
        body.get("max_tokens")
        or body.get("max_completion_tokens")
        or body.get("max_output_tokens")
        # An answer that ends of itself is bounded by the context alone (vLLM's default).
        or (config.context_length if ends else config.default_max_tokens)
    )
    n = max(0, min(asked, config.context_length - prompt_tokens))
    tokens = _text_tokens(body, n, config.continues, ends)
    finish = "stop" if len(tokens) < n else "length"  # it ended of itself, or was cut off
    n = len(tokens)
    # `n` answers, the same text each (as a greedy server gives), counted together as vLLM does.
    choices = max(1, int(body.get("n") or 1)) if kind != "responses" else 1
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n * choices,
        "total_tokens": prompt_tokens + n * choices,
    }
    prompt = body.get("prompt")
    if kind == "completion" and config.echoes and body.get("echo") is True and isinstance(prompt, str):
        tokens = [prompt, *tokens]  # the prompt first, as the text's start
    if kind == "responses":
        return _responses(config, slot, body, model, tokens, usage)
    ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:12]}"
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        include_usage = include_usage and config.usage_in_streams
        used = usage if include_usage else None
        stream = _stream(config, state, kind, ident, model, tokens, used, choices, finish)
        return StreamingResponse(_holding(slot, stream), media_type="text/event-stream")
    if config.tokens_per_s:
        await asyncio.sleep(n / config.tokens_per_s)
    slot.release()
    text = "".join(tokens)
    if kind == "chat":
        answers: list[dict[str, object]] = [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            for i in range(choices)
        ]
    else:
        answers = [
            {"index": i, "text": text, "finish_reason": finish, "logprobs": None} for i in range(choices)
        ]
    return JSONResponse(
        {
            "id": ident,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": answers,
            "usage": usage,
        }
    )


async def _holding(slot: _Slot, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    finally:
        slot.release()


async def _stream(
    config: FakeNodeConfig,
    state: _State,
    kind: str,
    ident: str,
    model: str,
    tokens: list[str],
    usage: dict[str, int] | None,
    choices: int = 1,
    finish: str = "length",
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    created = int(time.time())
    interrupted = asyncio.Event()
    state.streams.add(interrupted)
    try:
        events = _events(
            config, kind, ident, obj, created, model, tokens, usage, interrupted, choices, finish
        )
        async for event in events:
            yield event
    finally:
        state.streams.discard(interrupted)


async def _events(
    config: FakeNodeConfig,
    kind: str,
    ident: str,
    obj: str,
    created: int,
    model: str,
    tokens: list[str],
    usage: dict[str, int] | None,
    interrupted: asyncio.Event,
    choices: int = 1,
    finish: str = "length",
) -> AsyncIterator[bytes]:
    for i, token in enumerate(tokens):
        if interrupted.is_set():  # ended early: [DONE] without a finish_reason, as llama-cpp-python does
            yield b"data: [DONE]\n\n"
            return
        if config.drop_after_chunks is not None and i >= config.drop_after_chunks:
            raise ConnectionError(f"{config.name} dropped the stream on purpose")
        if config.tokens_per_s:
            await asyncio.sleep(1 / config.tokens_per_s)
        last = i == len(tokens) - 1
        for index in range(choices):  # each choice's token in an event of its own, as servers send them
            if kind == "chat":
                delta = {"content": token} if i else {"role": "assistant", "content": token}
                choice: dict[str, object] = {
                    "index": index,
                    "delta": delta,
                    "finish_reason": finish if last else None,
                }
            else:
                choice = {"index": index, "text": token, "finish_reason": finish if last else None}
            chunk = {"id": ident, "object": obj, "created": created, "model": model, "choices": [choice]}
            if usage is not None:
                chunk["usage"] = None
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    if usage is not None:
        tail = {"id": ident, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
        yield f"data: {json.dumps(tail)}\n\n".encode()
    yield b"data: [DONE]\n\n"
    if config.linger_after_done_s:
        await asyncio.sleep(config.linger_after_done_s)


def _responses(
    config: FakeNodeConfig,
    slot: _Slot,
    body: dict[str, Any],
    model: str,
    tokens: list[str],
    usage: dict[str, int],
) -> Response:
    """OpenAI's Responses API: one message of output text, usage as input and output tokens, and a
    stream of `response.*` events in the order OpenAI sends them, usage in response.completed.
    vLLM builds its events from OpenAI's SDK's own types: every event numbered, each content event
    placed by output_index and content_index (the SDK's stream helper builds the answer by them),
    whole response objects. llama.cpp's server (like("llama.cpp")) sends the same events without the
    positions and numbers, and smaller response objects, as its tools/server/server-task.cpp does."""
    llama = config.kind == "llama.cpp"
    ident, item = f"resp_{uuid.uuid4().hex[:24]}", f"msg_{uuid.uuid4().hex[:24]}"
    used: dict[str, Any] = {
        "input_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
    }
    used["total_tokens"] = usage["total_tokens"]
    used["input_tokens_details"] = {"cached_tokens": 0}
    if not llama:
        used["output_tokens_details"] = {"reasoning_tokens": 0}
    text = "".join(tokens)
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    message = {"type": "message", "id": item, "status": "completed", "role": "assistant", "content": [part]}
    created = int(time.time())

    def response(status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        whole = {"id": ident, "object": "response", "created_at": created, "status": status, "model": model}
        whole |= {"output": output, "usage": usage}
        if not llama:  # what OpenAI's Response has that llama.cpp's leaves out
            whole |= {"parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None}
            whole |= {
                "max_output_tokens": body.get("max_output_tokens"),
                "text": {"format": {"type": "text"}},
            }
        return whole

    done = response("completed", [message], used)
    if not body.get("stream"):
        slot.release()
        return JSONResponse(done)

    # Where an event's item, and its content, are; the text's logprobs (none asked for).
    at: dict[str, Any] = {} if llama else {"output_index": 0}
    within: dict[str, Any] = {} if llama else {**at, "content_index": 0}
    logprobs: dict[str, Any] = {} if llama else {"logprobs": []}
    # llama.cpp's stream begins with the response's id and status only.
    started = (
        {"id": ident, "object": "response", "status": "in_progress"}
        if llama
        else response("in_progress", [], None)
    )
    said: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
        {
            "type": "response.output_item.added",
            **at,
            "item": {**message, "status": "in_progress", "content": []},
        },
        {
            "type": "response.content_part.added",
            "item_id": item,
            **within,
            "part": {"type": "output_text", "text": ""} if llama else {**part, "text": ""},
        },
    ]
    said += [
        {"type": "response.output_text.delta", "item_id": item, **within, "delta": t, **logprobs}
        for t in tokens
    ]
    said += [
        {"type": "response.output_text.done", "item_id": item, **within, "text": text, **logprobs},
        {"type": "response.content_part.done", "item_id": item, **within, "part": part},
        {"type": "response.output_item.done", **at, "item": message},
        {"type": "response.completed", "response": done},
    ]

    async def events() -> AsyncIterator[bytes]:
        deltas = 0
        for number, event in enumerate(said):
            if event["type"] == "response.output_text.delta":
                if config.drop_after_chunks is not None and deltas >= config.drop_after_chunks:
                    raise ConnectionError(f"{config.name} dropped the stream on purpose")
                deltas += 1
                if config.tokens_per_s:
                    await asyncio.sleep(1 / config.tokens_per_s)
            if not llama:
                event["sequence_number"] = number
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

    return StreamingResponse(_holding(slot, events()), media_type="text/event-stream")


def _embeddings(body: dict[str, object], model: str, prompt_tokens: int) -> dict[str, object]:
    raw = body.get("input")
    inputs = raw if isinstance(raw, list) else [raw]
    data = []
    for i, text in enumerate(inputs):
        digest = hashlib.sha256(json.dumps(text).encode()).digest()
        vector = [(b - 128) / 128 for b in digest[:16]]
        data.append({"object": "embedding", "index": i, "embedding": vector})
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


async def _chat(request: Request) -> Response:
    return await _generate(request, "chat")


async def _completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def _embed(request: Request) -> Response:
    return await _generate(request, "embedding")


async def _respond(request: Request) -> Response:
    return await _generate(request, "responses")


class _Slot:
    """A request's place in the fake's parallelism: released once, when its answer is over."""

    def __init__(self, semaphore: asyncio.Semaphore | None) -> None:
        self.semaphore = semaphore

    def release(self) -> None:
        if self.semaphore is not None:
            self.semaphore.release()
            self.semaphore = None


@dataclass
class _State:
    streams: set[asyncio.Event] = field(default_factory=set)
    slots: asyncio.Semaphore | None = None  # made on the server's own loop, at the first request

    def interrupt(self) -> None:
        for stream in self.streams:
            stream.set()

    async def take_slot(self, parallel: int) -> _Slot:
        if not parallel:
            return _Slot(None)
        if self.slots is None:
            self.slots = asyncio.Semaphore(parallel)
        await self.slots.acquire()
        return _Slot(self.slots)


async def _identity(request: Request) -> Response:
    """The endpoint that tells which server this is, shaped like the server the fake mimics."""
    config: FakeNodeConfig = request.app.state.config
    path = request.url.path
    if config.kind == "llama.cpp" and path == "/props":
        return JSONResponse({"total_slots": config.parallel or 1, "build_info": "fake"})
    if config.kind == "llama-cpp-python" and path == "/openapi.json":
        # Its paths as the real server lists them: /v1/embeddings whether or not the model embeds.
        paths: dict[str, Any] = {
            p: {"post": {}} for p in ("/v1/completions", "/v1/embeddings", "/v1/chat/completions")
        }
        info = {"title": "🦙 llama.cpp Python API (fake)"}
        return JSONResponse({"openapi": "3.1.0", "info": info, "paths": paths})
    if config.kind == "vllm" and path == "/openapi.json":  # vLLM lists what its model's tasks allow
        served: dict[str, Any] = {f"/v1/{route}": {"post": {}} for route in config.routes}
        return JSONResponse({"openapi": "3.1.0", "info": {"title": "FastAPI"}, "paths": served})
    if config.kind == "vllm" and path == "/version":
        return JSONResponse({"version": "fake"})
    if path == "/health" and config.kind != "llama-cpp-python":
        return JSONResponse({"status": "ok"})
    return JSONResponse({"detail": "Not Found"}, 404)


async def _tokenize(request: Request) -> Response:
    """A word is a token here (the fake's answers are words), counted as each server's API has it."""
    body = await request.json()
    text = str(body.get("content") or body.get("prompt") or body.get("input") or "")
    count = len(text.split())
    if request.url.path == "/extras/tokenize/count":
        return JSONResponse({"count": count})
    if request.url.path == "/tokenize" and "content" in body:
        return JSONResponse({"tokens": list(range(count))})
    return JSONResponse({"count": count, "tokens": list(range(count))})


def create_fake_node(config: FakeNodeConfig | None = None) -> Starlette:
    config = config or FakeNodeConfig()
    app = Starlette(
        routes=[
            Route("/v1/models", _models),
            Route("/v1/chat/completions", _chat, methods=["POST"]),
            Route("/v1/completions", _completions, methods=["POST"]),
            Route("/v1/embeddings", _embed, methods=["POST"]),
            Route("/v1/responses", _respond, methods=["POST"]),
            *(Route(path, _identity) for path in ("/props", "/openapi.json", "/version", "/health")),
            Route("/tokenize", _tokenize, methods=["POST"]),
            Route("/extras/tokenize/count", _tokenize, methods=["POST"]),
        ]
    )
    app.state.config = config
    app.state.requests = 0
    app.state.fake = _State()
    return app
