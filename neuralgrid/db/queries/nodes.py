"""Nodes: agents registering and heartbeating, and the fleet as operators load and list it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from uuid import UUID

from psycopg.rows import class_row, dict_row, scalar_row

from neuralgrid.db.queries.query import Query

__all__ = [
    "AGENT_HEARTBEAT",
    "FLEET",
    "HEARTBEAT_INTERVAL",
    "LISTEN_NODE_SECRETS",
    "LIVE_DEMO_NODES",
    "NODE_HEARTBEAT",
    "NODE_HEARTBEATS",
    "NODE_KEY",
    "NODE_SECRET_HASH",
    "REGISTER_NODE",
    "REPLACE_NODE_MODELS",
    "SET_TUNNEL",
    "UPSERT_NODE",
    "BeatWritten",
    "HeartbeatReply",
    "NodeKey",
    "NodeStatus",
    "RegisteredNode",
]


# The states nodes.status allows, typed for Python (tests/db/test_sql_api.py keeps them equal). An
# agent may only report some of them: see neuralgrid.protocol.nodes.AgentStatus.
NodeStatus = Literal["online", "busy", "offline", "draining"]


@dataclass(frozen=True)
class RegisteredNode:
    node_id: UUID
    node_secret: str


@dataclass(frozen=True)
class HeartbeatReply:
    """What a heartbeat gets back: the node's status, and the models it should pre-load now."""

    status: str
    load: list[str]


@dataclass(frozen=True)
class BeatWritten:
    """What node_heartbeats() says of each beat of a batch: the node's status and the models it should
    pre-load now, or the error that refused the beat (error_code: its SQLSTATE; 55P03: put off, the
    node was locked)."""

    node_id: UUID
    status: str | None
    load: list[str] | None
    error: str | None
    error_code: str | None


@dataclass(frozen=True)
class NodeKey:
    """A node's secret, as the database keeps it (its SHA-256; null for a node with none)."""

    secret_hash: bytes | None


REGISTER_NODE = Query(
    "register_node",
    "select node_id, node_secret from public.register_node(%(owner)s, %(name)s, %(gpu_model)s,"
    " %(gpu_count)s, %(vram_gb)s::real, %(tflops)s::real, %(hourly_rate)s::numeric, %(region)s,"
    " %(latitude)s::float8, %(longitude)s::float8, %(endpoint_url)s, %(max_concurrency)s,"
    " %(models)s::text[], %(agent_version)s, %(key)s, %(backend)s::jsonb)",
    class_row(RegisteredNode),
)
AGENT_HEARTBEAT = Query(
    "agent_heartbeat",
    "select status, load from public.agent_heartbeat(%s, %s, %s, %s, %s::real, %s::real, %s::text[],"
    " %s::jsonb, %s, %s::jsonb, %s::text[], %s::text[], %s::jsonb)",
    class_row(HeartbeatReply),
    subject="node_id",
)
NODE_HEARTBEAT = Query("node_heartbeat", "select public.node_heartbeat(%s)", scalar_row)
# A gateway's beats of the last second, in one call (gateway/heartbeats.py).
NODE_HEARTBEATS = Query(
    "node_heartbeats",
    "select node_id, status, load, error, error_code from public.node_heartbeats(%s::jsonb)",
    class_row(BeatWritten),
)
HEARTBEAT_INTERVAL = Query(
    "heartbeat_interval", "select heartbeat_interval_s from public.platform_settings", scalar_row
)
NODE_SECRET_HASH = Query("node_secret_hash", "select secret_hash from public.nodes where id = %s", scalar_row)
NODE_KEY = Query("node_key", "select secret_hash from public.nodes where id = %s", class_row(NodeKey))
# A node's secret changed (registered again) or the node is gone: the payload is its id.
LISTEN_NODE_SECRETS = Query("listen_node_secrets", "listen neuralgrid_node_secrets", scalar_row)
SET_TUNNEL = Query("set_tunnel", "select public.set_tunnel(%s, %s)", scalar_row)
UPSERT_NODE = Query(
    "upsert_node",
    """
insert into public.nodes as n (name, gpu_model, gpu_count, vram_gb, tflops, hourly_rate, region,
  latitude, longitude, endpoint_url, status, max_concurrency, last_heartbeat_at, backend)
values (%(name)s, %(gpu_model)s, %(gpu_count)s, %(vram_gb)s, %(tflops)s, %(hourly_rate)s, %(region)s,
  %(latitude)s, %(longitude)s, %(endpoint_url)s, %(status)s, %(max_concurrency)s,
  case when %(status)s = 'offline' then null else now() end, %(backend)s)
on conflict (owner_id, name) do update set
  gpu_model = excluded.gpu_model, gpu_count = excluded.gpu_count, vram_gb = excluded.vram_gb,
  tflops = excluded.tflops, hourly_rate = excluded.hourly_rate, region = excluded.region,
  latitude = excluded.latitude, longitude = excluded.longitude, endpoint_url = excluded.endpoint_url,
  status = excluded.status, max_concurrency = excluded.max_concurrency,
  last_heartbeat_at = excluded.last_heartbeat_at, backend = excluded.backend
returning n.id
""",
    scalar_row,
)
REPLACE_NODE_MODELS = Query(
    "replace_node_models",
    """
with wanted as (
  select m, 'loaded' as state from unnest(%(loaded)s::text[]) m
  union all
  select m, 'available' from unnest(%(available)s::text[]) m where m <> all (%(loaded)s::text[])
), gone as (
  delete from public.node_models nm
  where nm.node_id = %(id)s and nm.model_id not in (select m from wanted)
)
insert into public.node_models (node_id, model_id, state)
select %(id)s, m, state from wanted
on conflict (node_id, model_id) do update set state = excluded.state
""",
    scalar_row,
)
FLEET = Query(
    "fleet",
    """
select m.id, m.name, m.gpu_model, m.gpu_count, m.vram_gb, m.tflops, m.hourly_rate::float8 as hourly_rate,
  m.region, m.latitude, m.longitude, m.status, m.inflight, m.max_concurrency, m.last_heartbeat_at,
  m.successes, m.failures, m.ewma_latency_ms, m.ewma_tokens_per_s, m.cooldown_until,
  m.warm_models, m.available_models, m.verification, g.state as gpu_proof,
  -- past the silence that makes a node offline, with no sweep run since (the platform is down)
  m.status <> 'offline' and coalesce(m.last_heartbeat_at < now()
    - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline), true) as silent
from public.node_map m
cross join public.platform_settings s
left join public.gpu_proofs g on g.node_id = m.id
order by m.region, m.name
""",
    dict_row,
)
LIVE_DEMO_NODES = Query(
    "live_demo_nodes",
    "select id from public.nodes where owner_id is null and status <> 'offline'",
    scalar_row,
)
