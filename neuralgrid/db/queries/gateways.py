"""What gateways ask about themselves and one another: that the database answers, that they are
alive, which gateway holds which tunnel, the sweep that ends what a silent node or gateway left, and
whether the embedded Realtime feed is installed."""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from psycopg.rows import class_row, scalar_row

from neuralgrid.db.queries.query import Query

__all__ = [
    "ATTACH_TUNNEL",
    "DETACH_TUNNEL",
    "FEED_INSTALLED",
    "GATEWAY_ALIVE",
    "GATEWAY_ALIVE_AT",
    "GATEWAY_ALIVE_WAITING",
    "PING",
    "PRUNE_FEED",
    "REALTIME_FEED_INSTALLED",
    "RESTORE_TUNNELS",
    "SWEEP",
    "TUNNEL_ROUTE",
    "CheckedIn",
    "Swept",
    "TunnelRoute",
]


@dataclass(frozen=True)
class Swept:
    """One thing a sweep ended: a silent node set offline, or an abandoned job."""

    kind: str  # node_offline or job_abandoned
    id: UUID
    name: str | None


@dataclass(frozen=True)
class TunnelRoute:
    """The live gateway holding a tunnel node's socket, and where the other gateways reach it."""

    gateway_id: UUID
    internal_url: str | None


@dataclass(frozen=True)
class CheckedIn:
    """What a gateway's check-in reads: how long a job may run (the sweep ends one running longer,
    unbilled), and how long a gateway may be silent before the sweep forgets its jobs and tunnels."""

    job_deadline_s: float
    gateway_timeout_s: float


PING = Query("ping", "select 1", scalar_row)  # readiness: the database answers
GATEWAY_ALIVE = Query(
    "gateway_alive",
    "select s.job_deadline_s, s.gateway_timeout_s from public.gateway_alive(%s), public.platform_settings s",
    class_row(CheckedIn),
)
# Tunnels through any gateway (20261125000300_tunnel_routes.sql): each gateway says where the others
# reach it, records the tunnels it holds, and asks which gateway holds the tunnels it does not.
GATEWAY_ALIVE_AT = Query(
    "gateway_alive_at",
    "select s.job_deadline_s, s.gateway_timeout_s"
    " from public.gateway_alive(%s, %s), public.platform_settings s",
    class_row(CheckedIn),
)
# The requests waiting in its lines per model, for the VRAM pressure (issue 43,
# 20261204010000_scarcity_rule_and_waiting_demand.sql).
GATEWAY_ALIVE_WAITING = Query(
    "gateway_alive_waiting",
    "select s.job_deadline_s, s.gateway_timeout_s"
    " from public.gateway_alive(%s, %s, %s::jsonb), public.platform_settings s",
    class_row(CheckedIn),
)
RESTORE_TUNNELS = Query(
    "restore_tunnels", "select node_id from public.restore_tunnels(%s, %s::uuid[], %s::uuid[])", scalar_row
)
ATTACH_TUNNEL = Query("attach_tunnel", "select public.attach_tunnel(%s, %s, %s)", scalar_row)
DETACH_TUNNEL = Query("detach_tunnel", "select public.detach_tunnel(%s, %s)", scalar_row)
TUNNEL_ROUTE = Query(
    "tunnel_route", "select gateway_id, internal_url from public.tunnel_route(%s)", class_row(TunnelRoute)
)
SWEEP = Query("sweep", "select kind, id, name from public.sweep()", class_row(Swept))
# The embedded Realtime feed's pruning, where that feed is installed (not on Supabase).
FEED_INSTALLED = Query(
    "feed_installed", "select to_regprocedure('realtime.prune_feed(interval)') is not null", scalar_row
)
PRUNE_FEED = Query("prune_feed", "select realtime.prune_feed()", scalar_row)
# Whether this database carries the embedded Realtime server's feed (db/sql/realtime_feed.sql). It is
# left out where Supabase's Realtime runs (it reads the WAL itself): then the gateway serves none.
REALTIME_FEED_INSTALLED = Query(
    "realtime_feed_installed",
    "select to_regprocedure('realtime.feed_notify(jsonb)') is not null",
    scalar_row,
)
