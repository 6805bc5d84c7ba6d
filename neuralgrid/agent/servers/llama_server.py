"""llama.cpp's `llama-server` serving the model it started with.

Its /props says how many slots it runs (-np) and how it was built. It serves chat, completions and
/v1/responses always, and the rest only as started: /v1/rerank with --reranking, /v1/embeddings with
--embeddings and a pooling model (each answers HTTP 501 or 400 otherwise: a one-word request tells),
and /v1/audio/transcriptions with an audio model (its /props says so).
"""

from __future__ import annotations

from typing import Any

from neuralgrid.agent.routes import answers, ordered
from neuralgrid.agent.servers.base import Server, ServerKind, dig, positive_int, short_str
from neuralgrid.protocol.routes import Route

ALWAYS: tuple[Route, ...] = ("chat/completions", "completions", "responses")


class LlamaServer(ServerKind):
    name = "llama.cpp"
    cache_fields = frozenset({"cache_prompt"})
    identify = "/props"

    def recognise(self, identity: Any) -> bool:
        return positive_int(dig(identity, "total_slots")) is not None

    def version(self, identity: Any) -> str | None:
        return short_str(dig(identity, "build_info"))

    def parallel(self, identity: Any) -> int | None:
        return positive_int(dig(identity, "total_slots"))

    async def routes(
        self, server: Server, identity: Any, version: str | None, model: str | None
    ) -> tuple[Route, ...]:
        routes: set[Route] = set(ALWAYS)
        modalities = identity.get("modalities") if isinstance(identity, dict) else None
        if isinstance(modalities, dict) and modalities.get("audio") is True:
            routes.add("audio/transcriptions")
        if await answers(server.http, server.url, "rerank", {"query": "probe", "documents": ["probe"]}):
            routes.add("rerank")
        # A reranking server's "embedding" is its relevance score: embeddings only without reranking.
        elif await answers(server.http, server.url, "embeddings", {"input": "probe"}):
            routes.add("embeddings")
        return ordered(routes)

    async def queue_depth(self, server: Server) -> int | None:
        """Its slots that are processing a request (GET /slots)."""
        slots = await server.get_json("/slots")
        if isinstance(slots, list):
            return sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))
        return None

    async def count_tokens(self, server: Server, model: str, text: str) -> int | None:
        resp = await server.http.post(server.url + "/tokenize", json={"content": text, "add_special": False})
        tokens = dig(resp.json(), "tokens") if resp.is_success else None
        return len(tokens) if isinstance(tokens, list) else None


KIND = LlamaServer()
