"""Ollama (`ollama serve`). It loads models on demand, says which it holds (/api/ps) and which it
has (/api/tags), and does not publish OLLAMA_NUM_PARALLEL: the owner says how many requests it runs.
"""

from __future__ import annotations

from typing import Any

from neuralgrid.agent.routes import version_numbers
from neuralgrid.agent.servers.base import (
    WARMUP_TIMEOUT_S,
    BackendError,
    Server,
    ServerKind,
    dig,
    load_refused,
    short_str,
)
from neuralgrid.protocol.routes import Route

ROUTES: tuple[Route, ...] = ("chat/completions", "completions", "embeddings")
RESPONSES_SINCE = (0, 13, 3)  # server/routes.go gained POST /v1/responses in v0.13.3


class Ollama(ServerKind):
    name = "ollama"
    identify = "/api/version"
    health = "/api/version"

    def recognise(self, identity: Any) -> bool:
        return isinstance(dig(identity, "version"), str)

    def version(self, identity: Any) -> str | None:
        return short_str(dig(identity, "version"))

    async def routes(
        self, server: Server, identity: Any, version: str | None, model: str | None
    ) -> tuple[Route, ...]:
        """What its version serves (its audio route depends on the model: the owner names it)."""
        return (*ROUTES, "responses") if version_numbers(version) >= RESPONSES_SINCE else ROUTES

    async def model_states(self, server: Server) -> tuple[list[str], list[str]] | None:
        every, running = _names(await server.get_json("/api/tags")), _names(await server.get_json("/api/ps"))
        if every is None or running is None:
            raise BackendError(f"the backend at {server.url} did not list its models (/api/tags, /api/ps)")
        return [m for m in every if m in running], [m for m in every if m not in running]

    async def load(self, server: Server, model: str) -> str | None:
        """A generate request naming only the model loads it."""
        resp = await server.http.post(
            server.url + "/api/generate", json={"model": model}, timeout=WARMUP_TIMEOUT_S
        )
        return None if resp.is_success else load_refused(resp)


def _names(listing: Any) -> list[str] | None:
    """The model names in an /api/tags or /api/ps answer; None when it is not one."""
    models = dig(listing, "models")
    if not isinstance(models, list):
        return None
    return [str(m["name"]) for m in models if isinstance(m, dict) and isinstance(m.get("name"), str)]


KIND = Ollama()
