"""The agent's way to its server, for requests from the gateway (direct mode: an HTTP front on a
port, where only requests signed by the gateway get through; tunnel mode: tunnel.py).

On the way in, a catalog model id is turned back into the name the server serves it under. On the
way out, a stream whose server sent no usage gets its exact usage added before its end (see
Backend.usage): the gateway bills tokens, never events.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from neuralgrid.agent.backend import Backend, dig
from neuralgrid.protocol import signing
from neuralgrid.protocol.sse import SseEvents

KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class BackendUnreachable(Exception):
    """The server did not take the request (refused, reset, timed out before answering)."""


class Answer:
    """The server's answer as it starts: status, media type, and its body's chunks. Whoever takes it
    must aclose() it, read or not: that ends the request (its slot here, its connection there)."""

    def __init__(self, state: FrontState, upstream: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
        self.state, self.upstream = state, upstream
        self.status = upstream.status_code
        self.media_type = upstream.headers.get("content-type", "application/json")
        self.chunks = chunks
        self.closed = False

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.state.inflight -= 1
            await self.upstream.aclose()


@dataclass
class FrontState:
    backend: Backend
    served_names: dict[str, str] = field(default_factory=dict)  # catalog id -> the server's name
    key: bytes | None = None  # set once registered
    signatures: signing.Verifier = field(default_factory=signing.Verifier)  # remembers nonces
    inflight: int = 0
    draining: bool = False
    served: int = 0

    async def forward(self, path: str, body: bytes) -> Answer:
        """Send a gateway's request to the server. The caller must aclose() the answer."""
        try:
            request: Any = json.loads(body)
        except ValueError:
            request = None
        catalog_id = request.get("model") if isinstance(request, dict) else None
        if isinstance(catalog_id, str) and catalog_id in self.served_names:
            request = {**request, "model": self.served_names[catalog_id]}
            body = json.dumps(request).encode()
        self.inflight += 1
        try:
            url, headers = self.backend.url + path, {"content-type": "application/json"}
            upstream = await self.backend.http.send(
                self.backend.http.build_request("POST", url, content=body, headers=headers), stream=True
            )
        except BaseException as err:  # cancelled too: the request never started here
            self.inflight -= 1
            if isinstance(err, httpx.HTTPError):
                raise BackendUnreachable(f"the backend is unreachable: {err!r}") from err
            raise
        self.served += 1
        answer = Answer(self, upstream, upstream.aiter_raw())
        served = request.get("model") if isinstance(request, dict) else None
        renamed = (served, catalog_id) if served != catalog_id else None
        sse = answer.status == 200 and answer.media_type.startswith("text/event-stream")
        wants_usage = isinstance(request, dict) and dig(request, "stream_options", "include_usage") is True
        count = path in KINDS and sse and wants_usage and _one_text_answer(request)
        if sse and (count or renamed):
            answer.chunks = self._events(KINDS.get(path, ""), request, answer.chunks, count, renamed)
        elif renamed and answer.media_type.startswith("application/json"):
            answer.chunks = _renamed_body(answer.chunks, renamed)
        return answer

    async def _events(
        self,
        kind: str,
        request: dict[str, Any],
        chunks: AsyncIterator[bytes],
        count: bool,
        renamed: tuple[Any, Any] | None,
    ) -> AsyncIterator[bytes]:
        """The stream as the server sent it, event by event, with the catalog's model name in place
        of the server's (the client never sees an owner's file path), and a usage event before
        [DONE] when the server sent none. Fails open: what cannot be read or counted passes as it came."""
        events = SseEvents(keep_usage_event=True)
        async for raw in chunks:
            for event in events.feed(raw):
                if count and events.done and events.usage is None and event.strip().endswith(b"[DONE]"):
                    counted = await self.backend.usage(kind, request, "".join(events.text))
                    if counted is not None:
                        model = renamed[1] if renamed else request.get("model")
                        tail = {**events.identity, "object": _OBJECT[kind], "model": model}
                        tail.update(choices=[], usage=counted)
                        yield b"data: " + json.dumps(tail).encode() + b"\n\n"
                yield _renamed_event(event, renamed) if renamed else event
        if events.buffer:
            yield events.buffer


def _renamed_event(event: bytes, renamed: tuple[Any, Any]) -> bytes:
    """One SSE event whose JSON data names the served model, naming the catalog's instead."""
    head, sep, data = event.partition(b"data:")
    payload = _renamed(data, renamed) if sep else None
    return event if payload is None else head + b"data: " + payload + b"\n\n"


async def _renamed_body(chunks: AsyncIterator[bytes], renamed: tuple[Any, Any]) -> AsyncIterator[bytes]:
    """A JSON answer naming the served model, naming the catalog's instead (read whole: it is small)."""
    body = b"".join([chunk async for chunk in chunks])
    yield _renamed(body, renamed) or body


def _renamed(data: bytes, renamed: tuple[Any, Any]) -> bytes | None:
    """A JSON object naming the served model, re-encoded naming the catalog's; None if it does not."""
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("model") != renamed[0]:
        return None
    return json.dumps({**payload, "model": renamed[1]}).encode()


def _one_text_answer(request: dict[str, Any]) -> bool:
    """One plain text answer, the kind whose tokens the server's tokenizer can count afterwards."""
    return request.get("n") in (None, 1) and not request.get("tools") and not request.get("echo")


class RelayedAnswer(StreamingResponse):
    """Streams an Answer to the gateway and closes it however the response ends (a gateway that
    hangs up before the first chunk included: Starlette may then never start the iterator)."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.chunks, status_code=answer.status, media_type=answer.media_type)
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.answer.aclose()


_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status
    )


async def _forward(request: Request) -> Response:
    state: FrontState = request.app.state.front
    body = await request.body()
    path = request.url.path
    header = request.headers.get(signing.HEADER)
    if state.key is None or not state.signatures.verify(state.key, header, path, body):
        return _error(401, "requests to this node must be signed by the NeuralGrid gateway")
    if state.draining:
        return _error(503, "this node is draining: it takes no new work")
    try:
        answer = await state.forward(path, body)
    except BackendUnreachable as err:
        return _error(502, str(err))
    return RelayedAnswer(answer)


async def _health(request: Request) -> Response:
    state: FrontState = request.app.state.front
    return JSONResponse({"status": "draining" if state.draining else "ok", "inflight": state.inflight})


def create_front(state: FrontState) -> Starlette:
    app = Starlette(
        routes=[
            Route("/healthz", _health),
            Route("/v1/{path:path}", _forward, methods=["POST"]),
        ]
    )
    app.state.front = state
    return app
