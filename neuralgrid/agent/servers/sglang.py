"""SGLang (`python -m sglang.launch_server`). Its /health runs a one-token generation: cheap, not free."""

from __future__ import annotations

from typing import Any

from neuralgrid.agent.servers.base import Server, ServerKind, dig, positive_int, short_str
from neuralgrid.agent.servers.vllm import count_with_tokenize


class SGLang(ServerKind):
    name = "sglang"
    cache_fields = frozenset({"cache_salt"})
    identify = "/get_server_info"
    queue = ("sglang:num_running_reqs", "sglang:num_queue_reqs")

    def recognise(self, identity: Any) -> bool:
        return isinstance(identity, dict) and "model_path" in identity

    def version(self, identity: Any) -> str | None:
        return short_str(dig(identity, "version"))

    def parallel(self, identity: Any) -> int | None:
        """--max-running-requests when given; else what each data-parallel rank settled on, times ranks."""
        states = dig(identity, "internal_states")
        first = states[0] if isinstance(states, list) and states else None
        per_rank = positive_int(dig(first, "effective_max_running_requests_per_dp"))
        if positive_int(dig(identity, "max_running_requests")) is not None or per_rank is None:
            return positive_int(dig(identity, "max_running_requests"))
        return per_rank * (positive_int(dig(identity, "dp_size")) or 1)

    async def count_tokens(self, server: Server, model: str, text: str) -> int | None:
        return await count_with_tokenize(server, model, text)


KIND = SGLang()
