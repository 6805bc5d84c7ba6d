"""The OpenAI-compatible API: models, chat, completions, embeddings, and a key's usage."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import Response

from neuralgrid.gateway.deps import ApiKeyDep, GatewayDep
from neuralgrid.gateway.errors import BadRequest, BodyTooLarge, invalid
from neuralgrid.gateway.proxy import Call
from neuralgrid.gateway.schema import SCHEMAS

router = APIRouter(prefix="/v1", tags=["openai"])


MODELS = """
select m.id, count(n.id) as online_nodes, bool_or(c.id is not null) as in_catalog
from (select id from public.models union select model_id from public.node_models) m (id)
left join public.models c on c.id = m.id
left join public.node_models nm on nm.model_id = m.id
left join public.nodes n on n.id = nm.node_id and n.status in ('online', 'busy')
group by m.id order by m.id
"""

USAGE = """
select count(*), count(*) filter (where status = 'succeeded'), count(*) filter (where status = 'failed'),
       coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0),
       coalesce(sum(cost_usd), 0)::float8
from public.jobs where api_key_id = %s
"""


@router.get("/models")
async def list_models(key: ApiKeyDep, gateway: GatewayDep) -> dict[str, Any]:
    """Models servable now (held by online nodes) and the catalog's."""
    async with gateway.pool.connection() as conn:
        rows = await (await conn.execute(MODELS)).fetchall()
    data = [
        {
            "id": r[0],
            "object": "model",
            "created": 0,
            "owned_by": "neuralgrid",
            "online_nodes": r[1],
            "in_catalog": r[2],
        }
        for r in rows
    ]
    return {"object": "list", "data": data}


@router.post("/chat/completions")
async def chat_completions(request: Request, key: ApiKeyDep, gateway: GatewayDep) -> Response:
    return await _proxy(request, key, gateway, "chat")


@router.post("/completions")
async def completions(request: Request, key: ApiKeyDep, gateway: GatewayDep) -> Response:
    return await _proxy(request, key, gateway, "completion")


@router.post("/embeddings")
async def embeddings(request: Request, key: ApiKeyDep, gateway: GatewayDep) -> Response:
    return await _proxy(request, key, gateway, "embedding")


@router.get("/usage")
async def usage(key: ApiKeyDep, gateway: GatewayDep) -> dict[str, Any]:
    """This key's totals: requests, tokens, cost, and what is left of its budget."""
    async with gateway.pool.connection() as conn:
        row = await (await conn.execute(USAGE, (key.id,))).fetchone()
        spent = await (
            await conn.execute(
                "select spent_usd::float8, reserved_usd::float8 from public.api_keys where id = %s", (key.id,)
            )
        ).fetchone()
    assert row is not None and spent is not None
    budget = float(key.budget_usd) if key.budget_usd is not None else None
    return {
        "object": "usage",
        "key": {"id": str(key.id), "name": key.name, "rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit},
        "requests": row[0],
        "succeeded": row[1],
        "failed": row[2],
        "prompt_tokens": row[3],
        "completion_tokens": row[4],
        "cost_usd": row[5],
        "budget_usd": budget,
        "spent_usd": spent[0],
        "held_usd": spent[1],
        "remaining_usd": None if budget is None else max(budget - spent[0], 0.0),
    }


async def _proxy(request: Request, key: ApiKeyDep, gateway: GatewayDep, kind: str) -> Response:
    body = await read_json(request, gateway.settings.max_body_bytes)
    try:
        SCHEMAS[kind].model_validate(body)
    except ValidationError as err:
        raise invalid(err.errors()) from err
    max_price = request.headers.get("x-neuralgrid-max-price")
    try:
        max_rate = float(max_price) if max_price else None
    except ValueError:
        raise BadRequest("x-neuralgrid-max-price must be a number of USD per hour") from None
    if max_rate is not None and max_rate < 0:
        raise BadRequest("x-neuralgrid-max-price must not be negative")
    call = Call(
        kind=kind,
        body=body,
        key=key,
        region=request.headers.get("x-neuralgrid-region") or None,
        max_hourly_rate=max_rate,
        policy=request.headers.get("x-neuralgrid-policy") or "balanced",
        received=request.scope.get("state", {}).get("received", time.perf_counter()),
    )
    return await gateway.router.handle(call)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body is over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the request body is over the {limit}-byte limit")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks), parse_constant=_not_json)
    except ValueError as err:
        raise BadRequest(f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _not_json(constant: str) -> Any:
    """NaN and Infinity: Python reads them, JSON has no such numbers, and nodes would choke on them."""
    raise ValueError(f"{constant} is not a JSON number")
