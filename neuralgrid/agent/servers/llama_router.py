"""llama.cpp's `llama-server` started without a model (router mode): it loads the models of a
folder or a preset on demand, each in a server of its own, and says which are loaded (GET /models).
"""

from __future__ import annotations

import asyncio
from typing import Any

from neuralgrid.agent.servers.base import (
    PROBE_TIMEOUT_S,
    WARMUP_TIMEOUT_S,
    BackendError,
    Server,
    ServerKind,
    dig,
    load_refused,
    short_str,
)
from neuralgrid.protocol.routes import Route

LOAD_POLL_S = 0.25  # how often a loading model's state is read
# Each model's server serves what it was started for: only what every one of them serves, and
# embeddings as before.
ROUTES: tuple[Route, ...] = ("chat/completions", "completions", "embeddings", "responses")


class LlamaRouter(ServerKind):
    name = "llama.cpp-router"
    cache_fields = frozenset({"cache_prompt"})
    identify = "/props"

    def recognise(self, identity: Any) -> bool:
        return bool(dig(identity, "role") == "router")

    def version(self, identity: Any) -> str | None:
        return short_str(dig(identity, "build_info"))

    # parallel: each model's server has its own slots: the owner says.

    async def routes(
        self, server: Server, identity: Any, version: str | None, model: str | None
    ) -> tuple[Route, ...]:
        return ROUTES

    async def model_states(self, server: Server) -> tuple[list[str], list[str]] | None:
        states = _states(await server.get_json("/models"))
        if states is None:
            raise BackendError(f"the backend at {server.url} did not list its models (/models)")
        return [m for m, state in states.items() if state == "loaded"], [
            m for m, state in states.items() if state != "loaded"
        ]

    async def load(self, server: Server, model: str) -> str | None:
        """Starts the model's server, which then loads in the background."""
        resp = await server.http.post(
            server.url + "/models/load", json={"model": model}, timeout=PROBE_TIMEOUT_S
        )
        # Refused as "already running" when a request loaded it meanwhile: then it is on its way.
        state = dig(_entry(await server.get_json("/models"), model), "status", "value")
        if resp.is_success or state in ("loading", "loaded"):
            return await _loaded(server, model)
        return load_refused(resp)


async def _loaded(server: Server, model: str) -> str | None:
    """Wait until the router has started the model's server (it loads in the background)."""
    deadline = asyncio.get_running_loop().time() + WARMUP_TIMEOUT_S
    while asyncio.get_running_loop().time() < deadline:
        entry = _entry(await server.get_json("/models"), model)
        state = dig(entry, "status", "value")
        if state == "loaded":
            return None
        if state == "unloaded" and dig(entry, "status", "failed"):
            return f"the server failed to load it (exit code {dig(entry, 'status', 'exit_code')})"
        await asyncio.sleep(LOAD_POLL_S)
    return f"the server did not load it within {WARMUP_TIMEOUT_S:g} s"


def _states(listing: Any) -> dict[str, str] | None:
    """Each model's state in GET /models (loaded, loading, unloaded, sleeping, downloading); None
    when the answer is not one."""
    data = dig(listing, "data")
    if not isinstance(data, list):
        return None
    return {
        str(m["id"]): str(dig(m, "status", "value"))
        for m in data
        if isinstance(m, dict) and isinstance(m.get("id"), str)
    }


def _entry(listing: Any, model: str) -> Any:
    data = dig(listing, "data")
    return next((m for m in data if dig(m, "id") == model), None) if isinstance(data, list) else None


KIND = LlamaRouter()
