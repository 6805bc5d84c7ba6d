"""The gateway's Completions: endings written in batches that grow with the load, none lost."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from neuralgrid.db.errors import InvalidRequest
from neuralgrid.db.matching import JobEnd, MatchRequest, complete_job, match_job
from neuralgrid.db.store import Store
from neuralgrid.gateway.completions import Completions
from tests.conftest import LLAMA8, make_node


class CountingCompletions(Completions):
    """Counts the statements sent (the real ones, against the real database)."""

    batches: list[int]

    async def _complete(self, ends: list[JobEnd]) -> dict[uuid.UUID, float]:
        self.batches = [*getattr(self, "batches", []), len(ends)]
        return await super()._complete(ends)


def _jobs(db_url: str, count: int) -> list[uuid.UUID]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        make_node(conn, max_concurrency=256)
        return [match_job(conn, MatchRequest(model=LLAMA8)).job_id for _ in range(count)]


async def test_endings_arriving_together_share_statements_and_all_land(db_url: str) -> None:
    jobs = _jobs(db_url, 40)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        completions = CountingCompletions(Store(pool))
        costs = await asyncio.gather(
            *(
                completions.record(JobEnd(job, prompt_tokens=10, completion_tokens=5, latency_ms=50))
                for job in jobs
            )
        )
        await completions.drain()
    assert all(cost is not None and cost > 0 for cost in costs)
    assert sum(completions.batches) == 40 and len(completions.batches) < 40
    with psycopg.connect(db_url) as conn:
        assert conn.execute("select count(*) from jobs where status = 'succeeded'").fetchone() == (40,)
        assert conn.execute("select inflight, successes from nodes").fetchone() == (0, 40)


async def test_a_bad_ending_does_not_lose_the_rest_of_its_batch(db_url: str) -> None:
    jobs = _jobs(db_url, 6)
    with psycopg.connect(db_url, autocommit=True) as conn:
        complete_job(conn, jobs[0])  # ended already (as by the sweeper): reported, not an error
    ends = [JobEnd(job) for job in jobs]
    ends[3] = JobEnd(jobs[3], completion_tokens=-1)  # refused by complete_jobs(): fails its batch
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        completions = CountingCompletions(Store(pool))
        results = await asyncio.gather(*(completions.record(end) for end in ends), return_exceptions=True)
    assert results[0] is None
    assert isinstance(results[3], InvalidRequest)
    assert all(isinstance(r, float) for i, r in enumerate(results) if i not in (0, 3))
    with psycopg.connect(db_url) as conn:
        statuses: dict[uuid.UUID, str] = dict(conn.execute("select id, status from jobs").fetchall())
    assert [statuses[job] for job in jobs] == ["succeeded"] * 3 + ["running"] + ["succeeded"] * 2


@pytest.mark.parametrize("endings", [1, 3])
async def test_a_quiet_gateway_writes_each_ending_at_once(db_url: str, endings: int) -> None:
    jobs = _jobs(db_url, endings)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        completions = CountingCompletions(Store(pool))
        for job in jobs:  # one at a time: nothing waits for company
            assert await completions.record(JobEnd(job)) is not None
    assert completions.batches == [1] * endings
