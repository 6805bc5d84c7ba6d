"""Node agents: registration (with an operator's API key) and heartbeats (with the node's secret)."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit
from uuid import UUID

import psycopg
from fastapi import APIRouter, Request, WebSocket
from psycopg.types.json import Jsonb
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from neuralgrid.db import errors as db_errors
from neuralgrid.gateway.deps import ApiKeyDep, Gateway, GatewayDep
from neuralgrid.gateway.errors import BadRequest, BodyTooLarge, GatewayError, NotFound, Unauthorized, invalid
from neuralgrid.gateway.routes_openai import read_json
from neuralgrid.gateway.tunnel import Tunnel
from neuralgrid.protocol import signing

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])
ModelT = TypeVar("ModelT", bound=BaseModel)
HEARTBEAT_MAX_BYTES = 64 * 1024  # a heartbeat is small; anything larger is a mistake or an attack


class Forbidden(GatewayError):
    status, type, code = 403, "invalid_request_error", "forbidden"


class BackendInfo(BaseModel):
    """What the agent found of its inference server (see neuralgrid.agent.backend.ServerInfo)."""

    model_config = ConfigDict(extra="forbid")
    kind: str = Field(min_length=1, max_length=32)
    version: str | None = Field(None, max_length=64)
    parallel: int | None = Field(None, ge=1, le=1024)
    usage_in_streams: bool = False
    continues: bool = False
    tokenize: bool = False
    interrupts: bool = False


class NodeRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100)
    gpu_model: str = Field(min_length=1, max_length=100)
    gpu_count: int = Field(1, ge=1, le=64)
    vram_gb: float = Field(gt=0)
    tflops: float = Field(gt=0)
    hourly_rate: float = Field(ge=0)
    region: str = Field(min_length=1, max_length=64)
    latitude: float | None = Field(None, ge=-90, le=90)
    longitude: float | None = Field(None, ge=-180, le=180)
    endpoint_url: str = Field(pattern=r"^(https?://\S+|tunnel:\S*)$")
    max_concurrency: int = Field(4, ge=1, le=1024)
    models: list[str] = Field(default_factory=list, max_length=1000)
    agent_version: str | None = Field(None, max_length=64)
    backend: BackendInfo | None = None


class Specs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu_model: str = Field(min_length=1, max_length=100)
    gpu_count: int = Field(ge=1, le=64)
    vram_gb: float = Field(gt=0)
    tflops: float = Field(gt=0)


class Heartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["online", "draining", "offline"] = "online"
    queue_depth: int = Field(0, ge=0)
    gpu_utilization: float | None = Field(None, ge=0, le=1)
    free_vram_gb: float | None = Field(None, ge=0)
    models: list[str] = Field(default_factory=list, max_length=1000)
    specs: Specs | None = None  # only when they changed since registration
    backend_up: bool = True  # false: the agent is alive but its inference server does not answer
    backend: BackendInfo | None = None  # only when it changed


REGISTER = """
select node_id, node_secret from public.register_node(%(owner)s, %(name)s, %(gpu_model)s, %(gpu_count)s,
  %(vram_gb)s::real, %(tflops)s::real, %(hourly_rate)s::numeric, %(region)s, %(latitude)s::float8,
  %(longitude)s::float8, %(endpoint_url)s, %(max_concurrency)s, %(models)s::text[], %(agent_version)s,
  %(key)s, %(backend)s::jsonb)
"""
HEARTBEAT = """
select public.agent_heartbeat(%s, %s, %s, %s, %s::real, %s::real, %s::text[], %s::jsonb, %s, %s::jsonb)
"""
INTERVAL = "select heartbeat_interval_s from public.platform_settings"


@router.post("", status_code=201)
async def register(request: Request, key: ApiKeyDep, gateway: GatewayDep) -> dict[str, Any]:
    """Registers the caller's node (or re-registers it by name) and returns its secret, once."""
    node = _validated(NodeRegistration, await read_json(request, HEARTBEAT_MAX_BYTES))
    if not gateway.settings.private_endpoints_allowed and _is_private(node.endpoint_url):
        raise BadRequest(
            "endpoint_url points at a private or loopback address; use --tunnel behind NAT",
            param="endpoint_url",
        )
    params = {**node.model_dump(), "owner": key.owner_id, "key": key.id, "backend": _jsonb(node.backend)}
    try:
        async with gateway.pool.connection() as conn:
            row = await (await conn.execute(REGISTER, params)).fetchone()
            interval = await (await conn.execute(INTERVAL)).fetchone()
    except psycopg.Error as err:
        raise _translated(err) from err
    assert row is not None and interval is not None
    return {"node_id": row[0], "node_secret": row[1], "heartbeat_interval_s": interval[0]}


