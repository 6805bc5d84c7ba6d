"""The map's fleet totals and its summary, cached: every open map reads them, one query per gateway per
TTL serves all."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store

STATS_TTL_S = 2.0
SUMMARY_TTL_S = 1.0


class StatsCache:
    def __init__(self, ttl_s: float = STATS_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.at = float("-inf")
        self.value: dict[str, Any] = {}
        self.lock = asyncio.Lock()
        self.summary_at = float("-inf")
        self.summary_value: dict[str, Any] = {}
        self.summary_lock = asyncio.Lock()

    async def get(self, store: Store) -> dict[str, Any]:
        async with self.lock:
            if time.monotonic() - self.at > self.ttl_s:
                self.value, self.at = dict(await store.one(q.FLEET_STATS) or {}), time.monotonic()
            return self.value

    async def summary(self, store: Store) -> dict[str, Any]:
        """map_summary() as anon (the one last broadcast on map:summary while the feed runs), kept a
        second."""
        async with self.summary_lock:
            if time.monotonic() - self.summary_at > SUMMARY_TTL_S:
                async with store.as_role({"role": "anon"}) as anon:
                    self.summary_value = dict(await anon.get(q.MAP_SUMMARY))
                self.summary_at = time.monotonic()
            return self.summary_value
