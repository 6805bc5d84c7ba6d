"""The agent's way to its server, for requests from the gateway (direct mode: an HTTP front on a
port, where only requests signed by the gateway get through; tunnel mode: tunnel.py).

On the way in, a catalog model id is turned back into the name the server serves it under. On the
way out, a stream whose server sent no usage gets its exact usage added before its end (see
Backend.usage): the gateway bills tokens, never events.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from neuralgrid import signing
from neuralgrid.agent.backend import Backend
from neuralgrid.gateway.stream import SseEvents

KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class BackendUnreachable(Exception):
    """The server did not take the request (refused, reset, timed out before answering)."""


@dataclass
class Answer:
    """The server's answer as it starts: status, media type, and its body's chunks."""

    status: int
    media_type: str
    chunks: AsyncGenerator[bytes, None]


@dataclass
class FrontState:
    backend: Backend
    served_names: dict[str, str] = field(default_factory=dict)  # catalog id -> the server's name
    key: bytes | None = None  # set once registered
    inflight: int = 0
    draining: bool = False
    served: int = 0

    async def forward(self, path: str, body: bytes) -> Answer:
        """Send a gateway's request to the server; the answer's chunks end the request when consumed."""
        try:
            request: Any = json.loads(body)
        except ValueError:
            request = None
        if isinstance(request, dict) and request.get("model") in self.served_names:
            request = {**request, "model": self.served_names[request["model"]]}
            body = json.dumps(request).encode()
        self.inflight += 1
        try:
            url, headers = self.backend.url + path, {"content-type": "application/json"}
            upstream = await self.backend.http.send(
                self.backend.http.build_request("POST", url, content=body, headers=headers), stream=True
            )
        except httpx.HTTPError as err:
            self.inflight -= 1
            raise BackendUnreachable(f"the backend is unreachable: {err!r}") from err
        self.served += 1
        media = upstream.headers.get("content-type", "application/json")
        chunks: AsyncIterator[bytes] = upstream.aiter_raw()
        wants_usage = isinstance(request, dict) and _get(request, "stream_options", "include_usage") is True
        sse = upstream.status_code == 200 and media.startswith("text/event-stream")
        if path in KINDS and sse and wants_usage:
            chunks = self._with_usage(KINDS[path], request, chunks)
        return Answer(upstream.status_code, media, self._finishing(upstream, chunks))

    async def _finishing(
        self, upstream: httpx.Response, chunks: AsyncIterator[bytes]
    ) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await upstream.aclose()
            self.inflight -= 1

    async def _with_usage(
        self, kind: str, request: dict[str, Any], chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """The stream as the server sent it, plus a usage event before [DONE] if it had none."""
        events = SseEvents(keep_usage_event=True)
        async for raw in chunks:
            for event in events.feed(raw):
                if events.done and events.usage is None and event.strip().endswith(b"[DONE]"):
                    usage = await self.backend.usage(kind, request, "".join(events.text))
                    if usage is not None:
                        tail = {**events.identity, "object": _OBJECT[kind], "model": request.get("model")}
                        tail.update(choices=[], usage=usage)
                        yield b"data: " + json.dumps(tail).encode() + b"\n\n"
                yield event
        if events.buffer:
            yield events.buffer


_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}


def _get(data: Any, *path: str) -> Any:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status
    )


async def _forward(request: Request) -> Response:
    state: FrontState = request.app.state.front
    body = await request.body()
    path = request.url.path
    if state.key is None or not signing.verify(state.key, request.headers.get(signing.HEADER), path, body):
        return _error(401, "requests to this node must be signed by the NeuralGrid gateway")
    if state.draining:
        return _error(503, "this node is draining: it takes no new work")
    try:
        answer = await state.forward(path, body)
    except BackendUnreachable as err:
        return _error(502, str(err))
    return StreamingResponse(answer.chunks, status_code=answer.status, media_type=answer.media_type)


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
