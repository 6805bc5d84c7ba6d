"""Thin bindings to the SQL matcher: bind parameters, call the function, read typed rows."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from uuid import UUID

import psycopg
from psycopg.rows import class_row

from neuralgrid.db.errors import translate


@dataclass(frozen=True)
class MatchRequest:
    """What a caller asks of the matcher."""

    model: str
    min_vram_gb: float | None = None
    policy: str = "balanced"
    region: str | None = None
    latitude: float | None = None
    longitude: float | None = None
    max_hourly_rate: float | None = None


@dataclass(frozen=True)
class RankedNode:
    """One row of score_nodes(): a ranked candidate, or (rank None) a rejected node and why."""

    node_id: UUID
    name: str
    rank: int | None
    score: float | None
    fit: float | None
    compute: float | None
    price: float | None
    warm: float | None
    capacity: float | None
    reputation: float | None
    proximity: float | None
    reject_reason: str | None


@dataclass(frozen=True)
class Match:
    """match_job()'s answer: the job, the claimed node (None if none could take it), fallbacks."""

    job_id: UUID
    node_id: UUID | None
    endpoint_url: str | None
    node_key: bytes | None
    attempt: int
    fallback_ids: list[UUID] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class Assignment:
    """failover_job()'s answer: the next node a job runs on."""

    node_id: UUID
    endpoint_url: str | None
    node_key: bytes | None
    attempt: int


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except psycopg.Error as err:
        raise translate(err) from err


def _request_params(request: MatchRequest) -> dict[str, object]:
    return {
        "model": request.model,
        "min_vram": request.min_vram_gb,
        "policy": request.policy,
        "region": request.region,
        "lat": request.latitude,
        "lon": request.longitude,
        "max_rate": request.max_hourly_rate,
    }


def score_nodes(
    conn: psycopg.Connection,
    request: MatchRequest,
    *,
    explain: bool = False,
    limit: int | None = None,
) -> list[RankedNode]:
    with _translated(), conn.cursor(row_factory=class_row(RankedNode)) as cur:
        cur.execute(
            "select * from public.score_nodes(%(model)s, %(min_vram)s::real, %(policy)s, %(region)s,"
            " %(lat)s::float8, %(lon)s::float8, %(max_rate)s::numeric, %(explain)s, %(limit)s::int)",
            {**_request_params(request), "explain": explain, "limit": limit},
        )
        return cur.fetchall()


MATCH_JOB = (
    "select * from public.match_job(%(model)s, %(key)s, %(policy)s, %(min_vram)s::real,"
    " %(region)s, %(lat)s::float8, %(lon)s::float8, %(max_rate)s::numeric, %(stream)s,"
    " %(fallbacks)s, %(reserve)s::numeric)"
)


def match_params(
    request: MatchRequest, api_key_id: UUID | None, stream: bool, fallbacks: int, reserve_usd: float
) -> dict[str, object]:
    """Parameters for MATCH_JOB, shared by these bindings and the async gateway."""
    return {
        **_request_params(request),
        "key": api_key_id,
        "stream": stream,
        "fallbacks": fallbacks,
        "reserve": reserve_usd,
    }


def match_job(
    conn: psycopg.Connection,
    request: MatchRequest,
    *,
    api_key_id: UUID | None = None,
    stream: bool = False,
    fallbacks: int = 3,
    reserve_usd: float = 0.0,
) -> Match:
    with _translated(), conn.cursor(row_factory=class_row(Match)) as cur:
        cur.execute(MATCH_JOB, match_params(request, api_key_id, stream, fallbacks, reserve_usd))
        row = cur.fetchone()
        assert row is not None  # match_job always returns exactly one row
        return row


def failover_job(
    conn: psycopg.Connection,
    job_id: UUID,
    error: str,
    *,
    http_status: int | None = None,
    candidates: list[UUID],
) -> Assignment | None:
    with _translated(), conn.cursor(row_factory=class_row(Assignment)) as cur:
        cur.execute(
            "select * from public.failover_job(%s, %s, %s, %s::uuid[])",
            (job_id, error, http_status, candidates),
        )
        return cur.fetchone()


def complete_job(
    conn: psycopg.Connection,
    job_id: UUID,
    *,
    status: str = "succeeded",
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    ttft_ms: float | None = None,
    latency_ms: float | None = None,
    error: str | None = None,
) -> float:
    """Ends a running job; returns its cost in USD."""
    with _translated():
        row = conn.execute(
            "select cost_usd from public.complete_job(%s, %s, %s, %s, %s::real, %s::real, %s)",
            (job_id, status, prompt_tokens, completion_tokens, ttft_ms, latency_ms, error),
        ).fetchone()
    assert row is not None
    return float(row[0])


@dataclass(frozen=True)
class JobEnd:
    """How one job ended, as complete_jobs() takes it."""

    job_id: UUID
    status: str = "succeeded"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    latency_ms: float | None = None
    error: str | None = None


COMPLETE_JOBS = (
    "select job_id, cost_usd::float8 from public.complete_jobs("
    "%s::uuid[], %s::text[], %s::int[], %s::int[], %s::real[], %s::real[], %s::text[])"
)


def complete_jobs_params(ends: list[JobEnd]) -> tuple[list[object], ...]:
    """The batch as complete_jobs() takes it: one array per field."""
    columns = ("job_id", "status", "prompt_tokens", "completion_tokens", "ttft_ms", "latency_ms", "error")
    return tuple([getattr(end, column) for end in ends] for column in columns)


def complete_jobs(conn: psycopg.Connection, ends: list[JobEnd]) -> dict[UUID, float]:
    """Ends a batch of running jobs in one statement; returns the cost of each job it ended."""
    with _translated():
        rows = conn.execute(COMPLETE_JOBS, complete_jobs_params(ends)).fetchall()
    return {row[0]: row[1] for row in rows}
