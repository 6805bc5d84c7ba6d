"""Per-key request and token rate limits: in memory (per gateway), or shared through Redis.

Each is a ledger of the key's last minute, by hold. rpm charges a request as one unit as it arrives.
tpm is the reason for a ledger: a request's tokens are known only when its answer ends, and a plain
moving window cannot give a charge back; each admitted request holds an estimate of its tokens
(refused with 429 when that does not fit), and its end settles the hold to the tokens it really used.
Either says, as it charges, what the minute holds and when it empties: the x-ratelimit-* headers.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import coredis

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


@dataclass(frozen=True)
class Window:
    """A key's minute as a charge left it."""

    wait: float  # 0.0: charged; else the seconds until the charge would fit (nothing charged)
    used: int  # what the minute holds, the charge included
    empty_in: float  # seconds until all of that has left the minute


@dataclass(frozen=True)
class Allowance:
    """What a key's limits let a request do: its tpm hold, and what the limits are now, as OpenAI
    tells them (x-ratelimit-* headers, none for a key without limits)."""

    hold: TokenHold | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


class Ledger(Protocol):
    """Each key's charges of the last minute, by hold. `now` is wall-clock time (time.time()), which
    is what several gateways sharing Redis can agree on."""

    async def reserve(self, key_id: str, hold_id: str, tokens: int, limit: int, now: float) -> Window:
        """Charge `tokens` if the key's minute has room for them, else say when it would have (and
        charge nothing)."""
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

    def window(self, wait: float, now: float) -> Window:
        # Holds are in the order charged (a settled one keeps its time): the last leaves last.
        newest = next(reversed(self.holds.values()))[0] if self.holds else now - WINDOW_S
        return Window(wait, self.used, newest + WINDOW_S - now)


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

    async def reserve(self, key_id: str, hold_id: str, tokens: int, limit: int, now: float) -> Window:
        minute = self._minute(key_id, now)
        if hold_id in minute.holds:  # asked twice (Redis's reasons, kept alike here)
            return minute.window(0.0, now)
        if minute.used + tokens <= limit:
            minute.holds[hold_id] = (now, tokens)
            minute.used += tokens
            return minute.window(0.0, now)
        self._forget_if_idle(key_id, minute)
        wait, left = WINDOW_S, minute.used
        for at, held in minute.holds.values():  # when enough of the oldest have left
            left -= held
            if left + tokens <= limit:
                wait = at + WINDOW_S - now
                break
        return minute.window(wait, now)

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
local function state(wait, used)  -- the wait, what the minute holds, when its newest hold leaves
  local newest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  local empty_in = 0
  if #newest > 0 then empty_in = tonumber(newest[2]) + window - now end
  return {tostring(wait), tostring(used), tostring(empty_in)}
end
if redis.call('ZSCORE', KEYS[1], member) then return state(0, prune(now - window)) end
local used = prune(now - window)
if used + tokens <= limit then
  redis.call('ZADD', KEYS[1], now, member)
  redis.call('INCRBY', KEYS[2], tokens)
  keep(window)
  return state(0, used + tokens)
end
local left, from = used, 0
while true do  -- when enough of the oldest have left, a page at a time
  local holds = redis.call('ZRANGE', KEYS[1], from, from + 99, 'WITHSCORES')
  if #holds == 0 then return state(window, used) end
  for i = 1, #holds, 2 do
    left = left - amount(holds[i])
    if left + tokens <= limit then
      return state(tonumber(holds[i + 1]) + window - now, used)
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
    """Shared by every gateway using the same Redis; `name` keeps the ledgers' keys apart."""

    def __init__(self, client: coredis.Redis[bytes], name: str) -> None:
        self.name = name
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)

    async def reserve(self, key_id: str, hold_id: str, tokens: int, limit: int, now: float) -> Window:
        args = (repr(now), repr(WINDOW_S), hold_id, tokens, limit)
        reply = await self._reserve(keys=self._keys(key_id), args=args)
        assert isinstance(reply, list)
        wait, used, empty_in = (float(value) for value in reply)
        return Window(wait, int(used), empty_in)

    async def settle(self, key_id: str, hold_id: str, charged: int, tokens: int, now: float) -> None:
        args = (repr(now), repr(WINDOW_S), hold_id, charged, tokens)
        await self._settle(keys=self._keys(key_id), args=args)

    def _keys(self, key_id: str) -> tuple[str, str]:
        # One hash tag: both keys land on the same node of a Redis Cluster, as a script needs.
        return (f"neuralgrid:{self.name}:{{{key_id}}}", f"neuralgrid:{self.name}:{{{key_id}}}:used")


