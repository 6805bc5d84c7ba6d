"""Per-key request and token rate limits: in memory (per gateway), or shared through Redis.

rpm counts requests with the `limits` library's moving window. tpm is a ledger of its own, because
a request's tokens are known only when its answer ends, and a moving window cannot give a charge
back: each admitted request holds an estimate of its tokens in the key's last minute (refused with
429 when that does not fit), and its end settles the hold to the tokens it really used.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import coredis
from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter

from neuralgrid.gateway.auth import ApiKey
from neuralgrid.gateway.errors import RateLimited

WINDOW_S = 60.0
# Prompt tokens estimated from the body's size, as the budget hold does (private.budget_hold in SQL).
BYTES_PER_TOKEN = 4


def estimate_tokens(payload_bytes: int, max_output_tokens: int) -> int:
    """A request's tokens before it runs: its body at 4 bytes a token, and its longest answer (over
    all choices)."""
    return math.ceil(payload_bytes / BYTES_PER_TOKEN) + max_output_tokens


@dataclass(frozen=True)
class TokenHold:
    """Tokens charged to a key's minute when its request was admitted, until its end settles them."""

    key_id: str
    hold_id: str
    charged: int
    limit: int


class TokenLedger(Protocol):
    """Each key's charges of the last minute, by hold. `now` is wall-clock time (time.time()), which
    is what several gateways sharing Redis can agree on."""

    async def reserve(self, key_id: str, hold_id: str, tokens: int, limit: int, now: float) -> float:
        """Charge `tokens` if the key's minute has room for them: 0.0, else the seconds until it
        would have (nothing charged)."""
        ...

    async def settle(self, key_id: str, hold_id: str, charged: int, tokens: int, now: float) -> None:
        """Make a hold `tokens` (0 gives it all back). A hold already out of the window can give
        nothing back; tokens beyond its charge are then charged now."""
        ...


class _Minute:
    """One key's holds of the last minute, oldest first, and their sum."""

    def __init__(self) -> None:
        # hold -> (when charged, tokens), in the order charged: the oldest leave first, in O(1).
        self.holds: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.used = 0

    def prune(self, now: float) -> None:
        while self.holds:
            hold_id = next(iter(self.holds))
            at, tokens = self.holds[hold_id]
            if at > now - WINDOW_S:
                break
            del self.holds[hold_id]
            self.used -= tokens


class MemoryLedger:
    """Per gateway: without Redis, each gateway counts its own holds."""

    def __init__(self) -> None:
        self._keys: dict[str, _Minute] = {}

    def _minute(self, key_id: str, now: float) -> _Minute:
        minute = self._keys.get(key_id)
        if minute is None:
            minute = self._keys[key_id] = _Minute()
        minute.prune(now)
        return minute

    def _forget_if_idle(self, key_id: str, minute: _Minute) -> None:
        if not minute.holds:
            del self._keys[key_id]

    async def reserve(self, key_id: str, hold_id: str, tokens: int, limit: int, now: float) -> float:
        minute = self._minute(key_id, now)
        if hold_id in minute.holds:  # asked twice (Redis's reasons, kept alike here)
            return 0.0
        if minute.used + tokens <= limit:
            minute.holds[hold_id] = (now, tokens)
            minute.used += tokens
            return 0.0
        self._forget_if_idle(key_id, minute)
        used = minute.used
        for at, held in minute.holds.values():  # when enough of the oldest have left
            used -= held
            if used + tokens <= limit:
                return at + WINDOW_S - now
        return WINDOW_S

    async def settle(self, key_id: str, hold_id: str, charged: int, tokens: int, now: float) -> None:
        minute = self._minute(key_id, now)
        if hold_id in minute.holds:
            at, held = minute.holds[hold_id]
            minute.used += tokens - held
            if tokens:
                minute.holds[hold_id] = (at, tokens)  # keeps its place: the time it was charged
            else:
                del minute.holds[hold_id]
        elif tokens > charged and f"{hold_id}+" not in minute.holds:
            # The hold left the window: the tokens beyond it are charged now.
            minute.holds[f"{hold_id}+"] = (now, tokens - charged)
            minute.used += tokens - charged
        self._forget_if_idle(key_id, minute)


# Per key, a sorted set of holds (members "<hold>:<tokens>", scored by when they were charged) and
# their sum, pruned as holds leave the window: an admission costs the holds it prunes, not the whole
# minute. The scripts run atomically in Redis, so gateways sharing it never admit past the limit
# between them; both keys expire a minute after the last charge.
_PRUNE = """
local function amount(member)
  return tonumber(string.match(member, ':(%d+)$'))
end
local function prune(cutoff)
  local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
  if #gone > 0 then
    local n = 0
    for _, member in ipairs(gone) do n = n + amount(member) end
    redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
    redis.call('DECRBY', KEYS[2], n)
  end
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
local function keep(window)
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))
  redis.call('PEXPIRE', KEYS[2], math.ceil(window * 1000))
end
"""

