"""Which OpenAI routes an inference server serves, never more than it can do.

FastAPI servers (vLLM, SGLang, llama-cpp-python, and any unknown kind that has one) publish their
routes in /openapi.json; vLLM lists only what its model's tasks allow (/v1/rerank for a cross-encoder,
/v1/audio/transcriptions for Whisper). llama.cpp's server serves chat, completions and /v1/responses
always, and the rest only as started: /v1/rerank with --reranking, /v1/embeddings with --embeddings
and a pooling model (each answers HTTP 501 or 400 otherwise: a one-word request tells), and
/v1/audio/transcriptions with an audio model (its /props says so). For Ollama and TGI, what each
version serves is known. Without any of that, a node serves the routes every node served before
routes were reported (DEFAULT_ROUTES).
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from neuralgrid.protocol.routes import DEFAULT_ROUTES, ROUTES, Route, route_of

PROBE_TIMEOUT_S = 3.0
LLAMA_CPP_ALWAYS: tuple[Route, ...] = ("chat/completions", "completions", "responses")
# llama.cpp's router starts a server per model and passes each request to it: what those serve
# depends on how each is started, so only what every one of them serves, and embeddings as before.
LLAMA_CPP_ROUTER: tuple[Route, ...] = ("chat/completions", "completions", "embeddings", "responses")
OLLAMA: tuple[Route, ...] = ("chat/completions", "completions", "embeddings")
OLLAMA_RESPONSES_SINCE = (0, 13, 3)  # server/routes.go gained POST /v1/responses in v0.13.3
TGI: tuple[Route, ...] = ("chat/completions", "completions")


def ordered(routes: set[Route]) -> tuple[Route, ...]:
    return tuple(route for route in ROUTES if route in routes)


async def detect_routes(
    http: httpx.AsyncClient, url: str, kind: str, identity: Any, version: str | None, model: str | None
) -> tuple[Route, ...]:
    """The routes the server at `url` serves. `identity`: the answer of the endpoint that identified
    its kind (llama.cpp's /props); `model`: one it serves (for a probe that must name one)."""
    if kind == "llama.cpp":
        return await _llama_cpp(http, url, identity)
    if kind == "llama.cpp-router":
        return LLAMA_CPP_ROUTER
    if kind == "ollama":
        newer = _version(version) >= OLLAMA_RESPONSES_SINCE
        return (*OLLAMA, "responses") if newer else OLLAMA
    if kind == "tgi":
        return TGI
    listed = await _openapi(http, url)
    if not listed:
        return DEFAULT_ROUTES
    # llama-cpp-python lists /v1/embeddings always, but answers it only for a model loaded with
    # embedding=True (else HTTP 500): one short embedding tells.
    if (
        kind == "llama-cpp-python"
        and "embeddings" in listed
        and not await _answers(http, url, "embeddings", {"model": model, "input": "probe"})
    ):
        listed.discard("embeddings")
    return ordered(listed) or DEFAULT_ROUTES


async def _openapi(http: httpx.AsyncClient, url: str) -> set[Route] | None:
    """The known routes among the paths of the server's OpenAPI document; None without one."""
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


async def _llama_cpp(http: httpx.AsyncClient, url: str, props: Any) -> tuple[Route, ...]:
    routes: set[Route] = set(LLAMA_CPP_ALWAYS)
    modalities = props.get("modalities") if isinstance(props, dict) else None
    if isinstance(modalities, dict) and modalities.get("audio") is True:
        routes.add("audio/transcriptions")
    if await _answers(http, url, "rerank", {"query": "probe", "documents": ["probe"]}):
        routes.add("rerank")
    # A reranking server's "embedding" is its relevance score: embeddings only without reranking.
    elif await _answers(http, url, "embeddings", {"input": "probe"}):
        routes.add("embeddings")
    return ordered(routes)


async def _answers(http: httpx.AsyncClient, url: str, route: Route, body: dict[str, Any]) -> bool:
    """Whether the server answers a one-word request on `route` (a server not started for it
    refuses at once, before running the model)."""
    try:
        resp = await http.post(url + "/v1/" + route, json=body, timeout=PROBE_TIMEOUT_S * 10)
    except httpx.HTTPError:
        return False
    return resp.is_success


def _version(text: str | None) -> tuple[int, ...]:
    """A version's leading numbers ("0.13.3-rc1" -> (0, 13, 3)); () when it has none."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", text or "")
    return tuple(int(part) for part in match[1].split(".")) if match else ()
