"""The matcher's functions as typed sync calls (the CLI, the simulator and tests); the gateway runs
the same queries through the async Store."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.queries import Assignment, JobEnd, Match, MatchRequest, RankedNode
from neuralgrid.db.store import SyncStore

__all__ = [
    "JobEnd",
    "MatchRequest",
    "RankedNode",
    "complete_job",
    "complete_jobs",
    "failover_job",
    "match_job",
    "score_nodes",
]


def score_nodes(
    conn: psycopg.Connection[Any], request: MatchRequest, *, explain: bool = False, limit: int | None = None
) -> list[RankedNode]:
    return SyncStore(conn).all(q.SCORE_NODES, {**request.params(), "explain": explain, "limit": limit})


def match_job(
    conn: psycopg.Connection[Any],
    request: MatchRequest,
    *,
    api_key_id: UUID | None = None,
    stream: bool = False,
    fallbacks: int = 3,
    reserve_usd: float = 0.0,
) -> Match:
    return SyncStore(conn).get(
        q.MATCH_JOB, q.match_params(request, api_key_id, stream, fallbacks, reserve=reserve_usd)
    )


def failover_job(
    conn: psycopg.Connection[Any],
    job_id: UUID,
    error: str,
    *,
    http_status: int | None = None,
    candidates: list[UUID],
) -> Assignment | None:
    return SyncStore(conn).one(q.FAILOVER_JOB, (job_id, error, http_status, candidates))


def complete_job(
    conn: psycopg.Connection[Any],
    job_id: UUID,
    *,
    status: q.JobOutcome = "succeeded",
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    ttft_ms: float | None = None,
    latency_ms: float | None = None,
    error: str | None = None,
) -> float:
    """Ends a running job; returns its cost in USD."""
    params = (job_id, status, prompt_tokens, completion_tokens, ttft_ms, latency_ms, error)
    return float(SyncStore(conn).get(q.COMPLETE_JOB, params))


def complete_jobs(conn: psycopg.Connection[Any], ends: list[JobEnd]) -> dict[UUID, float]:
    """Ends a batch of running jobs in one statement; returns the cost of each job it ended."""
    return {
        row.job_id: row.cost_usd for row in SyncStore(conn).all(q.COMPLETE_JOBS, q.complete_jobs_params(ends))
    }
