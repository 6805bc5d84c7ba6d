"""The inference routes are served straight from ASGI (server/asgi.py): only routes FastAPI would
merely hand the request to, and only while nothing the app adds would wrap them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Depends, Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from neuralgrid.gateway import routes_nodes, routes_openai
from neuralgrid.server.asgi import App, direct


def _marked(tag: str) -> Any:
    def dependency(request: Request) -> None:
        request.state.tag = tag

    return Depends(dependency)


class TagMiddleware:
    def __init__(self, app: object) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})["tag"] = "middleware"
        await self.app(scope, receive, send)  # type: ignore[operator]


router = APIRouter()


@router.post("/alone")
async def alone(request: Request) -> Response:
    return PlainTextResponse(getattr(request.state, "tag", "direct"))


@router.post("/with-a-dependency", dependencies=[_marked("solved")])
async def with_a_dependency(request: Request) -> Response:
    return PlainTextResponse(request.state.tag)


@router.post("/items/{item_id}/alone")
async def item_alone(request: Request) -> Response:
    """Says who served it (Starlette's router leaves itself in the scope) and the item it names."""
    via = "routed" if "router" in request.scope else "direct"
    return PlainTextResponse(f"{getattr(request.state, 'tag', via)} {request.path_params['item_id']}")


@router.post("/sync")
def sync(request: Request) -> Response:
    return PlainTextResponse("sync")


def test_the_inference_routes_are_direct_and_routes_needing_fastapi_are_not() -> None:
    routes: dict[str, Any] = {getattr(route, "path", ""): route for route in router.routes}
    assert direct(routes["/alone"])
    assert not direct(routes["/with-a-dependency"])
    assert not direct(routes["/sync"])
    assert direct(routes["/items/{item_id}/alone"])
    served = [r for r in routes_openai.router.routes if "POST" in getattr(r, "methods", ())]
    assert served and all(direct(r) for r in served)  # type: ignore[arg-type]
    # Every node beats: FastAPI's layers were more than half the gateway's CPU a beat.
    beat = next(r for r in routes_nodes.router.routes if getattr(r, "path", "").endswith("/heartbeat"))
    assert direct(beat)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_dependency_or_middleware_the_app_adds_sends_every_route_through_fastapi() -> None:
    app = App(metrics=[])
    app.serve_directly(router)
    guarded = App(metrics=[], dependencies=[_marked("the app's")])
    guarded.serve_directly(router)
    wrapped = App(metrics=[])
    wrapped.add_middleware(TagMiddleware)
    wrapped.serve_directly(router)

    async def post(path: str, app: App = app) -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            answer = await client.post(path)
        assert answer.status_code == 200, answer.text
        return answer.text

    assert await post("/alone") == "direct"
    assert await post("/items/42/alone") == "direct 42"  # its path's parameters, as the router's
    assert await post("/items/42/alone", wrapped) == "middleware 42"
    assert await post("/with-a-dependency") == "solved"
    assert await post("/sync") == "sync"
    assert await post("/alone", guarded) == "the app's"
    assert await post("/alone", wrapped) == "middleware"
    assert await post("/items/42/alone", guarded) == "the app's 42"
