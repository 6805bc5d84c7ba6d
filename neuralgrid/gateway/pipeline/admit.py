"""Stage 1, admit: what the client asked, checked against the catalog and the key's limits, and
the body the nodes will be sent (usage asked for on streams; the answer bounded by the hold)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.gateway import errors
from neuralgrid.gateway.auth import ApiKey
from neuralgrid.gateway.ratelimit import RateLimiter

CATALOG_TTL_S = 60.0


@dataclass(frozen=True)
class Call:
    """A client's request as the gateway received it."""

    kind: str  # chat, completion or embedding
    body: dict[str, Any]
    key: ApiKey
    region: str | None = None
    max_hourly_rate: float | None = None
    policy: str = "balanced"
    received: float = field(default_factory=time.perf_counter)

    @property
    def model(self) -> str:
        return str(self.body["model"])


@dataclass(frozen=True)
class Admitted:
    """A call let in: what the nodes are sent, and the longest answer it may get (match_job() prices
    the budget hold from the payload's size and that)."""

    call: Call
    body: dict[str, Any]  # as the nodes get it
    payload: bytes
    stream: bool
    max_output_tokens: int


class Catalog:
    """The catalog's model kinds, reloaded every minute."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.models: dict[str, q.ModelKind] = {}
        self.loaded_at = float("-inf")

    async def get(self, model: str) -> q.ModelKind | None:
        if time.monotonic() - self.loaded_at > CATALOG_TTL_S:
            self.models = {row.id: row for row in await self.store.all(q.MODEL_KINDS)}
            self.loaded_at = time.monotonic()
        return self.models.get(model)


class Admission:
    def __init__(self, catalog: Catalog, limiter: RateLimiter, default_max_tokens: int) -> None:
        self.catalog = catalog
        self.limiter = limiter
        self.default_max_tokens = default_max_tokens

    async def admit(self, call: Call) -> Admitted:
        entry = await self.catalog.get(call.model)
        if entry and (entry.kind == "embedding") != (call.kind == "embedding"):
            # A server would fail it (HTTP 500 or 501), which is no node's fault.
            what = "embeddings" if call.kind == "embedding" else "chat or completions"
            raise errors.BadRequest(
                f"{call.model} is a {entry.kind} model: it does not serve {what}", param="model"
            )
        await self.limiter.admit(call.key)
        stream = bool(call.body.get("stream")) and call.kind != "embedding"
        body = dict(call.body)
        if stream:  # ask for usage to meter; stripped again if the client did not ask
            body["stream_options"] = {**(call.body.get("stream_options") or {}), "include_usage": True}
        max_out = int(
            call.body.get("max_tokens") or call.body.get("max_completion_tokens") or self.default_max_tokens
        )
        if call.key.budget_usd is not None and call.kind != "embedding":
            # The hold must bound the cost: the node is told the answer size the hold assumed.
            body.setdefault("max_tokens", max_out)
        max_out *= max(1, int(call.body.get("n") or 1))
        payload = json.dumps(body).encode()
        return Admitted(call, body, payload, stream, 0 if call.kind == "embedding" else max_out)
