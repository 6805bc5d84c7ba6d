"""The app's own ASGI layers: Timing around every request, and the direct way in for the routes every
inference request takes.

FastAPI reaches an endpoint through a dozen layers: its middleware, its router's matching, its
dependency solving, each wrapping the response's `send`. Under load they were a fifth of the
gateway's CPU per request (a profile of `bench gateway` at 16 callers, 2026-12-04). An inference
route needs none of them: its endpoint takes the request alone and reads its own body. `App` serves
such routes directly: Timing, the endpoint, and the app's own exception handlers, looked up as
Starlette looks them up. They stay FastAPI routes (the OpenAPI document; a GET on one is FastAPI's
405), and a route whose endpoint needs anything solved is left to FastAPI. A node's heartbeat is
served so too (a path with its node's id, which the endpoint reads itself): in a profile of `bench
heartbeats` FastAPI's layers were more than half the gateway's CPU a beat, 2026-12-06.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute, APIRouter
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuralgrid.gateway.metrics import Metrics


class Timing:
    """Pure ASGI middleware: stamps arrival time (for the overhead header) and counts responses by
    route template (`/v1/nodes/{node_id}/heartbeat`), never by raw path: a scanner's paths must not
    each become a series."""

    def __init__(self, app: ASGIApp, metrics: list[Metrics]) -> None:
        self.app = app
        self.metrics = metrics  # filled by the lifespan

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = time.perf_counter()
        scope.setdefault("state", {})["received"] = received

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start" and self.metrics:
                route = scope.get("route")  # set by the router once a route matched
                endpoint = getattr(route, "path", None) or "unmatched"
                metrics = self.metrics[0]
                metrics.child(metrics.requests, endpoint, str(message["status"])).inc()
                metrics.child(metrics.latency, endpoint).observe(time.perf_counter() - received)
            await send(message)

        await self.app(scope, receive, counted)


def direct(route: APIRoute) -> bool:
    """Whether FastAPI has nothing to do for the route's endpoint but hand it the request: a
    coroutine of the request alone, which returns its Response."""
    needs = route.dependant
    solved = needs.dependencies or needs.path_params or needs.query_params or needs.header_params
    more = needs.response_param_name or needs.background_tasks_param_name or needs.security_scopes_param_name
    alone = len(inspect.signature(route.endpoint).parameters) == 1 and needs.request_param_name is not None
    coroutine = inspect.iscoroutinefunction(route.endpoint)
    return alone and coroutine and not (solved or more or needs.cookie_params or needs.body_params)


class App(FastAPI):
    """FastAPI, serving its direct routes (`serve_directly()`) ahead of its own layers."""

    def __init__(self, *, metrics: list[Metrics], **options: Any) -> None:
        super().__init__(**options)
        self.add_middleware(Timing, metrics=metrics)
        self._direct: dict[str, APIRoute] = {}  # POST path -> route
        self._templated: list[APIRoute] = []  # those whose paths have parameters, matched in order
        self._timed = Timing(self._serve, metrics)

    def serve_directly(self, router: APIRouter) -> None:
        """Include `router` (as it is: no dependencies or prefix added), and serve its POST routes
        that take the request alone directly, while nothing else would wrap them: no dependency of
        the app's, no middleware but Timing. They are matched ahead of every other route: no route
        included before them may take their paths (a POST catch-all would be passed over)."""
        self.include_router(router)
        for route in router.routes:
            if isinstance(route, APIRoute) and "POST" in (route.methods or ()) and direct(route):
                if route.param_convertors:
                    self._templated.append(route)
                else:
                    self._direct[route.path] = route

    def _plain(self) -> bool:
        """Nothing the app adds would wrap a route: no dependency of its own, no middleware but Timing."""
        return not self.router.dependencies and len(self.user_middleware) == 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and self._plain()
        ):
            route = self._direct.get(scope["path"]) or self._matched(scope)
            if route is not None:
                scope["app"], scope["route"] = self, route
                await self._timed(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _matched(self, scope: Scope) -> APIRoute | None:
        """The direct route with parameters in its path that the request's path matches, its
        parameters in the scope (as Starlette's router leaves them: converted)."""
        for route in self._templated:
            found = route.path_regex.match(scope["path"])
            if found is not None:
                said, convert = found.groupdict(), route.param_convertors
                scope["path_params"] = {name: convert[name].convert(value) for name, value in said.items()}
                return route
        return None

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response: Response = await scope["route"].endpoint(request)
        except Exception as err:
            # As Starlette: a handled error is answered; anything else gets the app's 500 handler's
            # answer and goes on up, for the server to log.
            handled = self._handler(err)
            if handled is not None:
                response = await handled(request, err)
            else:
                last: Any = self.exception_handlers.get(Exception) or self.exception_handlers.get(500)
                if last is not None:
                    answer: Response = await last(request, err)
                    await answer(scope, receive, send)
                raise
        await response(scope, receive, send)

    def _handler(self, err: Exception) -> Any:
        """The app's handler for the error's class or the nearest it derives from (not Exception's)."""
        for cls in type(err).__mro__:
            if cls is Exception:
                return None
            if cls in self.exception_handlers:
                return self.exception_handlers[cls]
        return None
