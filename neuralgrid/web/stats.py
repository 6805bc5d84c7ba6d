"""The map's fleet totals, cached: every open map polls them, one query per gateway per TTL serves all."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store

STATS_TTL_S = 2.0


class StatsCache:
    def __init__(self, ttl_s: float = STATS_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.at = float("-inf")
        self.value: dict[str, Any] = {}
        self.lock = asyncio.Lock()

    async def get(self, store: Store) -> dict[str, Any]:
        async with self.lock:
            if time.monotonic() - self.at > self.ttl_s:
                self.value, self.at = dict(await store.one(q.FLEET_STATS) or {}), time.monotonic()
            return self.value
