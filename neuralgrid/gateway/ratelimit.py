"""Per-key request and token rate limits (the `limits` library: memory, or Redis when configured)."""

from __future__ import annotations

import math
import time

import coredis
from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter

from neuralgrid.gateway.auth import ApiKey
from neuralgrid.gateway.errors import RateLimited


class RateLimiter:
    """rpm counts requests as they arrive; tpm counts tokens once a response says how many."""

    def __init__(self, redis_url: str | None = None) -> None:
        storage: Storage = MemoryStorage()
        self._pool: coredis.ConnectionPool | None = None
        if redis_url:
            # Our own pool, so that shutdown can close its connections.
            self._pool = coredis.ConnectionPool.from_url(redis_url)
            # limits passes options through to coredis.Redis; its hints only admit scalars.
            storage = RedisStorage(f"async+{redis_url}", connection_pool=self._pool)  # type: ignore[arg-type]
        self.limiter = MovingWindowRateLimiter(storage)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.disconnect()

    async def admit(self, key: ApiKey) -> None:
        if key.rpm_limit:
            item = RateLimitItemPerMinute(key.rpm_limit)
            if not await self.limiter.hit(item, "rpm", str(key.id)):
                raise RateLimited(
                    f"rate limit of {key.rpm_limit} requests per minute reached",
                    retry_after=await self._retry_after(item, "rpm", str(key.id)),
                )
        if key.tpm_limit:
            item = RateLimitItemPerMinute(key.tpm_limit)
            if not await self.limiter.test(item, "tpm", str(key.id)):
                raise RateLimited(
                    f"rate limit of {key.tpm_limit} tokens per minute reached",
                    retry_after=await self._retry_after(item, "tpm", str(key.id)),
                )

    async def spend_tokens(self, key: ApiKey, tokens: int) -> None:
        if key.tpm_limit and tokens > 0:
            item = RateLimitItemPerMinute(key.tpm_limit)
            # Take what is left of the window at most: a long answer still ends the minute's budget.
            await self.limiter.hit(item, "tpm", str(key.id), cost=min(tokens, key.tpm_limit))

    async def _retry_after(self, item: RateLimitItemPerMinute, *ids: str) -> float:
        stats = await self.limiter.get_window_stats(item, *ids)
        return max(1.0, math.ceil(stats.reset_time - time.time()))
