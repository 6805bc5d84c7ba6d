"""FastAPI's dependencies, every route's: the app's services, the caller's API key, the signed-in
user. The one module between the routes and what they use, so nothing below it imports FastAPI's
wiring and nothing it imports imports a route (tests/unit/test_layers.py holds the layers).

Here rather than in gateway/: the gateway's, the web pages' and Realtime's routes all take these, and
they unwrap the services server/app.py assembles."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from starlette.requests import HTTPConnection

from neuralgrid.gateway.auth import ApiKey, verify_user
from neuralgrid.server.services import Services


async def get_services(connection: HTTPConnection) -> Services:
    """The app's services, for HTTP requests and websockets alike. A coroutine, though it awaits
    nothing: FastAPI runs a plain function dependency in its thread pool, a handoff per request."""
    services: Services = connection.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def api_key(request: Request, services: ServicesDep) -> ApiKey:
    """The caller's API key (developers, and operators registering nodes)."""
    return await services.keys.authenticate(request.headers.get("authorization"))


async def authenticated(request: Request) -> tuple[Services, ApiKey]:
    """The services and the caller's API key, for the routes every inference request takes: the
    same as the two dependencies above, without FastAPI solving them (a tenth of such a request's
    CPU in the gateway, measured under load)."""
    services: Services = request.app.state.services
    return services, await services.keys.authenticate(request.headers.get("authorization"))


ApiKeyDep = Annotated[ApiKey, Depends(api_key)]


async def user_claims(request: Request, services: ServicesDep) -> dict[str, Any]:
    """The claims of a signed-in user's access token (gateway/auth.py verifies it)."""
    return await verify_user(request.headers.get("authorization"), services.tokens)


UserDep = Annotated[dict[str, Any], Depends(user_claims)]