# coredis sends a command again when the connection is lost before its reply, which may come after
# Redis ran it: each script finds its own earlier run by the hold's members (hold ids are unique).
_RESERVE = (
    _PRUNE
    + """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local tokens, limit = tonumber(ARGV[4]), tonumber(ARGV[5])
local member = ARGV[3] .. ':' .. ARGV[4]
if redis.call('ZSCORE', KEYS[1], member) then return '0' end
local used = prune(now - window)
if used + tokens <= limit then
  redis.call('ZADD', KEYS[1], now, member)
  redis.call('INCRBY', KEYS[2], tokens)
  keep(window)
  return '0'
end
local from = 0
while true do  -- when enough of the oldest have left, a page at a time
  local holds = redis.call('ZRANGE', KEYS[1], from, from + 99, 'WITHSCORES')
  if #holds == 0 then return tostring(window) end
  for i = 1, #holds, 2 do
    used = used - amount(holds[i])
    if used + tokens <= limit then
      return tostring(tonumber(holds[i + 1]) + window - now)
    end
  end
  from = from + 100
end
"""
)

_SETTLE = (
    _PRUNE
    + """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local hold, charged, tokens = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local held, settled = hold .. ':' .. ARGV[4], hold .. ':' .. ARGV[5]
prune(now - window)
if tokens ~= charged and redis.call('ZSCORE', KEYS[1], settled) then return 0 end  -- ran before
local at = redis.call('ZSCORE', KEYS[1], held)
if at then
  if tokens ~= charged then
    redis.call('ZREM', KEYS[1], held)
    if tokens > 0 then redis.call('ZADD', KEYS[1], at, settled) end
    redis.call('INCRBY', KEYS[2], tokens - charged)
  end
elseif tokens > charged then  -- the hold left the window: the tokens beyond it are charged now
  if redis.call('ZADD', KEYS[1], now, hold .. '+:' .. (tokens - charged)) == 1 then
    redis.call('INCRBY', KEYS[2], tokens - charged)
  end
end
keep(window)
return 0
"""
)


class RedisLedger:
    """Shared by every gateway using the same Redis."""

    def __init__(self, client: coredis.Redis[bytes]) -> None:
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)

    async def reserve(self, key_id: str, hold_id: str, tokens: int, limit: int, now: float) -> float:
        args = (repr(now), repr(WINDOW_S), hold_id, tokens, limit)
        wait = await self._reserve(keys=_redis_keys(key_id), args=args)
        assert isinstance(wait, bytes)
        return float(wait)

    async def settle(self, key_id: str, hold_id: str, charged: int, tokens: int, now: float) -> None:
        args = (repr(now), repr(WINDOW_S), hold_id, charged, tokens)
        await self._settle(keys=_redis_keys(key_id), args=args)


def _redis_keys(key_id: str) -> tuple[str, str]:
    # One hash tag: both keys land on the same node of a Redis Cluster, as a script needs.
    return (f"neuralgrid:tpm:{{{key_id}}}", f"neuralgrid:tpm:{{{key_id}}}:used")


class RateLimiter:
    """rpm counts requests as they arrive; tpm charges a request's estimate as it is admitted and
    settles it to the real count when it ends."""

    def __init__(self, redis_url: str | None = None) -> None:
        storage: Storage = MemoryStorage()
        self.ledger: TokenLedger = MemoryLedger()
        self._pool: coredis.ConnectionPool | None = None
        if redis_url:
            # Our own pool, so that shutdown can close its connections.
            self._pool = coredis.ConnectionPool.from_url(redis_url)
            # limits passes options through to coredis.Redis; its hints only admit scalars.
            storage = RedisStorage(f"async+{redis_url}", connection_pool=self._pool)  # type: ignore[arg-type]
            self.ledger = RedisLedger(coredis.Redis(connection_pool=self._pool))
        self.limiter = MovingWindowRateLimiter(storage)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.disconnect()

    async def admit(self, key: ApiKey, tokens: int) -> TokenHold | None:
        """Count the request, and hold `tokens` (its estimate) in the key's tpm window; the hold
        goes with the request to its Meter. Raises RateLimited when either is full."""
        if key.rpm_limit:
            item = RateLimitItemPerMinute(key.rpm_limit)
            if not await self.limiter.hit(item, "rpm", str(key.id)):
                stats = await self.limiter.get_window_stats(item, "rpm", str(key.id))
                raise RateLimited(
                    f"rate limit of {key.rpm_limit} requests per minute reached",
                    retry_after=_seconds(stats.reset_time - time.time()),
                )
        if not key.tpm_limit:
            return None
        # An estimate above the whole limit is charged the limit: a key with a small tpm can still
        # make such a request, alone in its minute (its real count is settled when it ends).
        hold = TokenHold(str(key.id), uuid.uuid4().hex, min(max(tokens, 0), key.tpm_limit), key.tpm_limit)
        wait = await self.ledger.reserve(hold.key_id, hold.hold_id, hold.charged, hold.limit, time.time())
        if wait > 0:
            raise RateLimited(
                f"rate limit of {key.tpm_limit} tokens per minute reached: this request is estimated"
                f" at {tokens} tokens (its prompt and max_tokens)",
                retry_after=_seconds(wait),
            )
        return hold

    async def settle(self, hold: TokenHold | None, tokens: int) -> None:
        """The request's end: its hold becomes the tokens it used (at most the limit, as a charge
        of the whole limit already fills the window)."""
        if hold is not None:
            used = min(max(tokens, 0), hold.limit)
            await self.ledger.settle(hold.key_id, hold.hold_id, hold.charged, used, time.time())

    async def release(self, hold: TokenHold | None) -> None:
        """A request that ends before any node used tokens for it gives its hold back."""
        await self.settle(hold, 0)


def _seconds(wait: float) -> float:
    return max(1.0, math.ceil(wait))
