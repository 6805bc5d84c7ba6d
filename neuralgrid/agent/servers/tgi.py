"""Hugging Face's Text Generation Inference (`text-generation-launcher`)."""

from __future__ import annotations

from typing import Any

from neuralgrid.agent.servers.base import Server, ServerKind, dig, positive_int, short_str
from neuralgrid.protocol.routes import Route

ROUTES: tuple[Route, ...] = ("chat/completions", "completions")  # it generates only


class Tgi(ServerKind):
    name = "tgi"
    identify = "/info"
    queue = ("tgi_queue_size", "tgi_batch_current_size")

    def recognise(self, identity: Any) -> bool:
        return positive_int(dig(identity, "max_concurrent_requests")) is not None and "model_id" in identity

    def version(self, identity: Any) -> str | None:
        return short_str(dig(identity, "version"))

    def parallel(self, identity: Any) -> int | None:
        """An admission limit, not a batch size: the owner may lower it."""
        return positive_int(dig(identity, "max_concurrent_requests"))

    async def routes(
        self, server: Server, identity: Any, version: str | None, model: str | None
    ) -> tuple[Route, ...]:
        return ROUTES

    async def count_tokens(self, server: Server, model: str, text: str) -> int | None:
        """A list of tokens, the start-of-text one (empty, at 0) first: that one is not counted."""
        resp = await server.http.post(server.url + "/tokenize", json={"inputs": text})
        tokens = resp.json() if resp.is_success else None
        if not isinstance(tokens, list):
            return None
        return sum(
            1 for t in tokens if not (isinstance(t, dict) and t.get("text") == "" and not t.get("stop"))
        )


KIND = Tgi()
