"""The rpm and tpm ledgers (gateway/ratelimit.py): holds charged at admission and settled at the end,
the same in memory and in Redis, with the clock given."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal

import coredis
import pytest

from neuralgrid.gateway.auth import ApiKey
from neuralgrid.gateway.errors import RateLimited
from neuralgrid.gateway.ratelimit import (
    WINDOW_S,
    Allowance,
    Ledger,
    MemoryLedger,
    RateLimiter,
    RedisLedger,
    Window,
    duration,
    estimate_tokens,
)
from tests.conftest import running_redis

T0 = 1_800_000_000.0


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(params=["memory", "redis"])
async def ledger(request: pytest.FixtureRequest) -> AsyncIterator[Ledger]:
    if request.param == "memory":
        yield MemoryLedger()
        return
    pool = coredis.ConnectionPool.from_url(request.getfixturevalue("redis_url"))
    yield RedisLedger(coredis.Redis(connection_pool=pool), "tpm")
    pool.disconnect()


def new_key() -> str:
    return uuid.uuid4().hex  # Redis keeps keys between tests


async def wait(ledger: Ledger, key: str, hold: str, tokens: int, limit: int, now: float) -> float:
    """What a charge was told: 0.0 when it fit, else the seconds until it would."""
    return (await ledger.reserve(key, hold, tokens, limit, now)).wait


async def test_holds_fit_the_minute_or_say_when_they_would(ledger: Ledger) -> None:
    key = new_key()
    assert await wait(ledger, key, "a", 60, 100, T0) == 0.0
    assert await wait(ledger, key, "b", 30, 100, T0 + 10) == 0.0
    # 90 held: 20 more fit when the first hold leaves the window, 50 s from now.
    assert await wait(ledger, key, "c", 20, 100, T0 + 10) == pytest.approx(50.0)
    # 100 fit only when both have left.
    assert await wait(ledger, key, "c", 100, 100, T0 + 20) == pytest.approx(50.0)
    assert await wait(ledger, key, "c", 20, 100, T0 + WINDOW_S + 1) == 0.0
    assert await wait(ledger, key, "d", 50, 100, T0 + WINDOW_S + 2) == 0.0  # 30 + 20 + 50


async def test_settling_gives_back_or_charges_the_difference(ledger: Ledger) -> None:
    key = new_key()
    assert await wait(ledger, key, "a", 80, 100, T0) == 0.0
    await ledger.settle(key, "a", 80, 15, T0 + 1)  # 65 given back
    assert await wait(ledger, key, "b", 85, 100, T0 + 2) == 0.0
    await ledger.settle(key, "b", 85, 0, T0 + 3)  # failed: all given back
    await ledger.settle(key, "a", 15, 40, T0 + 4)  # a longer count than held: 25 more
    assert await wait(ledger, key, "c", 61, 100, T0 + 5) > 0  # 40 + 61
    assert await wait(ledger, key, "c", 60, 100, T0 + 5) == 0.0
    # The settled charge keeps the hold's time: it leaves the window a minute after admission.
    assert await wait(ledger, key, "d", 40, 100, T0 + 5) == pytest.approx(WINDOW_S - 5)
    assert await wait(ledger, key, "d", 40, 100, T0 + WINDOW_S + 1) == 0.0


async def test_a_hold_that_outlived_the_minute_can_only_charge_more(ledger: Ledger) -> None:
    key = new_key()
    assert await wait(ledger, key, "a", 50, 100, T0) == 0.0
    assert await wait(ledger, key, "b", 50, 100, T0 + WINDOW_S + 30) == 0.0
    # a ends after 90 s having used 20: its 50 already left the window, nothing to give back.
    await ledger.settle(key, "a", 50, 20, T0 + 90)
    assert await wait(ledger, key, "c", 50, 100, T0 + 91) == 0.0
    await ledger.settle(key, "c", 50, 0, T0 + 91)
    # b ends having used 80 after 70 s: its 50 left at T0 + 150; the 30 more are charged now.
    await ledger.settle(key, "b", 50, 80, T0 + 160)
    assert await wait(ledger, key, "d", 71, 100, T0 + 161) == pytest.approx(WINDOW_S - 1)
    assert await wait(ledger, key, "d", 70, 100, T0 + 161) == 0.0


async def test_the_wait_is_found_past_a_page_of_holds(ledger: Ledger) -> None:
    key = new_key()
    for i in range(250):
        assert await wait(ledger, key, f"h{i}", 1, 250, T0 + i / 10) == 0.0
    # 200 must leave first: the 200th oldest, charged at T0 + 19.9 s.
    assert await wait(ledger, key, "x", 200, 250, T0 + 30) == pytest.approx(19.9 + WINDOW_S - 30)
    # Pruned as they leave: at T0 + 70 the first 101 have (up to T0 + 10.0), and 101 fit.
    assert await wait(ledger, key, "y", 102, 250, T0 + 70) > 0
    assert await wait(ledger, key, "y", 101, 250, T0 + 70) == 0.0


async def test_a_command_run_twice_counts_once(ledger: Ledger) -> None:
    """coredis sends a script again when the reply is lost, though Redis may have run it."""
    key = new_key()
    for _ in range(2):
        assert await wait(ledger, key, "a", 50, 100, T0) == 0.0
    for _ in range(2):
        await ledger.settle(key, "a", 50, 30, T0 + 1)
    assert await wait(ledger, key, "b", 70, 100, T0 + 2) == 0.0  # 30 + 70
    for _ in range(2):
        await ledger.settle(key, "b", 70, 0, T0 + 3)
    assert await wait(ledger, key, "c", 20, 100, T0 + WINDOW_S + 1) == 0.0
    for _ in range(2):  # a left the window at T0 + 60; its 10 beyond the estimate, once
        await ledger.settle(key, "a", 30, 40, T0 + WINDOW_S + 2)
    assert await wait(ledger, key, "d", 71, 100, T0 + WINDOW_S + 3) > 0
    assert await wait(ledger, key, "d", 70, 100, T0 + WINDOW_S + 3) == 0.0


async def test_a_charge_tells_what_the_minute_holds_and_when_it_empties(ledger: Ledger) -> None:
    """What the x-ratelimit-* headers say: the minute's charges, and when the newest leaves it."""
    key = new_key()
    assert await ledger.reserve(key, "a", 60, 100, T0) == Window(0.0, 60, WINDOW_S)
    assert await ledger.reserve(key, "b", 30, 100, T0 + 10) == Window(0.0, 90, WINDOW_S)
    refused = await ledger.reserve(key, "c", 20, 100, T0 + 15)  # nothing charged
    assert (refused.wait, refused.used, refused.empty_in) == pytest.approx((45.0, 90, 55.0))
    await ledger.settle(key, "b", 30, 5, T0 + 20)  # settled: keeps its time
    again = await ledger.reserve(key, "b", 5, 100, T0 + 20)  # asked twice: charged once
    assert (again.wait, again.used, again.empty_in) == pytest.approx((0.0, 65, 50.0))
    assert await ledger.reserve(key, "d", 1, 100, T0 + 200) == Window(0.0, 1, WINDOW_S)


