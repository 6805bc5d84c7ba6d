"""vLLM (`vllm serve`). It does not publish max_num_seqs: the owner says how many requests it runs."""

from __future__ import annotations

from typing import Any

from neuralgrid.agent.servers.base import Server, ServerKind, dig, short_str


class Vllm(ServerKind):
    name = "vllm"
    cache_fields = frozenset({"cache_salt"})
    identify = "/version"
    queue = ("vllm:num_requests_running", "vllm:num_requests_waiting")

    def recognise(self, identity: Any) -> bool:
        return isinstance(dig(identity, "version"), str)

    def version(self, identity: Any) -> str | None:
        return short_str(dig(identity, "version"))

    async def count_tokens(self, server: Server, model: str, text: str) -> int | None:
        return await count_with_tokenize(server, model, text)


async def count_with_tokenize(server: Server, model: str, text: str) -> int | None:
    """vLLM's POST /tokenize, which SGLang serves the same way: a count, special tokens left out."""
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    resp = await server.http.post(server.url + "/tokenize", json=body)
    count = dig(resp.json(), "count") if resp.is_success else None
    return count if type(count) is int else None


KIND = Vllm()
