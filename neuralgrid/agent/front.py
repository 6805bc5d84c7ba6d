"""The agent's HTTP front in direct mode: only requests signed by the gateway reach the backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from neuralgrid import signing


@dataclass
class FrontState:
    backend_url: str
    key: bytes | None = None  # set once registered
    inflight: int = 0
    draining: bool = False
    served: int = 0
    http: httpx.AsyncClient = field(
        default_factory=lambda: httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5))
    )


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
    state.inflight += 1
    try:
        upstream = await state.http.send(
            state.http.build_request(
                "POST",
                state.backend_url.rstrip("/") + path,
                content=body,
                headers={"content-type": "application/json"},
            ),
            stream=True,
        )
    except httpx.HTTPError as err:
        state.inflight -= 1
        return _error(502, f"the backend is unreachable: {err}")
    state.served += 1
    media = upstream.headers.get("content-type", "application/json")
    return StreamingResponse(_relay(state, upstream), status_code=upstream.status_code, media_type=media)


async def _relay(state: FrontState, upstream: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        state.inflight -= 1


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