async def test_keys_are_counted_apart(ledger: Ledger) -> None:
    one, two = new_key(), new_key()
    assert await wait(ledger, one, "a", 100, 100, T0) == 0.0
    assert await wait(ledger, two, "a", 100, 100, T0) == 0.0
    assert await wait(ledger, one, "b", 1, 100, T0) > 0


async def test_an_idle_key_leaves_nothing_in_memory() -> None:
    ledger = MemoryLedger()
    assert await wait(ledger, "k", "a", 10, 100, T0) == 0.0
    await ledger.settle("k", "a", 10, 0, T0 + 1)
    assert ledger._keys == {}
    assert await wait(ledger, "k", "b", 10, 100, T0) == 0.0
    assert await wait(ledger, "k", "c", 10, 100, T0 + WINDOW_S + 1) == 0.0
    assert list(ledger._keys["k"].holds) == ["c"] and ledger._keys["k"].used == 10


async def test_redis_forgets_an_idle_key(redis_url: str) -> None:
    pool = coredis.ConnectionPool.from_url(redis_url)
    client = coredis.Redis(connection_pool=pool)
    key = new_key()
    assert (await RedisLedger(client, "tpm").reserve(key, "a", 10, 100, time.time())).wait == 0.0
    for name in (f"neuralgrid:tpm:{{{key}}}", f"neuralgrid:tpm:{{{key}}}:used"):
        assert 0 < await client.pttl(name) <= WINDOW_S * 1000
    pool.disconnect()


def test_resets_are_written_as_openai_writes_them() -> None:
    assert [duration(s) for s in (0.0, 0.0171, 1.0, 59.5, 59.9984, WINDOW_S, 75.25)] == [
        "0ms",
        "18ms",
        "1s",
        "59.5s",
        "59.999s",
        "1m0s",
        "1m15.25s",
    ]


def limited(tpm: int | None, rpm: int | None = None) -> ApiKey:
    return ApiKey(uuid.uuid4(), None, "k", rpm, tpm, Decimal(1) if tpm else None)


def test_the_estimate_is_the_body_at_four_bytes_a_token_and_the_longest_answer() -> None:
    assert estimate_tokens(115, 50) == 29 + 50
    assert estimate_tokens(0, 0) == 0


async def test_the_limiter_tells_the_keys_limits_as_headers() -> None:
    limiter = RateLimiter()
    key = limited(100, rpm=2)
    allowed = await limiter.admit(key, 30)
    assert allowed.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "70",
        "x-ratelimit-reset-tokens": "1m0s",
    }
    with pytest.raises(RateLimited):
        await limiter.admit(key, 80)  # counted for rpm, refused by tpm
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(key, 1)
    assert refused.value.headers is not None
    assert refused.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-tokens" not in refused.value.headers  # not asked: rpm refused first
    assert (await limiter.admit(limited(None), 10)).headers == {}


async def test_the_limiter_caps_a_charge_at_the_limit() -> None:
    limiter = RateLimiter()
    key = limited(30)
    hold = (await limiter.admit(key, 500)).hold  # larger than the limit: alone in its minute
    assert hold is not None and hold.charged == 30
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(key, 1)
    assert refused.value.retry_after is not None and 1 <= refused.value.retry_after <= 60
    await limiter.settle(hold, 12)  # 18 given back
    assert (await limiter.admit(key, 18)).hold is not None
    with pytest.raises(RateLimited):
        await limiter.admit(key, 1)


async def test_a_released_hold_gives_everything_back_and_no_limit_holds_nothing() -> None:
    limiter = RateLimiter()
    key = limited(100)
    hold = (await limiter.admit(key, 100)).hold
    await limiter.release(hold)
    assert (await limiter.admit(key, 100)).hold is not None
    assert await limiter.admit(limited(None), 10**9) == Allowance()
    await limiter.settle(None, 10)  # a request without a hold settles nothing


async def test_a_settlement_counts_at_most_the_whole_limit() -> None:
    limiter = RateLimiter()
    key = limited(100)
    hold = (await limiter.admit(key, 10)).hold
    assert hold is not None
    await limiter.settle(hold, 5_000)  # the window is full either way; 100 is all it can hold
    assert isinstance(limiter.tokens, MemoryLedger)
    minute = limiter.tokens._keys[str(key.id)]
    assert [n for _, n in minute.holds.values()] == [100] and minute.used == 100
