"""Every statement the platform runs, named once, with the shape of its rows.

The rules live in SQL functions (supabase/migrations/); these are the calls to them and the few
plain reads the pages and the CLI show. `Store` (db/store.py) runs them. Two parts keep their own
SQL because it is about Postgres itself rather than the platform's data: the migration runner
(db/migrate.py) and the Realtime server's feed and authorization (realtime/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Generic, Literal, TypeVar
from uuid import UUID

from psycopg.rows import BaseRowFactory, class_row, dict_row, scalar_row

R = TypeVar("R", covariant=True)


@dataclass(frozen=True)
class Query(Generic[R]):
    """A named statement, the row factory that types its rows, and the parameter a NotFound from it
    is about (for the API's error)."""

    name: str
    sql: str
    rows: BaseRowFactory[R]
    subject: str | None = None


# --- what callers pass ---------------------------------------------------------------------------


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
# them equal). An agent may only report some of them: see neuralgrid.protocol.nodes.AgentStatus.
NodeStatus = Literal["online", "busy", "offline", "draining"]
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


# --- rows --------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class ModelKind:
    """A catalog model's kind (chat, completion, embedding…) and context length in tokens."""

    id: str
    kind: str
    context_length: int


@dataclass(frozen=True)
class KeyRecord:
    """An API key as authentication reads it (never the key itself: its SHA-256)."""

    id: UUID
    owner_id: UUID | None
    name: str
    key_hash: bytes
    rpm_limit: int | None
    tpm_limit: int | None
    budget_usd: Decimal | None
    revoked: bool


@dataclass(frozen=True)
class CreatedKey:
    id: UUID
    api_key: str
    prefix: str


@dataclass(frozen=True)
class ActiveKey:
    id: UUID
    prefix: str


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


# --- matching: score, claim, move, end (see 20261121000500_matcher.sql and later) ---------------

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


@dataclass(frozen=True)
class CheckedIn:
    """What a gateway's check-in reads: how long a job may run (the sweep ends one running longer,
    unbilled), and how long a gateway may be silent before the sweep forgets its jobs and tunnels."""

    job_deadline_s: float
    gateway_timeout_s: float


GATEWAY_ALIVE = Query(
    "gateway_alive",
    "select s.job_deadline_s, s.gateway_timeout_s from public.gateway_alive(%s), public.platform_settings s",
    class_row(CheckedIn),
)
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
MODEL_KINDS = Query("model_kinds", "select id, kind, context_length from public.models", class_row(ModelKind))


@dataclass(frozen=True)
class ServedModel:
    id: str
    online_nodes: int
    in_catalog: bool
    created: int  # Unix time: the catalog's entry, else the first holder's registration


@dataclass(frozen=True)
class KeyUsage:
    requests: int
    succeeded: int
    failed: int
    cancelled: int
    running: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    spent_usd: float
    held_usd: float


MODELS = Query(
    "models",
    """
select m.id, count(n.id) filter (where n.status in ('online', 'busy')) as online_nodes,
  bool_or(c.id is not null) as in_catalog,
  floor(extract(epoch from coalesce(min(c.created_at), min(n.created_at))))::int8 as created
from (select id from public.models union select model_id from public.node_models) m (id)
left join public.models c on c.id = m.id
left join public.node_models nm on nm.model_id = m.id
left join public.nodes n on n.id = nm.node_id
group by m.id order by m.id
""",
    class_row(ServedModel),
)


@dataclass(frozen=True)
class ModelInfo:
    """One model for GET /v1/models/{model}: its online nodes, its catalog kind (None when it is
    not in the catalog), and the routes its online nodes serve."""

    id: str
    online_nodes: int
    in_catalog: bool
    created: int  # as ServedModel's
    kind: str | None
    routes: list[str]


# No row: neither in the catalog nor held by any node.
MODEL = Query(
    "model",
    """
select %(model)s::text as id,
  count(distinct n.id) filter (where n.status in ('online', 'busy')) as online_nodes,
  c.id is not null as in_catalog, c.kind,
  floor(extract(epoch from coalesce(min(c.created_at), min(n.created_at))))::int8 as created,
  coalesce(array_agg(distinct r.route order by r.route)
           filter (where r.route is not null and n.status in ('online', 'busy')), '{}') as routes
from (select 1) one
left join public.models c on c.id = %(model)s
left join public.node_models nm on nm.model_id = %(model)s
left join public.nodes n on n.id = nm.node_id
left join lateral unnest(n.routes) as r (route) on true
group by c.id, c.kind
having c.id is not null or count(nm.node_id) > 0
""",
    class_row(ModelInfo),
)
KEY_USAGE = Query(
    "key_usage",
    """
select count(j.id) as requests, count(j.id) filter (where j.status = 'succeeded') as succeeded,
  count(j.id) filter (where j.status = 'failed') as failed,
  count(j.id) filter (where j.status = 'cancelled') as cancelled,
  count(j.id) filter (where j.status = 'running') as running,
  coalesce(sum(j.prompt_tokens), 0)::int8 as prompt_tokens,
  coalesce(sum(j.completion_tokens), 0)::int8 as completion_tokens,
  coalesce(sum(j.cost_usd), 0)::float8 as cost_usd,
  k.spent_usd::float8 as spent_usd, k.reserved_usd::float8 as held_usd
from public.api_keys k
left join public.jobs j on j.api_key_id = k.id and (%(user)s::text is null or j.end_user = %(user)s)
where k.id = %(key)s
group by k.id
""",
    class_row(KeyUsage),
)

# --- API keys ----------------------------------------------------------------------------------

KEY_BY_HASH = Query(
    "key_by_hash",
    "select id, owner_id, name, key_hash, rpm_limit, tpm_limit, budget_usd, revoked_at is not null as revoked"
    " from public.api_keys where key_hash = %s",
    class_row(KeyRecord),
)
# Every change to api_keys is announced here (notify_api_key_change): gateways drop cached keys.
LISTEN_KEY_CHANGES = Query("listen_key_changes", "listen neuralgrid_api_keys", scalar_row)
# A node has a slot to give (announce_free_slot): gateways wake the requests waiting for one.
LISTEN_FREE_SLOTS = Query("listen_free_slots", "listen neuralgrid_slots", scalar_row)
CREATE_KEY = Query(
    "create_key",
    "select id, api_key, prefix from public.create_api_key(%s, %s::int, %s::int, %s::numeric)",
    class_row(CreatedKey),
)
# As the service this lists every key; as a signed-in user, RLS leaves their own.
LIST_KEYS = Query(
    "list_keys",
    "select id, name, prefix, rpm_limit, tpm_limit, budget_usd::float8 as budget_usd,"
    " spent_usd::float8 as spent_usd, created_at, last_used_at, revoked_at"
    " from public.api_keys order by created_at",
    dict_row,
)
ACTIVE_KEYS_MATCHING = Query(
    "active_keys_matching",
    "select id, prefix from public.api_keys where revoked_at is null and (id::text = %s or prefix = %s)",
    class_row(ActiveKey),
)
REVOKE_KEY = Query(
    "revoke_key",
    "update public.api_keys set revoked_at = now() where id = %s and revoked_at is null returning id",
    scalar_row,
)

# --- nodes: agents, tunnels, fleets, the sweeper ------------------------------------------------

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
PING = Query("ping", "select 1", scalar_row)  # readiness: the database answers
HEARTBEAT_INTERVAL = Query(
    "heartbeat_interval", "select heartbeat_interval_s from public.platform_settings", scalar_row
)
NODE_SECRET_HASH = Query("node_secret_hash", "select secret_hash from public.nodes where id = %s", scalar_row)
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
  m.warm_models, m.available_models
from public.node_map m
order by m.region, m.name
""",
    dict_row,
)
LIVE_DEMO_NODES = Query(
    "live_demo_nodes",
    "select id from public.nodes where owner_id is null and status <> 'offline'",
    scalar_row,
)
SWEEP = Query("sweep", "select kind, id, name from public.sweep()", class_row(Swept))
# The embedded Realtime feed's pruning, where that feed is installed (not on Supabase).
FEED_INSTALLED = Query(
    "feed_installed", "select to_regprocedure('realtime.prune_feed(interval)') is not null", scalar_row
)
PRUNE_FEED = Query("prune_feed", "select realtime.prune_feed()", scalar_row)
# Tunnels through any gateway (20261125000300_tunnel_routes.sql): each gateway says where the others
# reach it, records the tunnels it holds, and asks which gateway holds the tunnels it does not.
GATEWAY_ALIVE_AT = Query(
    "gateway_alive_at",
    "select s.job_deadline_s, s.gateway_timeout_s"
    " from public.gateway_alive(%s, %s), public.platform_settings s",
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

# --- the web pages -----------------------------------------------------------------------------

# Read as anon: the public map (node_map), each row as JSON as the Data API renders it (numbers as
# numbers, times in ISO 8601), which is how a hosted project's page reads the same view.
MAP_NODES = Query("map_nodes", "select to_jsonb(m) from public.node_map m order by m.name, m.id", scalar_row)
# The map's totals (fleet_stats(): jobs are private, it returns aggregates only).
FLEET_STATS = Query("fleet_stats", "select * from public.fleet_stats()", dict_row)
# The fleet gauges of /metrics: per node status, nodes, VRAM, and slots (free: claimable now).
FLEET_GAUGES = Query(
    "fleet_gauges",
    """
select status, count(*)::int8 as nodes, coalesce(sum(vram_gb), 0)::float8 as vram_gb,
  coalesce(sum(greatest(max_concurrency - inflight, 0)) filter (
    where status = 'online' and (cooldown_until is null or cooldown_until <= now())), 0)::int8 as free_slots,
  coalesce(sum(inflight) filter (where status in ('online', 'busy')), 0)::int8 as busy_slots
from public.nodes
group by status
""",
    dict_row,
)
# Read as the signed-in user: RLS and column grants leave their own nodes.
MY_NODES = Query(
    "my_nodes",
    """
select id, name, gpu_model, gpu_count, vram_gb, tflops, hourly_rate::float8 as hourly_rate, region, status,
  max_concurrency, inflight, queue_depth, gpu_utilization, last_heartbeat_at, successes, failures,
  agent_version, created_at
from public.nodes where owner_id = auth.uid()
order by name, id
""",
    dict_row,
)
# `on conflict do nothing` covers a concurrent first sign-in (auth.users.email is unique); the id is
# read by a second statement, which sees a row another sign-in committed meanwhile.
ADD_USER = Query(
    "add_user",
    "insert into auth.users (id, email) select gen_random_uuid(), %(email)s"
    " where not exists (select from auth.users where email = %(email)s) on conflict do nothing",
    scalar_row,
)
USER_ID = Query("user_id", "select id from auth.users where email = %s", scalar_row)

# --- An owner's earnings and nodes (issue 19), read as the owner: RLS keeps them to their own --------

# A period of `days` is whole UTC days: today and the days before it, as the page's chart draws them.
# Money as float8 for JSON: the ledger's exact numeric figures stay in SQL (docs/earnings.md).
MY_EARNINGS = Query(
    "my_earnings",
    """
select day, node_id, node_name, model_id, jobs, gross_usd::float8 as gross_usd, fee_usd::float8 as fee_usd,
  net_usd::float8 as net_usd
from public.my_earnings(
  (date_trunc('day', now(), 'UTC') at time zone 'UTC' - make_interval(days => %(days)s - 1))
    at time zone 'UTC')
""",
    dict_row,
)
MY_EARNINGS_TOTALS = Query(
    "my_earnings_totals",
    """
with period as (
  select date_trunc('day', now(), 'UTC') at time zone 'UTC' - make_interval(days => %(days)s - 1) as first_day
)
select p.first_day::date as first_day, t.jobs, t.gross_usd::float8 as gross_usd, t.fee_usd::float8 as fee_usd,
  t.net_usd::float8 as net_usd
from period p, public.my_earnings_totals(p.first_day at time zone 'UTC') t
""",
    dict_row,
)
MY_NODE_STATS = Query(
    "my_node_stats",
    """
select node_id, name, status, gpu_model, gpu_count, region, hourly_rate::float8 as hourly_rate, uptime,
  observed_s, jobs_served, failures, reputation, warm_models, last_heartbeat_at
from public.my_node_stats(make_interval(days => %(days)s))
""",
    dict_row,
)
PLATFORM_FEE_RATE = Query(
    "platform_fee_rate", "select platform_fee_rate::float8 from public.platform_settings", scalar_row
)

# Whether this database carries the embedded Realtime server's feed (db/sql/realtime_feed.sql). It is
# left out where Supabase's Realtime runs (it reads the WAL itself): then the gateway serves none.
REALTIME_FEED_INSTALLED = Query(
    "realtime_feed_installed",
    "select to_regprocedure('realtime.feed_notify(jsonb)') is not null",
    scalar_row,
)

# --- keys the CLI creates for a user (`neuralgrid keys create --owner`) ----------------------------

# For the rest of the transaction, act as this signed-in user, as the API does (db/roles.py): what
# create_api_key() then creates, auth.uid() makes theirs.
ACT_AS_USER = Query(
    "act_as_user",
    "select set_config('role', 'authenticated', true), set_config('request.jwt.claims',"
    " json_build_object('role', 'authenticated', 'sub', %s::uuid)::text, true)",
    scalar_row,
)
# Supabase Auth keeps emails lower-case; an id is matched as text so that any string is a fair question.
USER_BY_ID_OR_EMAIL = Query(
    "user_by_id_or_email",
    "select id from auth.users where id::text = %(who)s or email = lower(%(who)s)",
    scalar_row,
)
