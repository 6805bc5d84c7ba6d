"""Job endings outlive a database restart: kept, retried with backoff, written once it answers; bad
data still fails alone; on shutdown the wait is bounded and what is given up is counted."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from neuralgrid.db.errors import InvalidRequest
from neuralgrid.db.matching import JobEnd, MatchRequest, match_job
from neuralgrid.db.store import Store
from neuralgrid.gateway.completions import Backoff, Completions, NotWritten
from tests.conftest import LLAMA8, make_key, make_node
from tests.own_postgres import OwnPostgres, own_postgres

FAST = Backoff(first_s=0.05, max_s=0.2)


@pytest.fixture(scope="module")
def pg() -> Iterator[OwnPostgres]:
    with own_postgres() as server:
        yield server


def _running_jobs(url: str, count: int) -> tuple[list[uuid.UUID], uuid.UUID]:
    """Jobs running on one node, each holding $0.01 of one key's budget; and the key."""
    with psycopg.connect(url, autocommit=True) as conn:
        make_node(conn, max_concurrency=8)
        key = make_key(conn, budget_usd=1.0)
        request = MatchRequest(model=LLAMA8)
        return [match_job(conn, request, api_key_id=key, reserve_usd=0.01).job_id for _ in range(count)], key


def _pool(url: str, timeout: float) -> AsyncConnectionPool:
    return AsyncConnectionPool(url, min_size=1, max_size=2, timeout=timeout, kwargs={"autocommit": True})


async def test_endings_kept_through_a_restart_are_written_when_the_database_is_back(
    pg: OwnPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    url = pg.fresh_database()
    jobs, key = _running_jobs(url, 3)
    async with _pool(url, timeout=0.3) as pool:
        completions = Completions(Store(pool), backoff=FAST)
        await asyncio.to_thread(pg.server.stop)
        endings = [JobEnd(job, prompt_tokens=10, completion_tokens=5, latency_ms=50) for job in jobs]
        waiters = [asyncio.ensure_future(completions.record(end)) for end in endings]
        await asyncio.sleep(1.5)  # attempts fail all along: down, then no connection in the pool
        assert not any(waiter.done() for waiter in waiters)
        await asyncio.to_thread(pg.server.start)
        costs = await asyncio.wait_for(asyncio.gather(*waiters), 10)
        await completions.drain()
    assert all(cost is not None and cost > 0 for cost in costs)
    with psycopg.connect(url) as conn:
        assert conn.execute("select count(*) from jobs where status = 'succeeded'").fetchone() == (3,)
        assert conn.execute("select inflight, successes from nodes").fetchone() == (0, 3)
        assert conn.execute("select reserved_usd from api_keys where id = %s", (key,)).fetchone() == (0,)
    outage = [r.getMessage() for r in caplog.records if "the database is unavailable" in r.getMessage()]
    assert len(outage) == 1 and "3 job endings kept" in outage[0]  # said once, however many attempts


async def test_an_ending_the_database_refuses_fails_alone_after_the_outage(pg: OwnPostgres) -> None:
    url = pg.fresh_database()
    jobs, _ = _running_jobs(url, 3)
    async with _pool(url, timeout=0.3) as pool:
        completions = Completions(Store(pool), backoff=FAST)
        await asyncio.to_thread(pg.server.stop)
        endings = [JobEnd(jobs[0]), JobEnd(jobs[1], completion_tokens=-1), JobEnd(jobs[2])]
        waiters = [asyncio.ensure_future(completions.record(end)) for end in endings]
        await asyncio.sleep(0.5)
        await asyncio.to_thread(pg.server.start)
        results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 10)
    assert isinstance(results[0], float) and isinstance(results[2], float)
    assert isinstance(results[1], InvalidRequest)  # refused once, not retried
    with psycopg.connect(url) as conn:
        statuses: dict[uuid.UUID, str] = dict(conn.execute("select id, status from jobs").fetchall())
    assert [statuses[job] for job in jobs] == ["succeeded", "running", "succeeded"]


async def test_drain_gives_up_after_its_bound_and_counts_what_it_could_not_write(
    pg: OwnPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    url = pg.fresh_database()
    jobs, _ = _running_jobs(url, 2)
    # The pool would wait 30 s for a connection: drain must not.
    async with _pool(url, timeout=30) as pool:
        completions = Completions(Store(pool), backoff=FAST, drain_timeout_s=0.5)
        await asyncio.to_thread(pg.server.stop)
        waiters = [asyncio.ensure_future(completions.record(JobEnd(job))) for job in jobs]
        await asyncio.sleep(0.2)
        started = time.monotonic()
        with caplog.at_level(logging.ERROR):
            await completions.drain()
        assert time.monotonic() - started < 3
        results = await asyncio.gather(*waiters, return_exceptions=True)
        await asyncio.to_thread(pg.server.start)  # so that the pool closes at once
    assert all(isinstance(result, NotWritten) for result in results)
    given_up = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(given_up) == 1 and given_up[0].startswith("2 job endings could not be written")
    with psycopg.connect(url) as conn:  # left to the sweep's deadline
        assert conn.execute("select count(*) from jobs where status = 'running'").fetchone() == (2,)


class LosesDeadlocks(Completions):
    """Its first `lost` writes are a deadlock's victims, as Postgres would make them."""

    def __init__(self, store: Store, lost: int) -> None:
        super().__init__(store, backoff=FAST)
        self.lost = lost

    async def _complete(self, ends: list[JobEnd]) -> dict[uuid.UUID, float]:
        if self.lost:
            self.lost -= 1
            raise psycopg.errors.DeadlockDetected("deadlock detected")
        return await super()._complete(ends)


async def test_an_ending_alone_that_loses_a_deadlock_is_written_again(
    pg: OwnPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """A deadlock's victim did nothing wrong: written again at once, the ending lands (a batch of one
    is the usual case on a quiet gateway), so its slot is not held until the sweep; and a deadlock
    is not an outage (no pause, no warning that the database is unavailable)."""
    url = pg.fresh_database()
    jobs, _ = _running_jobs(url, 1)
    async with _pool(url, timeout=5) as pool:
        completions = LosesDeadlocks(Store(pool), lost=2)
        cost = await asyncio.wait_for(
            completions.record(JobEnd(jobs[0], completion_tokens=5, latency_ms=50)), 10
        )
        await completions.drain()
    assert cost is not None and "unavailable" not in caplog.text
    with psycopg.connect(url) as conn:
        assert conn.execute("select status from jobs").fetchall() == [("succeeded",)]
