"""llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`).

It runs one request at a time, and by default a new request ends a running stream early
(interrupt_requests), even a GET /v1/models: the agent probes it only while it is idle. Serving
several models (a config file), it holds one at a time, and a request naming another unloads it
and loads that one.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from neuralgrid.agent.routes import answers, openapi_routes, ordered
from neuralgrid.agent.servers.base import (
    WARMUP_TIMEOUT_S,
    Server,
    ServerKind,
    dig,
    load_refused,
    short_str,
)
from neuralgrid.protocol.routes import DEFAULT_ROUTES, Route


class LlamaCppPython(ServerKind):
    name = "llama-cpp-python"
    identify = "/openapi.json"
    health = "/openapi.json"
    interrupts = True
    # Its requests' repeat_penalty defaults to 1.1: even at temperature 0 it would not answer with the
    # model's most likely tokens (a greedy answer of OpenAI's API has no penalty).
    openai_defaults = MappingProxyType({"repeat_penalty": 1.0})

    def recognise(self, identity: Any) -> bool:
        return "llama.cpp Python" in str(dig(identity, "info", "title"))

    def version(self, identity: Any) -> str | None:
        return short_str(dig(identity, "info", "version"))

    def parallel(self, identity: Any) -> int | None:
        return 1

    async def routes(
        self, server: Server, identity: Any, version: str | None, model: str | None
    ) -> tuple[Route, ...]:
        listed = await openapi_routes(server.http, server.url)
        if not listed:
            return DEFAULT_ROUTES
        # It lists /v1/embeddings always, but answers it only for a model loaded with
        # embedding=True (else HTTP 500): one short embedding tells.
        if "embeddings" in listed and not await answers(
            server.http, server.url, "embeddings", {"model": model, "input": "probe"}
        ):
            listed.discard("embeddings")
        return ordered(listed) or DEFAULT_ROUTES

    async def count_tokens(self, server: Server, model: str, text: str) -> int | None:
        # It always adds the model's special tokens (a BOS, say): count them once and take them off.
        counts: list[int] = []
        for piece in (text, ""):
            resp = await server.http.post(
                server.url + "/extras/tokenize/count", json={"input": piece, "model": model}
            )
            count = dig(resp.json(), "count") if resp.is_success else None
            if type(count) is not int:
                return None
            counts.append(count)
        return max(counts[0] - counts[1], 0)

    def swaps(self, served: list[str]) -> bool:
        return len(served) > 1

    async def model_states(self, server: Server) -> tuple[list[str], list[str]] | None:
        """Which model it holds is known only from the requests it was sent (server.resident)."""
        if not self.swaps(server.served):
            return None
        held = server.resident if server.resident in server.served else server.served[0]
        return [held], [m for m in server.served if m != held]

    async def load(self, server: Server, model: str) -> str | None:
        """It loads the model a request names: one token of it."""
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        resp = await server.http.post(server.url + "/v1/completions", json=body, timeout=WARMUP_TIMEOUT_S)
        return None if resp.is_success else load_refused(resp)


KIND = LlamaCppPython()
