"""Leases and what is served from them (docs/scaling.md#far-from-the-database-leases): the slots a
gateway holds and renews, the escrow it spends budgets from, and the jobs it writes behind."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from uuid import UUID

from psycopg.rows import class_row, scalar_row

from neuralgrid.db.queries.jobs import Assignment
from neuralgrid.db.queries.query import Query

__all__ = [
    "LEASE_SECONDS",
    "MOVE_TO_LEASE",
    "RECORD_JOBS",
    "RENEW_ESCROWS",
    "RENEW_LEASES",
    "EscrowRow",
    "LeaseRow",
    "RecordedJob",
]


@dataclass(frozen=True)
class LeaseRow:
    """One lease a gateway holds after a renewal: slots of a node for a lane, ranked."""

    model_id: str
    policy: str
    region: str
    node_id: UUID
    endpoint_url: str | None  # None: a tunneled node no gateway holds now
    node_key: bytes | None
    slots: int  # 0: a fallback, ranked after the leases, where a failed leased job may move
    in_use: int
    rank: int
    tokens_per_s: float | None
    routes: list[str] | None
    expires_at: datetime
    hourly_rate: Decimal | None = None  # what the node costs an hour: a price cap filters on it
    # The gateway's jobs SQL had placed on the node whose slots this renewal moved into the lease.
    absorbed: list[UUID] | None = None
    draining: int = 0  # slots held above the gateway's share, in use: not to be taken again
    share: int | None = None  # the gateway's share of the lane's slots


@dataclass(frozen=True)
class EscrowRow:
    api_key_id: UUID
    usd: Decimal | None  # None: the key has no budget, and needs no escrow
    free_usd: Decimal | None


@dataclass(frozen=True)
class RecordedJob:
    job_id: UUID
    cost_usd: Decimal | None
    recorded: str


RENEW_LEASES = Query(
    "renew_leases",
    "select model_id, policy, region, node_id, endpoint_url, node_key, slots, in_use, rank, tokens_per_s,"
    " routes, expires_at, hourly_rate, absorbed, draining, share"
    " from public.renew_leases(%s, %s::jsonb)",
    class_row(LeaseRow),
)
LEASE_SECONDS = Query("lease_seconds", "select lease_s::float8 from public.platform_settings", scalar_row)
RENEW_ESCROWS = Query(
    "renew_escrows",
    "select api_key_id, usd, free_usd from public.renew_escrows(%s, %s::jsonb)",
    class_row(EscrowRow),
)
RECORD_JOBS = Query(
    "record_jobs",
    "select job_id, cost_usd, recorded from public.record_jobs(%s, %s::jsonb)",
    class_row(RecordedJob),
)
MOVE_TO_LEASE = Query(
    "move_to_lease",
    "select node_id, endpoint_url, node_key, attempt from public.move_to_lease(%s, %s, %s::int, %s)",
    class_row(Assignment),
)
