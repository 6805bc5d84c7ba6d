"""The gateway's Claims: placements grouped in place_jobs() calls that grow with the load, each
request answered with its own match or its own error, and no slot left held by a client that left."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from neuralgrid.db import queries as q
from neuralgrid.db.errors import BudgetExhausted, DatabaseError, InvalidRequest
from neuralgrid.db.store import Params, Store
from neuralgrid.gateway.claims import Claims
from neuralgrid.gateway.completions import Completions
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline import meter
from neuralgrid.gateway.pipeline.meter import Meter, Metering
from neuralgrid.gateway.ratelimit import RateLimiter, TokenHold
from tests.conftest import LLAMA8, make_key, make_node, wait_for

GATEWAY = uuid.UUID("00000000-0000-4000-8000-00000000000b")


class CountingStore(Store):
    """Counts the place_jobs() statements sent, and the requests in each (the real database's)."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        super().__init__(pool)
        self.groups: list[int] = []

    async def all(self, query: q.Query[Any], params: Params = None) -> list[Any]:
        if query is q.PLACE_JOBS and isinstance(params, tuple):
            self.groups.append(len(params[1].obj))
        return await super().all(query, params)


def params(key: uuid.UUID) -> Mapping[str, Any]:
    request = q.MatchRequest(model=LLAMA8, route="chat/completions")
    return {
        **q.match_params(request, key, False, 2, prompt_bytes=100, max_out=16, wait=True),
        "end_user": None,
    }


def fleet(db_url: str, slots: int) -> uuid.UUID:
    with psycopg.connect(db_url, autocommit=True) as conn:
        make_node(conn, max_concurrency=slots)
        return make_key(conn)


async def test_placements_arriving_together_share_statements(db_url: str) -> None:
    key = fleet(db_url, 64)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        store = CountingStore(pool)
        claims = Claims(store, GATEWAY, abandon=lambda job: None)
        matches = await asyncio.gather(*(claims.place(params(key)) for _ in range(40)))
    assert len({match.job_id for match in matches}) == 40 and all(match.node_id for match in matches)
    assert sum(store.groups) == 40 and len(store.groups) < 40 and max(store.groups) <= 16
    with psycopg.connect(db_url) as conn:
        assert conn.execute("select inflight from nodes").fetchone() == (40,)
        assert conn.execute("select count(*) from jobs where gateway_id = %s", (GATEWAY,)).fetchone() == (40,)


async def test_a_quiet_gateway_places_each_request_at_once(db_url: str) -> None:
    key = fleet(db_url, 4)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        store = CountingStore(pool)
        claims = Claims(store, GATEWAY, abandon=lambda job: None)
        for _ in range(3):  # one at a time: nothing waits for company
            assert (await claims.place(params(key))).node_id is not None
    assert store.groups == [1, 1, 1]


async def test_a_request_that_cannot_be_placed_fails_alone_with_its_own_error(db_url: str) -> None:
    key = fleet(db_url, 8)
    with psycopg.connect(db_url, autocommit=True) as conn:
        broke = make_key(conn, budget_usd=0)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        store = CountingStore(pool)
        claims = Claims(store, GATEWAY, abandon=lambda job: None)
        results = await asyncio.gather(
            *(claims.place(params(k)) for k in (key, key, broke, key)), return_exceptions=True
        )
    assert isinstance(results[2], BudgetExhausted)
    assert all(isinstance(result, q.Match) and result.node_id for i, result in enumerate(results) if i != 2)
    assert store.groups == [4]  # one statement: the failure among the others, which it did not fail


@pytest.mark.parametrize("gone", ["in Postgres", "in line"])
async def test_a_client_that_leaves_while_being_placed_holds_no_slot(db_url: str, gone: str) -> None:
    """Its request may still get a node: that job is ended at once, not held until the sweep."""
    key = fleet(db_url, 4)
    async with AsyncConnectionPool(db_url, min_size=2, max_size=3, kwargs={"autocommit": True}) as pool:
        store = CountingStore(pool)
        metering = Metering(Completions(store), RateLimiter(), Metrics())
        claims = Claims(store, GATEWAY, abandon=metering.abandon)
        with psycopg.connect(db_url) as blocker:  # holds the node's row: the claim waits for it
            blocker.execute("select id from nodes for update")
            ahead = asyncio.create_task(claims.place(params(key)))
            if gone == "in Postgres":  # in the same group as the first: both tasks start before it
                leaving = asyncio.create_task(claims.place(params(key)))
            # The group waits for the row 100 ms at most (place_jobs()): seen within a few, not the
            # 20 ms polls (each on a new connection) of wait_for, which a busy machine let run past it.
            await asyncio.to_thread(_until_waiting_on_a_lock, db_url)
            if gone == "in Postgres":  # the group under way: the first request's
                ahead.cancel()
            else:  # the next group, waiting its turn (found: it had been put in the first group)
                leaving = asyncio.create_task(claims.place(params(key)))
                await asyncio.sleep(0)
                assert store.groups == [1] and len(claims._waiting) == 1
                leaving.cancel()
            blocker.rollback()
        stayed = await (leaving if gone == "in Postgres" else ahead)
        assert stayed.node_id is not None
        await metering.drain()
    # Gone in line, it was never placed; gone in Postgres, its job was ended.
    assert _statuses(db_url) == {"in Postgres": {"cancelled", "running"}, "in line": {"running"}}[gone]
    with psycopg.connect(db_url) as conn:
        assert conn.execute("select inflight from nodes").fetchone() == (1,)  # the request that stayed


def _waiting_on_a_lock(db_url: str) -> bool:
    with psycopg.connect(db_url) as conn:
        return _a_backend_waits_on_a_lock(conn)


def _until_waiting_on_a_lock(db_url: str, timeout: float = 5.0) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        deadline = time.monotonic() + timeout
        while not _a_backend_waits_on_a_lock(conn):
            assert time.monotonic() < deadline, "no backend waited on a lock"
            time.sleep(0.001)


def _a_backend_waits_on_a_lock(conn: psycopg.Connection) -> bool:
    row = conn.execute(
        "select count(*) from pg_stat_activity where wait_event_type = 'Lock' and datname = current_database()"
    ).fetchone()
    return row is not None and row[0] > 0


def _statuses(db_url: str) -> set[str]:
    with psycopg.connect(db_url) as conn:
        return {row[0] for row in conn.execute("select status from jobs").fetchall()}


async def test_a_request_that_would_wait_behind_its_groups_locks_is_asked_again(db_url: str) -> None:
    """In the next group it goes first, and waits for the lock as a request placed alone does."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        nodes = {make_node(conn, max_concurrency=1), make_node(conn, max_concurrency=1)}
        key = make_key(conn)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        store = CountingStore(pool)
        claims = Claims(store, GATEWAY, abandon=lambda job: None)
        with psycopg.connect(db_url) as completion:  # holds one node's row, as complete_jobs() does
            completion.execute("select id from nodes order by id limit 1 for no key update")
            placing = asyncio.gather(claims.place(params(key)), claims.place(params(key)))
            # The second asked again, alone, and waits for the lock: 100 ms as the first of a group,
            # then as long as it takes, placed with place_job() on a connection of its own.
            await asyncio.to_thread(wait_for, lambda: store.groups == [2, 1] and _waiting_on_a_lock(db_url))
            await asyncio.sleep(0.5)
            assert store.groups == [2, 1] and _waiting_on_a_lock(db_url)
            completion.rollback()
        matches = await placing
    assert {match.node_id for match in matches} == nodes


async def test_a_request_postgres_cannot_read_fails_alone(db_url: str) -> None:
    """A group refused whole (here a price cap that is not a number, which JSON cannot hold) is
    placed request by request, so that only the request at fault fails."""
    key = fleet(db_url, 8)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        store = CountingStore(pool)
        claims = Claims(store, GATEWAY, abandon=lambda job: None)
        unreadable = {**params(key), "max_rate": float("nan")}
        results = await asyncio.gather(
            *(claims.place(p) for p in (params(key), unreadable, {**params(key), "end_user": "a\x00b"})),
            return_exceptions=True,
        )
    assert isinstance(results[1], InvalidRequest)
    assert all(isinstance(result, q.Match) and result.node_id for result in (results[0], results[2]))
    assert store.groups == [3, 1, 1, 1]
    with psycopg.connect(db_url) as conn:  # text Postgres cannot hold arrives with U+FFFD in its place
        assert conn.execute("select end_user from jobs where end_user is not null").fetchone() == (
            "a\ufffdb",
        )


class BrokenOnce(Store):
    """Answers the first place_jobs() with a row that names no request of the group (a bug's)."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        super().__init__(pool)
        self.broken = False

    async def all(self, query: q.Query[Any], params: Params = None) -> list[Any]:
        rows = await super().all(query, params)
        if query is q.PLACE_JOBS and not self.broken:
            self.broken = True
            await asyncio.sleep(0.2)  # the other requests arrive meanwhile: they wait for the next group
            return [q.GroupedMatch(**{**vars(rows[0]), "ord": 99})]
        return rows


async def test_a_group_that_breaks_fails_its_requests_and_the_next_are_still_placed(db_url: str) -> None:
    """A bug in reading a group's answer fails that group's requests (each gets the error), and the
    requests waiting behind it are placed: none is left hanging with no placer."""
    key = fleet(db_url, 64)
    let_go: list[uuid.UUID] = []
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        claims = Claims(BrokenOnce(pool), GATEWAY, abandon=let_go.append)
        first = asyncio.ensure_future(claims.place(params(key)))
        await asyncio.sleep(0.05)
        behind = [asyncio.ensure_future(claims.place(params(key))) for _ in range(3)]
        async with asyncio.timeout(10):
            with pytest.raises((IndexError, DatabaseError)):
                await first
            placed = await asyncio.gather(*behind)
    assert all(match.node_id is not None for match in placed)
    with psycopg.connect(db_url) as conn:  # the broken row's job is let go, not kept until the sweep
        running = {row[0] for row in conn.execute("select id from jobs where status = 'running'")}
    assert len(let_go) == 1 and let_go[0] in running and len(running) == 4


class SilentRedis(RateLimiter):
    """A tpm settlement that never comes back (a Redis that does not answer)."""

    async def settle(self, hold: TokenHold | None, tokens: int) -> None:
        await asyncio.Event().wait()


async def test_shutdown_does_not_wait_for_ever_on_a_settlement(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(meter, "DRAIN_S", 0.5, raising=False)
    key = fleet(db_url, 4)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        store = Store(pool)
        metering = Metering(Completions(store), SilentRedis(), Metrics())
        match = await Claims(store, GATEWAY, abandon=metering.abandon).place(params(key))
        assert match.node_id is not None
        metering.finish(Meter(match.job_id, match.node_id, sent=0.0), "succeeded", None)
        async with asyncio.timeout(5):
            await metering.drain()
    with psycopg.connect(db_url) as conn:  # the ending itself was written
        assert conn.execute("select status from jobs").fetchone() == ("succeeded",)
