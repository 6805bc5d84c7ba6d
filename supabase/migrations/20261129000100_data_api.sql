-- The Data API (PostgREST) as a first-class path: what a front-end, a script or the `neuralgrid` CLI
-- reads with `select *` and calls as RPCs, as anon or as a signed-in user (issue 18).
--
-- The tables keep their column grants (endpoint_url and key_hash are nobody's to read through the
-- API), which makes `select *` on them fail with 42501. These views and functions are the shapes to
-- read instead; docs/data-api.md lists them with examples.
--
-- * anon: public.node_map (the map, from the nodes migration) and public.fleet_stats() (its totals).
-- * authenticated, each user to their own rows: public.my_api_keys, public.my_usage,
--   public.my_nodes(), and the RPCs create_api_key() (earlier) and revoke_api_key(). The owner's
--   earnings RPCs (my_earnings(), my_earnings_totals(), my_node_stats()) come from the earnings
--   migration.
-- * Views are security_invoker, so the caller's grants and row-level security apply as if they read
--   the tables; each also names its owner filter, so service_role (which bypasses RLS and has no
--   auth.uid()) reads nothing through a "my_" view rather than everyone's rows.
-- * Two functions are security definer, each because a grant cannot say what it must:
--   fleet_stats() counts every user's jobs, which no API role may read, and returns aggregates only;
--   my_nodes() returns the caller's own nodes with their endpoint_url, a column granted to no API
--   role because a column grant cannot tell an owner's rows from the others'.

-- The signed-in user's API keys ---------------------------------------------------------------------

create view public.my_api_keys with (security_invoker = true) as
select
  k.id, k.name, k.prefix, k.rpm_limit, k.tpm_limit, k.budget_usd, k.spent_usd, k.reserved_usd, k.created_at,
  k.last_used_at, k.revoked_at, k.revoked_at is null as active
from public.api_keys k
where k.owner_id = (select auth.uid());
comment on view public.my_api_keys is 'The signed-in user''s API keys without their secrets (never key_hash): limits, budget, spend, last use, revocation. active is false once revoked. `select *` works for authenticated; anon is refused.';

revoke all on table public.my_api_keys from public, anon, authenticated;
grant select on table public.my_api_keys to authenticated, service_role;

create function public.revoke_api_key(p_key_id uuid)
returns timestamptz
language plpgsql
set search_path = ''
as $$
declare
  v_revoked_at timestamptz;
begin
  -- Security invoker: row-level security lets a user update their own keys only, so another
  -- user's key is "not found" exactly like a key that does not exist.
  update public.api_keys k set revoked_at = now()
  where k.id = p_key_id and k.revoked_at is null
  returning k.revoked_at into v_revoked_at;
  if v_revoked_at is null then
    -- Revoking twice is not an error: the key stays revoked since the first time.
    select k.revoked_at into v_revoked_at from public.api_keys k where k.id = p_key_id;
  end if;
  if v_revoked_at is null then
    -- PT404: PostgREST answers HTTP 404 for this SQLSTATE.
    raise exception 'no API key % among yours', p_key_id using errcode = 'PT404';
  end if;
  return v_revoked_at;
end;
$$;
comment on function public.revoke_api_key(uuid) is 'Revokes one of the caller''s API keys (every gateway refuses it within a second) and returns when it was revoked; revoking a revoked key returns its first revocation time. Another user''s key, or none, raises PT404 (HTTP 404 through PostgREST).';
revoke execute on function public.revoke_api_key(uuid) from public, anon, authenticated;
grant execute on function public.revoke_api_key(uuid) to authenticated, service_role;

-- The signed-in user's usage --------------------------------------------------------------------------

create view public.my_usage with (security_invoker = true) as
select
  (j.created_at at time zone 'UTC')::date as day,
  j.api_key_id,
  k.name as key_name,
  k.prefix as key_prefix,
  j.model_id,
  count(*) as requests,
  count(*) filter (where j.status = 'succeeded') as succeeded,
  count(*) filter (where j.status = 'failed') as failed,
  sum(j.prompt_tokens)::bigint as prompt_tokens,
  sum(j.completion_tokens)::bigint as completion_tokens,
  sum(j.cost_usd) as cost_usd
from public.jobs j
left join public.api_keys k on k.id = j.api_key_id
where j.owner_id = (select auth.uid())
group by 1, 2, 3, 4, 5;
comment on view public.my_usage is 'The signed-in user''s requests per UTC day, API key and model: requests (running ones included), succeeded, failed, tokens and cost in USD. Filter by day (`?day=gte.2026-11-01`); key_name is null for a key since deleted.';

