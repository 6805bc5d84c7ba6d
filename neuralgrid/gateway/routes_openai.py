"""The OpenAI-compatible API: models, chat, completions, embeddings, and a key's usage."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from neuralgrid.db import queries as q
from neuralgrid.gateway.auth import ApiKeyDep
from neuralgrid.gateway.errors import BadRequest, BodyTooLarge, ClientGone, RequestTimeout, invalid
from neuralgrid.gateway.pipeline import Call
from neuralgrid.gateway.schema import END_USER, SCHEMAS
from neuralgrid.protocol import wire_json
from neuralgrid.server.services import ServicesDep

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
async def list_models(key: ApiKeyDep, services: ServicesDep) -> dict[str, Any]:
    """Models servable now (held by online nodes) and the catalog's."""
    data = [
        {
            "id": m.id,
            "object": "model",
            "created": 0,
            "owned_by": "neuralgrid",
            "online_nodes": m.online_nodes,
            "in_catalog": m.in_catalog,
        }
        for m in await services.store.all(q.MODELS)
    ]
    return {"object": "list", "data": data}


@router.post("/chat/completions")
async def chat_completions(request: Request, key: ApiKeyDep, services: ServicesDep) -> Response:
    return await _proxy(request, key, services, "chat")


@router.post("/completions")
async def completions(request: Request, key: ApiKeyDep, services: ServicesDep) -> Response:
    return await _proxy(request, key, services, "completion")


@router.post("/embeddings")
async def embeddings(request: Request, key: ApiKeyDep, services: ServicesDep) -> Response:
    return await _proxy(request, key, services, "embedding")


@router.get("/usage")
async def usage(
    key: ApiKeyDep, services: ServicesDep, user: Annotated[str | None, Query(**END_USER)] = None
) -> dict[str, Any]:
    """This key's totals: requests, tokens, cost, and what is left of its budget; with `user`, the
    requests, tokens and cost of that end user's requests (the `user` field they were sent with)."""
    row = await services.store.get(q.KEY_USAGE, {"key": key.id, "user": user})
    budget = float(key.budget_usd) if key.budget_usd is not None else None
    return {
        "object": "usage",
        "user": user,
        "key": {"id": str(key.id), "name": key.name, "rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit},
        "requests": row.requests,
        "succeeded": row.succeeded,
        "failed": row.failed,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "cost_usd": row.cost_usd,
        "budget_usd": budget,
        "spent_usd": row.spent_usd,
        "held_usd": row.held_usd,
        "remaining_usd": None if budget is None else max(budget - row.spent_usd, 0.0),
    }


async def _proxy(request: Request, key: ApiKeyDep, services: ServicesDep, kind: str) -> Response:
    settings = services.settings
    body = await read_json(request, settings.max_body_bytes, settings.body_timeout_s)
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
    return await services.pipeline.handle(call)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body's bytes: at most `limit`, all of it within `timeout_s`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body is over the {limit}-byte limit")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"the request body is over the {limit}-byte limit")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise ClientGone("the client closed the connection before its request body arrived") from None
    return b"".join(chunks)


async def read_json(request: Request, limit: int, timeout_s: float) -> dict[str, Any]:
    """The body as a JSON object: at most `limit` bytes, all of it within `timeout_s`."""
    raw = await read_body(request, limit, timeout_s)
    try:
        body = wire_json.loads(raw)
    except ValueError as err:
        raise BadRequest(f"the request body is not valid JSON: {err}") from err
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise BadRequest("the request body has a \\u escape that is half a character (a lone surrogate)")
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


# \ud800-\udfff: half of a UTF-16 pair. Pairs (emoji, escaped) are common and fine; one alone is no
# character at all, and neither UTF-8 nor Postgres can hold it.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(body: Any) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False
