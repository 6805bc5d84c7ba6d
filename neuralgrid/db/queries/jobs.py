"""Placing a job on a node, moving it to another, and ending it: the matcher's calls and what they
take and give (see 20261121000500_matcher.sql and later)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from uuid import UUID

from psycopg.rows import class_row, scalar_row

from neuralgrid.db.queries.query import Query

__all__ = [
    "COMPLETE_JOB",
    "COMPLETE_JOBS",
    "CONTINUING_NODES",
    "FAILOVER_JOB",
    "HANDOFF_JOB",
    "LISTEN_FREE_SLOTS",
    "MATCH_JOB",
    "PLACE_JOB",
    "PLACE_JOBS",
    "REJECT_JOB",
    "SCORE_NODES",
    "Assignment",
    "GroupedMatch",
    "JobCost",
    "JobEnd",
    "JobOutcome",
    "JobStatus",
    "Match",
    "MatchRequest",
    "RankedNode",
    "complete_jobs_params",
    "match_params",
]


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
    route: str | None = None  # the path after /v1/ (neuralgrid.protocol.routes); None: any route

    def params(self) -> dict[str, object]:
        return {
            "model": self.model,
            "min_vram": self.min_vram_gb,
            "policy": self.policy,
            "region": self.region,
            "lat": self.latitude,
            "lon": self.longitude,
            "max_rate": self.max_hourly_rate,
            "route": self.route,
        }


# The states the tables' check constraints allow, typed for Python (tests/db/test_sql_api.py keeps
# them equal). NodeStatus is with the nodes (queries/nodes.py).
JobStatus = Literal["running", "succeeded", "failed", "cancelled"]
JobOutcome = Literal["succeeded", "failed", "cancelled"]  # how a job ends: a JobStatus but running


@dataclass(frozen=True)
class JobEnd:
    """How one job ended, as complete_jobs() takes it."""

    job_id: UUID
    status: JobOutcome = "succeeded"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    latency_ms: float | None = None
    error: str | None = None


def match_params(
    request: MatchRequest, api_key_id: UUID | None, stream: bool, fallbacks: int, **hold: float
) -> dict[str, object]:
    """match_job()'s parameters; the budget hold as `reserve` in USD (MATCH_JOB), or as
    `prompt_bytes` and `max_out` for SQL to price (PLACE_JOB)."""
    return {**request.params(), "key": api_key_id, "stream": stream, "fallbacks": fallbacks, **hold}


def complete_jobs_params(ends: list[JobEnd]) -> tuple[list[object], ...]:
    """A batch of endings as complete_jobs() takes it: one array per field."""
    columns = ("job_id", "status", "prompt_tokens", "completion_tokens", "ttft_ms", "latency_ms", "error")
    return tuple([getattr(end, column) for end in ends] for column in columns)


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
    reserve: float | None
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
    max_output_tokens: int | None = None  # PLACE_JOB: the answer's cap, what the budget pays for
    busy: bool = False  # PLACE_JOB asked to wait: every capable node is busy, and no job was recorded
    # PLACE_JOB: the decode speed of the node, then of each fallback (None: unknown), for timeouts
    tokens_per_s: list[float | None] = field(default_factory=list)
    # PLACE_JOB, when no node was claimed: none (no capable node online), route (capable nodes online,
    # none serving the request's route), busy or cooling
    refusal: str | None = None
    # PLACE_JOBS: the slot claimed is one the gateway lent from its leases (its lease one smaller now)
    lent: bool = False


@dataclass(frozen=True)
class GroupedMatch(Match):
    """One request's row of place_jobs(): its place in the group (from 1) and, when placing it
    failed, the SQLSTATE and message place_job() raised (then the Match's fields are empty)."""

    ord: int = 0
    failure_state: str | None = None
    failure: str | None = None


@dataclass(frozen=True)
class Assignment:
    """A node a job runs on: the first (from a Match) or the next (failover_job, handoff_job)."""

    node_id: UUID
    endpoint_url: str | None
    node_key: bytes | None
    attempt: int


@dataclass(frozen=True)
class JobCost:
    job_id: UUID
    cost_usd: float


SCORE_NODES = Query(
    "score_nodes",
    "select * from public.score_nodes(%(model)s, %(min_vram)s::real, %(policy)s, %(region)s,"
    " %(lat)s::float8, %(lon)s::float8, %(max_rate)s::numeric, %(explain)s, %(limit)s::int, %(route)s::text)",
    class_row(RankedNode),
    subject="model",
)
MATCH_JOB = Query(
    "match_job",
    "select * from public.match_job(%(model)s, %(key)s, %(policy)s, %(min_vram)s::real,"
    " %(region)s, %(lat)s::float8, %(lon)s::float8, %(max_rate)s::numeric, %(stream)s,"
    " %(fallbacks)s, %(reserve)s::numeric)",
    class_row(Match),
    subject="model",
)
# The gateway's call: only nodes serving the request's route (20261128000100_node_routes.sql). The
# budget hold is priced in SQL from the catalog (the request's size and its answer at max_tokens), by
# the same prices complete_jobs() charges. With `wait`, a request that finds every capable node busy
# comes back `busy`, unrecorded, to wait for a slot.
# The gateway names itself and the request's end user (its `user` field) for this statement only
# (set local; the lateral join runs place_job() after it): the job records which gateway placed it,
# and ends soon if that gateway dies, and whose request it was.
PLACE_JOB = Query(
    "place_job",
    "select m.* from (select set_config('neuralgrid.gateway_id', %(gateway)s::text, true),"
    " set_config('neuralgrid.end_user', coalesce(%(end_user)s::text, ''), true)) as g,"
    " lateral public.place_job(%(model)s, %(key)s, %(policy)s, %(min_vram)s::real,"
    " %(region)s, %(lat)s::float8, %(lon)s::float8, %(max_rate)s::numeric, %(stream)s,"
    " %(fallbacks)s, %(prompt_bytes)s::int, %(max_out)s::int, %(wait)s, %(route)s::text) as m",
    class_row(Match),
    subject="model",
)
# Requests placed together (gateway/claims.py): each request's PLACE_JOB parameters but the gateway,
# as a JSON array of objects.
PLACE_JOBS = Query("place_jobs", "select * from public.place_jobs(%s, %s)", class_row(GroupedMatch))
FAILOVER_JOB = Query(
    "failover_job",
    "select node_id, endpoint_url, node_key, attempt from public.failover_job(%s, %s, %s, %s::uuid[])",
    class_row(Assignment),
)
HANDOFF_JOB = Query(
    "handoff_job",
    "select node_id, endpoint_url, node_key, attempt from public.handoff_job(%s, %s, %s::int, %s::uuid[])",
    class_row(Assignment),
)
CONTINUING_NODES = Query("continuing_nodes", "select unnest(public.continuing_nodes(%s::uuid[]))", scalar_row)
REJECT_JOB = Query("reject_job", "select public.reject_job(%s, %s, %s)", scalar_row)
COMPLETE_JOB = Query(
    "complete_job",
    "select cost_usd::float8 from public.complete_job(%s, %s, %s, %s, %s::real, %s::real, %s)",
    scalar_row,
)
COMPLETE_JOBS = Query(
    "complete_jobs",
    "select job_id, cost_usd::float8 as cost_usd from public.complete_jobs("
    "%s::uuid[], %s::text[], %s::int[], %s::int[], %s::real[], %s::real[], %s::text[])",
    class_row(JobCost),
)
# A node has a slot to give (announce_free_slot): gateways wake the requests waiting for one.
LISTEN_FREE_SLOTS = Query("listen_free_slots", "listen neuralgrid_slots", scalar_row)