revoke all on table public.my_usage from public, anon, authenticated;
grant select on table public.my_usage to authenticated, service_role;

-- The signed-in owner's nodes -------------------------------------------------------------------------

create function public.my_nodes()
returns table (
  id uuid, name text, status text, endpoint_url text, tunnel_connected boolean, backend_up boolean,
  backend jsonb, routes text[], gpu_model text, gpu_count integer, vram_gb real, tflops real,
  hourly_rate numeric, region text, latitude double precision, longitude double precision,
  max_concurrency integer, inflight integer, queue_depth integer, last_heartbeat_at timestamptz,
  successes bigint, failures bigint, ewma_latency_ms real, ewma_tokens_per_s real,
  cooldown_until timestamptz, warm_models text[], available_models text[], agent_version text,
  created_at timestamptz
)
language sql stable
security definer
set search_path = ''
as $$
  -- Definer, to read endpoint_url and tunnel_connected; the owner filter is what keeps it to the
  -- caller's rows, and anon (no auth.uid()) gets none.
  select n.id, n.name, n.status, n.endpoint_url, n.tunnel_connected, n.backend_up, n.backend, n.routes,
         n.gpu_model, n.gpu_count, n.vram_gb, n.tflops, n.hourly_rate, n.region, n.latitude, n.longitude,
         n.max_concurrency, n.inflight, n.queue_depth, n.last_heartbeat_at, n.successes, n.failures,
         n.ewma_latency_ms, n.ewma_tokens_per_s, n.cooldown_until,
         coalesce((select array_agg(m.model_id order by m.model_id) from public.node_models m
                   where m.node_id = n.id and m.state = 'loaded'), '{}'),
         coalesce((select array_agg(m.model_id order by m.model_id) from public.node_models m
                   where m.node_id = n.id and m.state = 'available'), '{}'),
         n.agent_version, n.created_at
  from public.nodes n
  where n.owner_id = (select auth.uid())
  order by n.name, n.id
$$;
comment on function public.my_nodes() is 'The signed-in owner''s nodes, each with what the map shows and what only its owner may see: endpoint_url (how the platform reaches it), whether its tunnel is connected and its server answers, the server found behind it (backend) and its routes. Uptime, earnings and reputation: my_node_stats().';
revoke execute on function public.my_nodes() from public, anon, authenticated;
grant execute on function public.my_nodes() to authenticated, service_role;

-- The fleet's totals, beside the map --------------------------------------------------------------------

create function public.fleet_stats()
returns table (
  online_nodes bigint, online_vram_gb double precision, online_tflops double precision,
  jobs_last_minute bigint, p50_latency_ms double precision, cheapest jsonb
)
language sql stable
security definer
set search_path = ''
as $$
  -- Definer, to count every user's jobs (no API role may read jobs not their own); only totals
  -- leave. The indexes of the fleet_stats migration keep the two job counts to the newest rows.
  with live as (
    select n.gpu_model, n.vram_gb, n.tflops, n.hourly_rate from public.nodes n
    where n.status in ('online', 'busy')
  )
  select
    (select count(*) from live),
    (select coalesce(sum(l.vram_gb), 0)::float8 from live l),
    (select coalesce(sum(l.tflops), 0)::float8 from live l),
    (select count(*) from public.jobs j where j.created_at > now() - interval '1 minute'),
    (select percentile_cont(0.5) within group (order by j.latency_ms) from public.jobs j
      where j.finished_at > now() - interval '5 minutes' and j.latency_ms is not null),
    (select coalesce(jsonb_agg(jsonb_build_object('gpu_model', c.gpu_model, 'hourly_rate', c.rate)
                               order by c.rate, c.gpu_model), '[]')
       from (select l.gpu_model, min(l.hourly_rate)::float8 as rate from live l group by l.gpu_model) c)
$$;
comment on function public.fleet_stats() is 'The totals the map shows beside it (one row): nodes online or busy with their VRAM and TFLOPS, jobs started in the last minute, the median latency of jobs finished in the last five minutes (null when none), and the cheapest hourly rate per GPU model online. Anyone may call it; it returns totals only.';
revoke execute on function public.fleet_stats() from public, anon, authenticated;
grant execute on function public.fleet_stats() to anon, authenticated, service_role;
