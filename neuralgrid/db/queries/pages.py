"""What the web pages and /metrics read: the public map, the fleet's gauges, a signed-in owner's
nodes and earnings (read as the owner: RLS keeps them to their own), and sign-in's users."""

from __future__ import annotations

from psycopg.rows import dict_row, scalar_row

from neuralgrid.db.queries.query import Query

__all__ = [
    "ADD_USER",
    "FLEET_GAUGES",
    "FLEET_STATS",
    "MAP_NODES_BY_ID",
    "MAP_SUMMARY",
    "MAP_VIEW",
    "MY_EARNINGS",
    "MY_EARNINGS_TOTALS",
    "MY_NODES",
    "MY_NODE_STATS",
    "NODE_LIST",
    "PLATFORM_FEE_RATE",
    "SEND_MAP_SUMMARY",
    "USERS",
    "USER_ID",
]


# The map at any size (issue 41), each read as anon, as a hosted project's page reads the same through
# the Data API (numbers as numbers, times in ISO 8601): the summary of the fleet (the one last broadcast
# on map:summary while the feed runs), a viewer's box (its nodes, or their clusters), the table's page.
MAP_SUMMARY = Query("map_summary", "select public.map_summary()", scalar_row)
# Nodes by id as they are now (the rows a page shows, read again): `= any` of the ids, a condition
# Postgres applies to node_map's nodes before grouping their models.
MAP_NODES_BY_ID = Query(
    "map_nodes_by_id",
    "select coalesce(jsonb_agg(to_jsonb(m) order by m.name, m.id), '[]') from public.node_map m"
    " where m.id = any(%s::uuid[])",
    scalar_row,
)
MAP_VIEW = Query(
    "map_view",
    "select public.map_view(%(west)s, %(south)s, %(east)s, %(north)s, %(cell_deg)s, %(max_nodes)s)",
    scalar_row,
)
NODE_LIST = Query(
    "node_list",
    "select public.node_list(%(search)s, %(sort)s, %(descending)s, %(offset)s, %(limit)s)",
    scalar_row,
)
# Each gateway, every second while it has a map viewer: whether it sent a summary (one in 950 ms at
# most between them all, and only a changed one).
SEND_MAP_SUMMARY = Query("send_map_summary", "select private.send_map_summary()", scalar_row)
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
select n.id, n.name, n.gpu_model, n.gpu_count, n.vram_gb, n.tflops, n.hourly_rate::float8 as hourly_rate,
  n.region, n.status, n.max_concurrency, n.inflight, n.queue_depth,
  case when l.last_heartbeat_at >= coalesce(n.last_heartbeat_at, '-infinity') then l.gpu_utilization
       else n.gpu_utilization end as gpu_utilization,
  case when l.last_heartbeat_at >= coalesce(n.last_heartbeat_at, '-infinity') then l.free_vram_gb
       else n.free_vram_gb end as free_vram_gb,
  greatest(n.last_heartbeat_at, l.last_heartbeat_at) as last_heartbeat_at, n.successes, n.failures,
  n.agent_version, n.created_at, n.verification
from public.nodes n
-- Its last beat, and the load it said: the later of the two rows (issue 41).
left join public.node_liveness l on l.node_id = n.id
where n.owner_id = auth.uid()
order by n.name, n.id
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
# `neuralgrid users ls`, as the service: each user with their active keys and their nodes.
USERS = Query(
    "users",
    """
select u.id, u.email, u.created_at,
  (select count(*) from public.api_keys k where k.owner_id = u.id and k.revoked_at is null) as keys,
  (select count(*) from public.nodes n where n.owner_id = u.id) as nodes
from auth.users u
order by u.created_at, u.email
""",
    dict_row,
)


# --- An owner's earnings and nodes (issue 19) ------------------------------------------------------

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
  t.net_usd::float8 as net_usd, t.held_usd::float8 as held_usd, t.forfeited_usd::float8 as forfeited_usd
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
