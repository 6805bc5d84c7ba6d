"""Node agents: registration (with an operator's API key) and heartbeats (with the node's secret)."""

from __future__ import annotations

import hmac
from typing import Any, TypeVar
from uuid import UUID

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from psycopg.types.json import Jsonb
from pydantic import BaseModel, TypeAdapter, ValidationError

from neuralgrid.db import queries as q
from neuralgrid.gateway.body import read_json
from neuralgrid.gateway.endpoints import PrivateEndpoint, check_endpoint
from neuralgrid.gateway.errors import BadRequest, BodyTooLarge, Unauthorized, invalid
from neuralgrid.gateway.tunnel import Tunnel
from neuralgrid.protocol import signing
from neuralgrid.protocol.nodes import Heartbeat, NodeRegistration
from neuralgrid.protocol.tunnel import FLOW, FLOW_HEADER
from neuralgrid.server.deps import ApiKeyDep, ServicesDep, get_services

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])
ModelT = TypeVar("ModelT", bound=BaseModel)
HEARTBEAT_MAX_BYTES = 64 * 1024  # a heartbeat is small; anything larger is a mistake or an attack
_UUID = TypeAdapter(UUID)
# The heartbeat's path parameter and answer in the OpenAPI document (its endpoint reads them itself).
NODE_ID = {
    "name": "node_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "format": "uuid", "title": "Node Id"},
}
BEAT_REPLY: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The node's status, and the models it should pre-load now (none or one)",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["node_id", "status", "load"],
                    "properties": {
                        "node_id": {"type": "string", "format": "uuid"},
                        "status": {"type": "string"},
                        "load": {"type": "array", "items": {"type": "string"}},
                    },
                }
            }
        },
    }
}


@router.post("", status_code=201)
async def register(request: Request, key: ApiKeyDep, services: ServicesDep) -> dict[str, Any]:
    """Registers the caller's node (or re-registers it by name) and returns its secret, once."""
    node = _validated(
        NodeRegistration, await read_json(request, HEARTBEAT_MAX_BYTES, services.settings.body_timeout_s)
    )
    if not services.settings.private_endpoints_allowed:
        try:
            await check_endpoint(node.endpoint_url)
        except PrivateEndpoint as err:
            raise BadRequest(
                f"endpoint_url must be a public address ({err}); behind NAT, use --tunnel",
                param="endpoint_url",
            ) from None
    params = {**node.model_dump(), "owner": key.owner_id, "key": key.id, "backend": _jsonb(node.backend)}
    row = await services.store.get(q.REGISTER_NODE, params)
    interval = await services.store.get(q.HEARTBEAT_INTERVAL)
    # What the gateways sign this node's requests with: the agent checks each one with it.
    platform = services.settings.platform_key(signing.REQUEST_KEYS)
    request_key = signing.request_key(platform, signing.node_key(row.node_secret))
    return {
        "node_id": row.node_id,
        "node_secret": row.node_secret,
        "request_key": request_key.hex(),
        "heartbeat_interval_s": interval,
    }


@router.post("/{node_id}/heartbeat", openapi_extra={"parameters": [NODE_ID]}, responses=BEAT_REPLY)
async def heartbeat(request: Request) -> Response:
    """A heartbeat from the node's agent, signed in with the node's secret."""
    # The request alone, served without FastAPI's layers (server/asgi.py): every node beats.
    services = await get_services(request)
    node_id = _node_id(request.path_params["node_id"])
    header = request.headers.get("authorization") or ""
    if not header.lower().startswith("bearer "):
        raise Unauthorized("send the node's secret: 'Authorization: Bearer <node secret>'")
    try:
        body = await read_json(request, HEARTBEAT_MAX_BYTES, services.settings.body_timeout_s)
    except BodyTooLarge:
        raise BodyTooLarge(f"a heartbeat is at most {HEARTBEAT_MAX_BYTES} bytes") from None
    beat = _validated(Heartbeat, body)
    # Refused at once (secret, node); else written in the gateway's next batch, and answered at once
    # when it repeats the node's last beat, else once written (gateway/heartbeats.py).
    reply = await services.heartbeats.beat(node_id, signing.node_key(header[7:].strip()), beat)
    # `load`: the models the node should pre-load now (none or one); agents before pre-warm ignore it.
    return JSONResponse({"node_id": str(node_id), "status": reply.status, "load": reply.load})


def _node_id(said: str) -> UUID:
    """The path's node id, refused as FastAPI refuses a path parameter that is not a UUID."""
    try:
        return _UUID.validate_python(said)
    except ValidationError as err:
        raise invalid([{**e, "loc": ("path", "node_id", *e["loc"])} for e in err.errors()]) from None


def _jsonb(model: BaseModel | None) -> Jsonb | None:
    return None if model is None else Jsonb(model.model_dump())


def _validated(schema: type[ModelT], body: dict[str, Any]) -> ModelT:
    try:
        return schema.model_validate(body)
    except ValidationError as err:
        raise invalid(err.errors()) from err


@router.websocket("/{node_id}/tunnel")
async def tunnel(websocket: WebSocket, node_id: UUID, services: ServicesDep) -> None:
    """An agent behind NAT dials in; requests for its node then travel over this socket, whichever
    gateway places them. The node is online while the socket is up, and offline the moment it drops
    (unless the agent has dialled again meanwhile)."""
    header = websocket.headers.get("authorization") or ""
    key = signing.node_key(header[7:].strip()) if header.lower().startswith("bearer ") else b""
    secret_hash = await services.store.one(q.NODE_SECRET_HASH, (node_id,))
    if secret_hash is None or not hmac.compare_digest(bytes(secret_hash), key):
        await websocket.close(code=4403, reason="not this node's secret")
        return
    await websocket.accept(headers=[(FLOW_HEADER.encode(), FLOW.encode())])
    link = Tunnel(node_id, websocket, windowed=websocket.headers.get(FLOW_HEADER) == FLOW)
    services.tunnels.attach(link)
    try:
        # Recorded as this gateway's: the others forward the node's requests here (gateway/forward.py).
        await services.store.one(q.ATTACH_TUNNEL, (node_id, services.tunnels.gateway_id, link.socket_id))
        await link.read()
    finally:
        services.tunnels.detach(link)
        # Offline only if no newer socket (here or at another gateway) carries the node now.
        await services.store.one(q.DETACH_TUNNEL, (node_id, link.socket_id))
