"""Errors the gateway answers with, each rendered once as OpenAI's error body."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from starlette.responses import Response

from neuralgrid import validation
from neuralgrid.db import errors as db
from neuralgrid.protocol import wire_json

_UNION_MEMBER = re.compile(r"^(str|int|float|bool|dict|list|none|literal)\b|[\[(]")


class GatewayError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    status = 500
    type = "server_error"
    code: str | None = None
    # Sent as x-should-retry, which OpenAI's SDKs obey before their own rules (they retry every 429).
    should_retry: bool | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.headers = headers

    def response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.retry_after:
            headers["retry-after"] = str(max(1, round(self.retry_after)))
        if self.should_retry is not None:
            headers["x-should-retry"] = str(self.should_retry).lower()
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


class BadRequest(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


def invalid(errors: Sequence[Any]) -> BadRequest:
    """A pydantic or FastAPI validation failure, as OpenAI's 400 naming the first bad parameter."""
    first = errors[0]
    if tuple(first["loc"]) == ("body",):  # no body, not an object, or not sent as JSON at all
        return BadRequest("the request body must be a JSON object, sent with Content-Type: application/json")
    if first.get("type") == "json_invalid":  # FastAPI's, for a body it parses itself: not a parameter
        return BadRequest(
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        )
    param = _param(first["loc"])
    # A union's members each fail (`stop`: not a string, and a list of more than 4): the member of
    # the value's own type says what is wrong with it; the others only that it is not theirs.
    said_of_param = [e for e in errors if _param(e["loc"]) == param]
    first = next((e for e in said_of_param if not str(e.get("type", "")).endswith("_type")), first)
    said = validation.message(first)
    return BadRequest(f"{param}: {said}" if param else said, param=param)


def _param(loc: Sequence[Any]) -> str | None:
    """A parameter's path (messages.0.role), without pydantic's names for the members of a union."""
    return ".".join(str(p) for p in loc if p != "body" and not _UNION_MEMBER.match(str(p))) or None


class Unauthorized(GatewayError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class Forbidden(GatewayError):
    status, type, code = 403, "invalid_request_error", "forbidden"


class NotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class BodyTooLarge(GatewayError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class RequestTimeout(GatewayError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class ClientGone(GatewayError):
    """The client hung up before its request arrived whole, or while it waited in line for a slot.
    Nobody reads the answer; the status (nginx's 499) is for the metrics and the logs."""

    status, type, code = 499, "invalid_request_error", "client_closed_request"


class RateLimited(GatewayError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class BudgetExceeded(GatewayError):
    """OpenAI's answer to a spent quota: a 429 that asking again does not help."""

    status, type, code = 429, "insufficient_quota", "insufficient_quota"
    should_retry = False


class UpstreamFailed(GatewayError):
    status, type, code = 502, "server_error", "upstream_failed"


class NoCapacity(GatewayError):
    status, type, code = 503, "server_error", "no_capacity"


class RouteNotServed(GatewayError):
    """Capable nodes are online for the model, but none serves the route asked for: not a busy
    fleet (asking again soon does not help), so the SDKs are told not to retry."""

    status, type, code = 503, "server_error", "route_not_served"
    should_retry = False


class DatabaseUnavailable(GatewayError):
    """The platform's database did not answer (restarting, unreachable, out of connections)."""

    status, type, code = 503, "server_error", "database_unavailable"


class InternalError(GatewayError):
    """A bug: said in OpenAI's shape like every other answer, and logged in full."""

    status, type, code = 500, "server_error", "internal_error"


class UpstreamTimeout(GatewayError):
    status, type, code = 504, "server_error", "upstream_timeout"


def from_database(err: db.DatabaseError) -> GatewayError:
    """The one map from the database's domain errors to the API's."""
    message, param = str(err), err.param
    if isinstance(err, db.NotFound):
        return (ModelNotFound if param == "model" else NotFound)(message, param=param)
    if isinstance(err, db.Forbidden):
        return Forbidden(message, param=param)
    if isinstance(err, db.BudgetExhausted):
        return BudgetExceeded(message)
    return BadRequest(message, param=param)


def from_http(status: int, detail: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """Starlette's own refusals (no such route, a method the route does not take) in OpenAI's shape."""
    messages = {404: "no such endpoint", 405: "this endpoint does not take that method"}
    body = {
        "error": {
            "message": messages.get(status, detail),
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None,
            "code": detail.lower().replace(" ", "_") if status < 500 else None,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


# Servers' own error types for refusals OpenAI names its own way, which SDKs and clients read: a
# prompt longer than the context is OpenAI's `context_length_exceeded` (llama-server says
# `exceed_context_size_error`).
SERVER_ERRORS: dict[str, tuple[str, str]] = {
    "exceed_context_size_error": ("invalid_request_error", "context_length_exceeded"),
}


def from_node(status: int, body: bytes, media_type: str | None, headers: Mapping[str, str]) -> Response:
    """A node's refusal passed on: as it is when it has OpenAI's shape, else its message in that shape
    (servers differ: FastAPI's {"detail": ...} for a route they lack, vLLM's older {"object": "error",
    "message": ...}, Ollama's {"error": "..."}, llama-server's error with the status as its `code`
    and no `param`, plain text)."""
    try:
        found: Any = wire_json.loads_answer(body)
    except ValueError:  # not JSON, or nested past what can be read
        found = body.decode(errors="replace").strip()
    fields: dict[str, Any] = found if isinstance(found, dict) else {}
    error = fields.get("error")
    kind = "invalid_request_error" if status < 500 else "server_error"
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        if (known := SERVER_ERRORS.get(str(error.get("type")))) is not None:
            message = error["message"].removesuffix(", try increasing it")[:500]  # the server owner's advice
            shaped = {"message": message, "type": known[0], "param": None, "code": known[1]}
            return JSONResponse({"error": shaped}, status, headers)
        if _is_openai_error(error):
            return Response(body, status, headers, media_type=media_type)
        fields, text = error, error["message"][:500] or f"the node answered: HTTP {status}"
        kind = error["type"] if isinstance(error.get("type"), str) else kind
    else:
        said = fields.get("message") or fields.get("detail") or error or found
        said = said if isinstance(said, str) else json.dumps(said)
        text = f"the node answered: {said[:500] or f'HTTP {status}'}"
    param, code = fields.get("param"), fields.get("code")
    shaped = {
        "message": text,
        "type": kind,
        "param": param if isinstance(param, str) else None,
        "code": code if isinstance(code, str) else None,
    }
    return JSONResponse({"error": shaped}, status, headers)


def _is_openai_error(error: dict[str, Any]) -> bool:
    """OpenAI's error object: a message and a type, and a param and a code, each a string or null."""
    return isinstance(error.get("type"), str) and all(
        name in error and (error[name] is None or isinstance(error[name], str)) for name in ("param", "code")
    )