@router.post("/{node_id}/heartbeat")
async def heartbeat(node_id: UUID, request: Request, gateway: GatewayDep) -> dict[str, Any]:
    """A heartbeat from the node's agent, signed in with the node's secret."""
    header = request.headers.get("authorization") or ""
    if not header.lower().startswith("bearer "):
        raise Unauthorized("send the node's secret: 'Authorization: Bearer <node secret>'")
    try:
        body = await read_json(request, HEARTBEAT_MAX_BYTES)
    except BodyTooLarge:
        raise BodyTooLarge(f"a heartbeat is at most {HEARTBEAT_MAX_BYTES} bytes") from None
    beat = _validated(Heartbeat, body)
    params = (
        node_id,
        signing.node_key(header[7:].strip()),
        beat.status,
        beat.queue_depth,
        beat.gpu_utilization,
        beat.free_vram_gb,
        beat.models,
        _jsonb(beat.specs),
        beat.backend_up,
        _jsonb(beat.backend),
    )
    try:
        async with gateway.pool.connection() as conn:
            row = await (await conn.execute(HEARTBEAT, params)).fetchone()
    except psycopg.Error as err:
        raise _translated(err) from err
    assert row is not None
    return {"node_id": node_id, "status": row[0]}


def _jsonb(model: BaseModel | None) -> Jsonb | None:
    return None if model is None else Jsonb(model.model_dump())


def _validated(schema: type[ModelT], body: dict[str, Any]) -> ModelT:
    try:
        return schema.model_validate(body)
    except ValidationError as err:
        raise invalid(err.errors()) from err


def _is_private(endpoint_url: str) -> bool:
    """True for loopback, private and link-local hosts (literal addresses and localhost)."""
    if endpoint_url.startswith("tunnel:"):
        return False
    host = (urlsplit(endpoint_url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: resolved by the gateway at request time (see README, limits)
    return address.is_private or address.is_loopback or address.is_link_local or address.is_unspecified


def _translated(err: psycopg.Error) -> Exception:
    if err.sqlstate == "42501":  # insufficient_privilege: the secret is another node's, or wrong
        return Forbidden(str(err.diag.message_primary))
    domain = db_errors.translate(err)
    if isinstance(domain, db_errors.UnknownModel):  # no_data_found: no such node
        return NotFound(str(domain), param="node_id")
    if isinstance(domain, db_errors.DatabaseError):
        return BadRequest(str(domain))
    return err


@router.websocket("/{node_id}/tunnel")
async def tunnel(websocket: WebSocket, node_id: UUID) -> None:
    """An agent behind NAT dials in; requests for its node then travel over this socket. The node is
    online while the socket is up, and offline the moment it drops."""
    gateway: Gateway = websocket.app.state.gateway
    header = websocket.headers.get("authorization") or ""
    key = signing.node_key(header[7:].strip()) if header.lower().startswith("bearer ") else b""
    async with gateway.pool.connection() as conn:
        row = await (
            await conn.execute("select secret_hash from public.nodes where id = %s", (node_id,))
        ).fetchone()
    if row is None or row[0] is None or not hmac.compare_digest(bytes(row[0]), key):
        await websocket.close(code=4403, reason="not this node's secret")
        return
    await websocket.accept()
    link = Tunnel(node_id, websocket)
    gateway.tunnels.by_node[node_id] = link
    try:
        async with gateway.pool.connection() as conn:
            await conn.execute(SET_TUNNEL, (node_id, True))
        await link.read()
    finally:
        if gateway.tunnels.by_node.get(node_id) is link:
            del gateway.tunnels.by_node[node_id]
            async with gateway.pool.connection() as conn:
                await conn.execute(SET_TUNNEL, (node_id, False))


SET_TUNNEL = "select public.set_tunnel(%s, %s)"