class RateLimiter:
    """rpm charges each request as it arrives; tpm charges a request's estimate as it is admitted
    and settles it to the real count when it ends."""

    def __init__(self, redis_url: str | None = None) -> None:
        self.requests: Ledger = MemoryLedger()
        self.tokens: Ledger = MemoryLedger()
        self._pool: coredis.ConnectionPool | None = None
        if redis_url:
            # Our own pool, so that shutdown can close its connections.
            self._pool = coredis.ConnectionPool.from_url(redis_url)
            client = coredis.Redis(connection_pool=self._pool)
            self.requests, self.tokens = RedisLedger(client, "rpm"), RedisLedger(client, "tpm")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.disconnect()

    async def admit(self, key: ApiKey, tokens: int) -> Allowance:
        """Count the request, and hold `tokens` (its estimate) in the key's tpm window; the hold
        goes with the request to its Meter. Raises RateLimited when either is full; either way
        the headers say what the limits are now."""
        headers: dict[str, str] = {}
        if key.rpm_limit:
            window = await self.requests.reserve(str(key.id), uuid.uuid4().hex, 1, key.rpm_limit, time.time())
            headers.update(_headers("requests", key.rpm_limit, window))
            if window.wait > 0:
                raise RateLimited(
                    f"rate limit of {key.rpm_limit} requests per minute reached",
                    retry_after=_seconds(window.wait),
                    headers=headers,
                )
        if not key.tpm_limit:
            return Allowance(None, headers)
        # An estimate above the whole limit is charged the limit: a key with a small tpm can still
        # make such a request, alone in its minute (its real count is settled when it ends).
        hold = TokenHold(str(key.id), uuid.uuid4().hex, min(max(tokens, 0), key.tpm_limit), key.tpm_limit)
        window = await self.tokens.reserve(hold.key_id, hold.hold_id, hold.charged, hold.limit, time.time())
        headers.update(_headers("tokens", key.tpm_limit, window))
        if window.wait > 0:
            raise RateLimited(
                f"rate limit of {key.tpm_limit} tokens per minute reached: this request is estimated"
                f" at {tokens} tokens (its prompt and max_tokens)",
                retry_after=_seconds(window.wait),
                headers=headers,
            )
        return Allowance(hold, headers)

    async def settle(self, hold: TokenHold | None, tokens: int) -> None:
        """The request's end: its hold becomes the tokens it used (at most the limit, as a charge
        of the whole limit already fills the window)."""
        if hold is not None:
            used = min(max(tokens, 0), hold.limit)
            await self.tokens.settle(hold.key_id, hold.hold_id, hold.charged, used, time.time())

    async def release(self, hold: TokenHold | None) -> None:
        """A request that ends before any node used tokens for it gives its hold back."""
        await self.settle(hold, 0)


def _seconds(wait: float) -> float:
    return max(1.0, math.ceil(wait))


def _headers(unit: str, limit: int, window: Window) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for one limit. Its reset is when the limit is back to its
    initial state: here, when the newest charge leaves the minute."""
    return {
        f"x-ratelimit-limit-{unit}": str(limit),
        f"x-ratelimit-remaining-{unit}": str(max(limit - window.used, 0)),
        f"x-ratelimit-reset-{unit}": duration(window.empty_in),
    }


def duration(seconds: float) -> str:
    """Seconds as OpenAI's reset headers write them (Go's durations: 17ms, 59.5s, 1m0s), rounded up
    to the millisecond."""
    ms = max(math.ceil(seconds * 1000), 0)
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{minutes}m{secs}" if minutes else secs
