"""A request's body, read under the gateway's limits: at most so many bytes, all of them in time.

Every route that reads its own body (the OpenAI routes, the nodes', the forwarded requests') reads it
here, so the limits and their errors are the same everywhere and no route imports another.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from neuralgrid.gateway.errors import BadRequest, BodyTooLarge, ClientGone, RequestTimeout
from neuralgrid.protocol import wire_json


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
