"""The OpenAI-compatible API: models, chat, completions, embeddings, responses, rerank and score,
audio (transcriptions, translations, speech), and a key's usage. Every request but the models' goes
through the pipeline to a node that serves its route."""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import TypeAdapter, ValidationError
from starlette.responses import Response
from starlette.types import Receive

from neuralgrid.db import queries as q
from neuralgrid.gateway.body import read_body, read_json
from neuralgrid.gateway.errors import BadRequest, ModelNotFound, invalid
from neuralgrid.gateway.pipeline import Call
from neuralgrid.gateway.pipeline.kinds import ROUTES, SERVED_BY
from neuralgrid.gateway.schema import (
    END_USER,
    SCHEMAS,
    AudioForm,
    FormError,
    ModelId,
    PassthroughRefused,
    check_passthrough,
    read_audio_form,
)
from neuralgrid.server.deps import ApiKeyDep, ServicesDep, authenticated

_MODEL_ID: TypeAdapter[str] = TypeAdapter(ModelId)


def _json_body(kind: str) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its own JSON (its schema has no $defs)."""
    schema = SCHEMAS[kind].model_json_schema()
    assert "$defs" not in schema, f"{kind}'s schema must be self-contained"
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _form_schema() -> dict[str, Any]:
    schema = AudioForm.model_json_schema()
    schema["properties"] = {"file": {"type": "string", "format": "binary"}, **schema["properties"]}
    schema["required"] = ["file", *schema.get("required", [])]
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


_AUDIO_FORM = _form_schema()

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
async def list_models(key: ApiKeyDep, services: ServicesDep) -> dict[str, Any]:
    """Models servable now (held by online nodes) and the catalog's."""
    return {"object": "list", "data": [_model(m) for m in await services.store.all(q.MODELS)]}


def _model(row: Any) -> dict[str, Any]:
    """OpenAI's model object, with how many online nodes hold it and whether the catalog has it."""
    return {
        "id": row.id,
        "object": "model",
        "created": row.created,
        "owned_by": "neuralgrid",
        "online_nodes": row.online_nodes,
        "in_catalog": row.in_catalog,
    }


@router.get("/models/{model:path}")
async def retrieve_model(model: str, key: ApiKeyDep, services: ServicesDep) -> dict[str, Any]:
    """One model: the catalog's or held by some node, with the routes its online nodes serve."""
    try:
        _MODEL_ID.validate_python(model)
    except ValidationError:
        raise ModelNotFound(f"the model {model[:256]!r} does not exist", param="model") from None
    row = await services.store.one(q.MODEL, {"model": model})
    if row is None:
        raise ModelNotFound(f"the model {model!r} does not exist", param="model")
    # A catalog model is served on its kind's routes only (admission refuses the others).
    served = {ROUTES[kind] for kind in SERVED_BY.get(row.kind or "", ROUTES.keys())}
    return {
        **_model(row),
        "kind": row.kind,
        "routes": [f"/v1/{route}" for route in row.routes if route in served],
    }


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _proxy(request, "chat")


@router.post("/completions")
async def completions(request: Request) -> Response:
    return await _proxy(request, "completion")


@router.post("/embeddings")
async def embeddings(request: Request) -> Response:
    return await _proxy(request, "embedding")


@router.post("/responses", openapi_extra=_json_body("responses"))
async def responses(request: Request) -> Response:
    """OpenAI's Responses API, streamed (response.* events) or not; stateless (no stored responses)."""
    return await _proxy(request, "responses")


@router.post("/rerank", openapi_extra=_json_body("rerank"))
async def rerank(request: Request) -> Response:
    """vLLM's and llama.cpp's rerank: the documents ordered by relevance to the query."""
    return await _proxy(request, "rerank")


@router.post("/score", openapi_extra=_json_body("score"))
async def score(request: Request) -> Response:
    """vLLM's score: a relevance score for each pair of texts."""
    return await _proxy(request, "score")


@router.post("/audio/transcriptions", openapi_extra=_AUDIO_FORM)
async def transcriptions(request: Request) -> Response:
    """The audio's text (multipart/form-data: `file` and `model`), passed to the node as it came."""
    return await _upload(request, "transcription")


@router.post("/audio/translations", openapi_extra=_AUDIO_FORM)
async def translations(request: Request) -> Response:
    """The audio's text in English (multipart/form-data: `file` and `model`)."""
    return await _upload(request, "translation")


@router.post("/audio/speech", openapi_extra=_json_body("speech"))
async def speech(request: Request) -> Response:
    """Text to speech: the node's audio bytes, with its content type."""
    return await _proxy(request, "speech")


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
        "cancelled": row.cancelled,  # the client left, or the node refused the request as the client's
        "running": row.running,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "cost_usd": row.cost_usd,
        "budget_usd": budget,
        "spent_usd": row.spent_usd,
        "held_usd": row.held_usd,
        "remaining_usd": None if budget is None else max(budget - row.spent_usd, 0.0),
    }


async def _proxy(request: Request, kind: str) -> Response:
    services, key = await authenticated(request)
    settings = services.settings
    body = await read_json(request, settings.max_body_bytes, settings.body_timeout_s)
    try:
        SCHEMAS[kind].model_validate(body)
        check_passthrough(body)
    except ValidationError as err:
        raise invalid(err.errors()) from err
    except PassthroughRefused as refused:
        raise BadRequest(str(refused), param=refused.field) from None
    return await services.pipeline.handle(_call(request, key, kind, body))


async def _upload(request: Request, kind: str) -> Response:
    """An audio upload: validated (a file, a model, the fields' types), then passed on unchanged."""
    services, key = await authenticated(request)
    settings = services.settings
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    content_type = request.headers.get("content-type") or ""
    try:
        fields = read_audio_form(raw, content_type)
        AudioForm.model_validate(fields)
    except FormError as err:
        raise BadRequest(str(err), param="file") from None
    except ValidationError as err:
        raise invalid(err.errors()) from err
    return await services.pipeline.handle(
        _call(request, key, kind, {"model": fields["model"]}, upload=raw, content_type=content_type)
    )


def _call(
    request: Request,
    key: ApiKeyDep,
    kind: str,
    body: dict[str, Any],
    upload: bytes | None = None,
    content_type: str = "application/json",
) -> Call:
    """The pipeline's call: the request and the routing headers it came with."""
    max_price = request.headers.get("x-neuralgrid-max-price")
    try:
        max_rate = float(max_price) if max_price else None
    except ValueError:
        raise BadRequest("x-neuralgrid-max-price must be a number of USD per hour") from None
    if max_rate is not None and not math.isfinite(max_rate):
        raise BadRequest("x-neuralgrid-max-price must be a finite number of USD per hour")
    if max_rate is not None and max_rate < 0:
        raise BadRequest("x-neuralgrid-max-price must not be negative")
    return Call(
        kind=kind,
        body=body,
        key=key,
        region=request.headers.get("x-neuralgrid-region") or None,
        max_hourly_rate=max_rate,
        policy=request.headers.get("x-neuralgrid-policy") or "balanced",
        received=request.scope.get("state", {}).get("received", time.perf_counter()),
        upload=upload,
        content_type=content_type,
        gone=lambda: _hung_up(request.receive),
    )


async def _hung_up(receive: Receive) -> None:
    """Returns when the client hangs up. Its body is read whole by now, so the next message its
    connection has for this request is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass
