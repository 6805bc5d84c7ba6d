"""Finding which OpenAI routes an inference server serves, never more than it can do: the probes
kinds share (each kind's module, in neuralgrid/agent/servers/, says what its server serves).

FastAPI servers (vLLM, SGLang, llama-cpp-python, and any unknown kind that has one) publish their
routes in /openapi.json; vLLM lists only what its model's tasks allow (/v1/rerank for a cross-encoder,
/v1/audio/transcriptions for Whisper). Other servers are probed with one-word requests, or known by
their version. Without any of that, a node serves the routes every node served before routes were
reported (DEFAULT_ROUTES).
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from neuralgrid.protocol.routes import ROUTES, Route, route_of

PROBE_TIMEOUT_S = 3.0


def ordered(routes: set[Route]) -> tuple[Route, ...]:
    return tuple(route for route in ROUTES if route in routes)


async def openapi_routes(http: httpx.AsyncClient, url: str) -> set[Route] | None:
    """The known routes among the POST paths of the server's OpenAPI document; None without one."""
    try:
        resp = await http.get(url + "/openapi.json", timeout=PROBE_TIMEOUT_S)
        paths = resp.json().get("paths") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(paths, dict):
        return None
    return {route for path, ops in paths.items() if (route := route_of(path)) and _posts(ops)}


def _posts(operations: Any) -> bool:
    return isinstance(operations, dict) and "post" in operations


async def answers(http: httpx.AsyncClient, url: str, route: Route, body: dict[str, Any]) -> bool:
    """Whether the server answers a one-word request on `route` (a server not started for it
    refuses at once, before running the model)."""
    try:
        resp = await http.post(url + "/v1/" + route, json=body, timeout=PROBE_TIMEOUT_S * 10)
    except httpx.HTTPError:
        return False
    return resp.is_success


def version_numbers(text: str | None) -> tuple[int, ...]:
    """A version's leading numbers ("0.13.3-rc1" -> (0, 13, 3)); () when it has none."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", text or "")
    return tuple(int(part) for part in match[1].split(".")) if match else ()
