"""FastAPI dependencies: the gateway's shared parts, the caller's API key, a Supabase user."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import jwt
from fastapi import Depends, Request
from psycopg_pool import AsyncConnectionPool

from neuralgrid.gateway.auth import ApiKey, KeyStore
from neuralgrid.gateway.errors import Unauthorized
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.proxy import Router
from neuralgrid.gateway.tunnel import Tunnels
from neuralgrid.server.settings import Settings


@dataclass(frozen=True)
class Gateway:
    """What the routes share; built once in the app's lifespan."""

    settings: Settings
    pool: AsyncConnectionPool
    keys: KeyStore
    router: Router
    metrics: Metrics
    tunnels: Tunnels


async def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


async def get_api_key(request: Request, gateway: GatewayDep) -> ApiKey:
    return await gateway.keys.authenticate(request.headers.get("authorization"))


ApiKeyDep = Annotated[ApiKey, Depends(get_api_key)]


async def get_user_claims(request: Request, gateway: GatewayDep) -> dict[str, Any]:
    """A Supabase user's JWT (HS256, the project's JWT secret), as Supabase Auth issues it."""
    header = request.headers.get("authorization") or ""
    if not header.lower().startswith("bearer "):
        raise Unauthorized("sign in: send 'Authorization: Bearer <Supabase access token>'")
    try:
        claims: dict[str, Any] = jwt.decode(
            header[7:].strip(), gateway.settings.jwt_secret, algorithms=["HS256"], audience="authenticated"
        )
    except jwt.PyJWTError as err:
        raise Unauthorized(f"invalid access token: {err}") from err
    if claims.get("role") != "authenticated" or not claims.get("sub"):
        raise Unauthorized("the access token is not a signed-in user's")
    return claims


UserDep = Annotated[dict[str, Any], Depends(get_user_claims)]
