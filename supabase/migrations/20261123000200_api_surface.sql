-- The API surface. `public` holds the API alone: what the gateway, the node agents, the web page and
-- the Edge Functions call. Internal helpers (scoring components, claims, releases, the moving
-- average, trigger functions) move to a `private` schema that no API role may use, so PostgREST no
-- longer offers them as RPCs. Moving a function keeps its triggers (bound by OID) and the views that
-- use it, but not the bodies that name it: every caller naming `public.<moved>` is redefined here,
-- same signature and same behaviour, to name `private.<moved>`.
--
-- With the move, each rule that was written twice is written once:
-- * the cooldown after a failure (release_node() and complete_jobs() both had it): private.cooldown_until();
-- * moving a job to its next node (failover_job(), and handoff_job() undoing it by raising and
--   catching a private SQLSTATE): private.move_job(), told whether to fail the job when no node is left;
-- * the budget hold, priced in Python while the charge was priced in SQL: private.budget_hold(), and a
--   match_job() overload that takes the request's size instead of a price;
-- * the sweeper: public.sweep() does what the service's sweeper does each tick, and pg_cron (where it
--   is installed) runs that one function instead of sweep_stale_nodes() alone.

create schema if not exists private;
comment on schema private is 'Internal helpers of the matcher, the ledger and the triggers: called by the public API functions, never by API clients (no usage for anon or authenticated; not exposed by PostgREST).';
revoke all on schema private from public, anon, authenticated;
grant usage on schema private to service_role;

-- Scoring helpers ---------------------------------------------------------------------------------
-- The single-SELECT SQL ones stay without a pinned search_path (the planner inlines only those);
-- their bodies name every object with its schema.

alter function public.great_circle_km(double precision, double precision, double precision, double precision) set schema private;
comment on function private.great_circle_km(double precision, double precision, double precision, double precision) is 'Haversine distance in km between two points on the mean-radius Earth.';
revoke execute on function private.great_circle_km(double precision, double precision, double precision, double precision) from public, anon, authenticated;
grant execute on function private.great_circle_km(double precision, double precision, double precision, double precision) to service_role;

alter function public.required_vram_gb(text, real) set schema private;
comment on function private.required_vram_gb(text, real) is 'VRAM (GB) a request for a model needs: the caller''s figure, else the catalog''s; raises no_data_found for a model nobody knows.';
revoke execute on function private.required_vram_gb(text, real) from public, anon, authenticated;
grant execute on function private.required_vram_gb(text, real) to service_role;

alter function public.balanced_components(public.matching_policies, double precision, double precision, double precision, text, integer, integer, bigint, bigint, real, double precision) set schema private;
comment on function private.balanced_components(public.matching_policies, double precision, double precision, double precision, text, integer, integer, bigint, bigint, real, double precision) is 'The request-independent score components of a node for a model under a weighted policy, each in [0,1], and their weighted share of the score (base).';
revoke execute on function private.balanced_components(public.matching_policies, double precision, double precision, double precision, text, integer, integer, bigint, bigint, real, double precision) from public, anon, authenticated;
grant execute on function private.balanced_components(public.matching_policies, double precision, double precision, double precision, text, integer, integer, bigint, bigint, real, double precision) to service_role;

alter function public.proximity_component(public.matching_policies, text, double precision, double precision, text, double precision, double precision) set schema private;
create or replace function private.proximity_component(
  w public.matching_policies, region text, latitude double precision, longitude double precision,
  p_region text, p_latitude double precision, p_longitude double precision
) returns double precision
language sql immutable parallel safe
as $$
  select case
    when p_latitude is not null and latitude is not null then
      w.distance_half_km / (w.distance_half_km + private.great_circle_km(p_latitude, p_longitude, latitude, longitude))
    when p_region is not null then (region = p_region)::integer::float8
    else 0.5::float8
  end
$$;
comment on function private.proximity_component(public.matching_policies, text, double precision, double precision, text, double precision, double precision) is 'How close a node is to the caller, in [0,1]: by great-circle distance, else by region, else 0.5 (unknown).';
revoke execute on function private.proximity_component(public.matching_policies, text, double precision, double precision, text, double precision, double precision) from public, anon, authenticated;
grant execute on function private.proximity_component(public.matching_policies, text, double precision, double precision, text, double precision, double precision) to service_role;

alter function public.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean) set schema private;
comment on function private.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean) is 'The first hard filter a node fails for a request, as a sentence; null when the node is eligible.';
revoke execute on function private.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean) from public, anon, authenticated;
grant execute on function private.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean) to service_role;

alter function public.node_is_eligible(public.nodes, double precision, timestamptz, numeric) set schema private;
comment on function private.node_is_eligible(public.nodes, double precision, timestamptz, numeric) is 'True when a node that holds the model passes every hard filter of a weighted policy.';
revoke execute on function private.node_is_eligible(public.nodes, double precision, timestamptz, numeric) from public, anon, authenticated;
grant execute on function private.node_is_eligible(public.nodes, double precision, timestamptz, numeric) to service_role;

-- The node_scores cache and the triggers that keep it -------------------------------------------

alter function public.refresh_node_scores(uuid[], text, text) set schema private;
comment on function private.refresh_node_scores(uuid[], text, text) is 'Recomputes node_scores for the given nodes, model and policy (null: all).';
revoke execute on function private.refresh_node_scores(uuid[], text, text) from public, anon, authenticated;
grant execute on function private.refresh_node_scores(uuid[], text, text) to service_role;

alter function public.node_scores_after_nodes_insert() set schema private;
create or replace function private.node_scores_after_nodes_insert() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  perform private.refresh_node_scores(array(select n.id from new_rows n));
  return null;
end;
$$;
comment on function private.node_scores_after_nodes_insert() is 'Trigger: scores newly inserted nodes (one statement for a bulk insert).';
revoke execute on function private.node_scores_after_nodes_insert() from public, anon, authenticated, service_role;

alter function public.node_scores_after_node_update() set schema private;
comment on function private.node_scores_after_node_update() is 'Trigger: rescores a node whose scored columns changed (a claim, a release, new specs).';
revoke execute on function private.node_scores_after_node_update() from public, anon, authenticated, service_role;

alter function public.node_scores_after_node_models_change() set schema private;
create or replace function private.node_scores_after_node_models_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  perform private.refresh_node_scores(array(select distinct node_id from new_rows));
  return null;
end;
$$;
comment on function private.node_scores_after_node_models_change() is 'Trigger: refreshes node_scores for nodes whose models were added or changed state.';
revoke execute on function private.node_scores_after_node_models_change() from public, anon, authenticated, service_role;

alter function public.node_scores_after_catalog_change() set schema private;
create or replace function private.node_scores_after_catalog_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  if tg_table_name = 'matching_policies' then
    perform private.refresh_node_scores(null, null, new.name);
  else
    perform private.refresh_node_scores(null, coalesce(new.id, old.id), null);
  end if;
  return null;
end;
$$;
comment on function private.node_scores_after_catalog_change() is 'Trigger: refreshes node_scores after a policy''s weights or a model''s VRAM need change.';
revoke execute on function private.node_scores_after_catalog_change() from public, anon, authenticated, service_role;

alter function public.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, boolean, double precision) set schema private;
create or replace function private.top_by_base(
  p_policy text, p_model text, p_k integer, p_min_vram_gb double precision,
  p_fresh_after timestamptz, p_max_hourly_rate numeric,
  p_region text default null, p_in_region boolean default null, p_floor double precision default null
) returns table (node_id uuid, base_score double precision)
language plpgsql stable
set search_path = ''
as $$
declare
  -- Cursors are planned for a fast start: the walk follows the index in order, whatever the planner
  -- guesses about how many nodes are eligible (a guess that flips plans otherwise).
  ranked refcursor;
  r record;
  found_count integer := 0;
begin
  if p_in_region then
    open ranked for
      select s.node_id, s.base_score, s.region, n as node from public.node_scores s
      join public.nodes n on n.id = s.node_id
      where s.policy = p_policy and s.model_id = p_model and s.region = p_region
      order by s.base_score desc, s.node_id;
  else
    open ranked for
      select s.node_id, s.base_score, s.region, n as node from public.node_scores s
      join public.nodes n on n.id = s.node_id
      where s.policy = p_policy and s.model_id = p_model
      order by s.base_score desc, s.node_id;
  end if;
  loop
    fetch ranked into r;
    exit when not found or r.base_score < p_floor;
    continue when p_in_region = false and r.region = p_region;
    continue when not private.node_is_eligible(r.node, p_min_vram_gb, p_fresh_after, p_max_hourly_rate);
    node_id := r.node_id;
    base_score := r.base_score;
    return next;
    found_count := found_count + 1;
    exit when found_count >= p_k;
  end loop;
  close ranked;
end;
$$;
comment on function private.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, boolean, double precision) is 'The first p_k eligible nodes for a model in base-score order (optionally only in, or only out of, a region; stopping below p_floor).';
revoke execute on function private.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, boolean, double precision) from public, anon, authenticated;
grant execute on function private.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, boolean, double precision) to service_role;

create or replace function public.score_nodes(
  p_model text,
  p_min_vram_gb real default null,
  p_policy text default 'balanced',
  p_region text default null,
  p_latitude double precision default null,
  p_longitude double precision default null,
  p_max_hourly_rate numeric default null,
  p_explain boolean default false,
  p_limit integer default null
) returns table (
  node_id uuid,
  name text,
  rank bigint,
  score double precision,
  fit double precision,
  compute double precision,
  price double precision,
  warm double precision,
  capacity double precision,
  reputation double precision,
  proximity double precision,
  reject_reason text
)
language plpgsql stable
-- Definer: it reads node_scores and whole node rows, and returns only what the map shows anyway.
security definer
set search_path = ''
as $$
declare
  v_min float8 := private.required_vram_gb(p_model, p_min_vram_gb);
  v_seed boolean := p_policy = 'seed';
  w public.matching_policies;
  v_weight float8;
  v_fresh_after timestamptz;
  v_kth float8;
  v_candidates uuid[];
begin
  if not v_seed then
    select * into w from public.matching_policies mp where mp.name = p_policy;
    if not found then
      raise exception 'unknown matching policy "%"', p_policy using errcode = 'invalid_parameter_value';
    end if;
    v_weight := w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity;
  end if;
  if (p_latitude is null) <> (p_longitude is null) then
    raise exception 'give both latitude and longitude, or neither' using errcode = 'invalid_parameter_value';
  end if;
  if p_limit is not null and p_limit < 1 then
    raise exception 'limit must be positive, got %', p_limit using errcode = 'invalid_parameter_value';
  end if;
  select now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
    into v_fresh_after from public.platform_settings s;

  -- Fast path: candidates from the node_scores index, then the exact top k among them (the base
  -- scores assume the catalog's VRAM need, so a custom need takes the full path).
  if not v_seed and not p_explain and p_limit is not null
     and v_min = private.required_vram_gb(p_model) then
    if p_latitude is null and p_region is null then
      -- Every node's proximity is the same 0.5: the top k by base are the top k.
      v_candidates := array(select t.node_id from private.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate) t);
    elsif p_latitude is null then
      -- Proximity is 1 in the caller's region and 0 elsewhere: the top k is within the top k of
      -- each side.
      v_candidates := array(
        select t.node_id from private.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_region, true) t
        union all
        select t.node_id from private.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_region, false) t);
    else
      -- Proximity varies continuously: every node whose base is within the proximity weight of
      -- the k-th best base may still rank.
      select min(t.base_score) into v_kth from private.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate) t;
      v_candidates := array(select t.node_id from private.top_by_base(
        p_policy, p_model, 2147483647, v_min, v_fresh_after, p_max_hourly_rate, null, null,
        v_kth - w.proximity / v_weight - 1e-12) t);
    end if;
    return query
    select r.id, r.name, row_number() over (order by r.total desc, r.id), r.total,
           r.fit, r.compute, r.price, r.warm, r.capacity, r.reputation, r.prox, null::text
    from (
      select n.id, n.name, c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, p.prox,
             c.base + w.proximity * p.prox / v_weight as total
      from unnest(v_candidates) as k (id)
      join public.nodes n on n.id = k.id
      join public.node_models nm on nm.node_id = n.id and nm.model_id = p_model
      cross join lateral private.balanced_components(
        w, n.vram_gb::float8, n.tflops::float8, n.hourly_rate::float8, nm.state, n.inflight,
        n.max_concurrency, n.successes, n.failures, n.speed_ratio, v_min) c
      cross join lateral (select private.proximity_component(
        w, n.region, n.latitude, n.longitude, p_region, p_latitude, p_longitude) as prox) p
      order by total desc, n.id
      limit p_limit
    ) r
    order by 3;
    return;
  end if;

  -- Full path: every node judged, for seed, explanations, a custom VRAM need or no limit.
  return query
  with judged as (
    select n.id, n.name, n.vram_gb::float8 as vram_gb, n.tflops::float8 as tflops,
           n.hourly_rate::float8 as hourly_rate, n.inflight, n.max_concurrency, n.successes,
           n.failures, n.speed_ratio, n.region, n.latitude, n.longitude, nm.state,
           private.reject_reason(n, nm.state, p_model, v_min, v_fresh_after, p_max_hourly_rate, v_seed) as reason
    from public.nodes n
    left join public.node_models nm on nm.node_id = n.id and nm.model_id = p_model
    where p_explain or n.status = 'online'
  ),
  ranked as (
    select j.id, j.name, c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, c.prox,
           c.total
    from judged j
    cross join lateral (
      select 0.3 * (j.vram_gb / v_min) + 0.5 * (j.tflops / 100.0) + 0.2 * (1.0 / (j.hourly_rate + 0.01)) as total,
             j.vram_gb / v_min as fit, j.tflops / 100.0 as compute, 1.0 / (j.hourly_rate + 0.01) as price,
             null::float8 as warm, null::float8 as capacity, null::float8 as reputation, null::float8 as prox
      where v_seed
      union all
      select b.base + w.proximity * p.prox / v_weight, b.fit, b.compute, b.price, b.warm, b.capacity,
             b.reputation, p.prox
      from private.balanced_components(w, j.vram_gb, j.tflops, j.hourly_rate, j.state, j.inflight,
                                       j.max_concurrency, j.successes, j.failures, j.speed_ratio, v_min) b
      cross join lateral (select private.proximity_component(
        w, j.region, j.latitude, j.longitude, p_region, p_latitude, p_longitude) as prox) p
      where not v_seed
    ) c
    where j.reason is null
    order by c.total desc, j.id
    limit p_limit
  )
  select r.id, r.name, row_number() over (order by r.total desc, r.id), r.total,
         r.fit, r.compute, r.price, r.warm, r.capacity, r.reputation, r.prox, null::text
  from ranked r
  union all
  select j.id, j.name, null, null, null, null, null, null, null, null, null, j.reason
  from judged j
  where p_explain and j.reason is not null
  order by 3 nulls last, 1;
end;
$$;
comment on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer) is 'Ranks the nodes that can serve p_model under a policy (seed or a row of matching_policies), best first, with each score component; with p_explain, also lists every rejected node and why.';

-- Claims, releases and the ledger ----------------------------------------------------------------

alter function public.claim_node(uuid[], uuid[], boolean) set schema private;
comment on function private.claim_node(uuid[], uuid[], boolean) is 'Claims one slot on the first available candidate node, in order; returns it, or nothing when none is free.';
revoke execute on function private.claim_node(uuid[], uuid[], boolean) from public, anon, authenticated;
grant execute on function private.claim_node(uuid[], uuid[], boolean) to service_role;

alter function public.release_reservation(uuid, numeric) set schema private;
comment on function private.release_reservation(uuid, numeric) is 'Releases the budget a job held and charges its key the job''s real cost.';
revoke execute on function private.release_reservation(uuid, numeric) from public, anon, authenticated;
grant execute on function private.release_reservation(uuid, numeric) to service_role;

-- Unpinned search_path (it names built-ins only), so the planner inlines it into the updates that use it.
create function private.cooldown_until(p_consecutive_failures bigint, p_base_s real, p_max_s real)
returns timestamptz
language sql stable
as $$
  -- Exponential: base * 2^(n-1) after the n-th failure in a row, capped at the maximum.
  select now() + make_interval(secs => least(p_max_s, p_base_s * power(2, least(p_consecutive_failures - 1, 30))))
$$;
comment on function private.cooldown_until(bigint, real, real) is 'When a node that has just failed p_consecutive_failures times in a row may be tried again: now plus base * 2^(n-1) seconds, capped at max (platform_settings.cooldown_base_s and cooldown_max_s). The one definition of the cooldown.';
revoke execute on function private.cooldown_until(bigint, real, real) from public, anon, authenticated;
grant execute on function private.cooldown_until(bigint, real, real) to service_role;

alter function public.release_node(uuid, text) set schema private;
create or replace function private.release_node(p_node_id uuid, p_outcome text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  if p_outcome not in ('succeeded', 'failed', 'cancelled') then
    raise exception 'unknown outcome "%"', p_outcome using errcode = 'invalid_parameter_value';
  end if;
  -- Failures cool a node down exponentially (cooldown_until()) so requests route around it.
  update public.nodes n
  set inflight = greatest(n.inflight - 1, 0),
      status = case when n.status = 'busy' then 'online' else n.status end,
      successes = n.successes + (p_outcome = 'succeeded')::integer,
      failures = n.failures + (p_outcome = 'failed')::integer,
      consecutive_failures = case p_outcome when 'succeeded' then 0
                                            when 'failed' then n.consecutive_failures + 1
                                            else n.consecutive_failures end,
      cooldown_until = case p_outcome
        when 'succeeded' then null
        when 'failed' then private.cooldown_until(n.consecutive_failures + 1, s.cooldown_base_s, s.cooldown_max_s)
        else n.cooldown_until end
  from public.platform_settings s
  where n.id = p_node_id;
end;
$$;
comment on function private.release_node(uuid, text) is 'Frees the slot a finished attempt held and records its outcome in the node''s reputation and cooldown.';
revoke execute on function private.release_node(uuid, text) from public, anon, authenticated;
grant execute on function private.release_node(uuid, text) to service_role;

alter function public.end_attempt(uuid, text, text, integer, real, real) set schema private;
create or replace function private.end_attempt(
  p_job_id uuid, p_outcome text, p_error text default null, p_http_status integer default null,
  p_ttft_ms real default null, p_latency_ms real default null
) returns public.job_attempts
language plpgsql
set search_path = ''
as $$
declare
  v_attempt public.job_attempts;
begin
  update public.job_attempts a
  set status = p_outcome, error = p_error, http_status = p_http_status, ttft_ms = p_ttft_ms,
      latency_ms = coalesce(p_latency_ms, 1000 * extract(epoch from clock_timestamp() - a.started_at)),
      ended_at = clock_timestamp()
  where a.job_id = p_job_id and a.status = 'running'
  returning a.* into v_attempt;
  if not found then
    raise exception 'job % has no running attempt', p_job_id using errcode = 'object_not_in_prerequisite_state';
  end if;
  perform private.release_node(v_attempt.node_id, p_outcome);
  return v_attempt;
end;
$$;
comment on function private.end_attempt(uuid, text, text, integer, real, real) is 'Ends a job''s running attempt with an outcome and releases its node.';
revoke execute on function private.end_attempt(uuid, text, text, integer, real, real) from public, anon, authenticated;
grant execute on function private.end_attempt(uuid, text, text, integer, real, real) to service_role;

alter function public.ewma_fold(double precision, double precision[]) set schema private;
comment on function private.ewma_fold(double precision, double precision[]) is 'The exponentially weighted average (weight 0.2) after folding samples, in order, into p_start; null samples are skipped. The one definition of the nodes'' moving averages.';
revoke execute on function private.ewma_fold(double precision, double precision[]) from public, anon, authenticated;
grant execute on function private.ewma_fold(double precision, double precision[]) to service_role;

-- Matching: the hold priced in SQL --------------------------------------------------------------

create or replace function public.match_job(
  p_model text,
  p_api_key_id uuid default null,
  p_policy text default 'balanced',
  p_min_vram_gb real default null,
  p_region text default null,
  p_latitude double precision default null,
  p_longitude double precision default null,
  p_max_hourly_rate numeric default null,
  p_stream boolean default false,
  p_fallbacks integer default 3,
  p_reserve_usd numeric default 0
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text
)
language plpgsql
set search_path = ''
as $$
declare
  v_min real := private.required_vram_gb(p_model, p_min_vram_gb);
  v_ranked uuid[];
  v_node public.nodes;
  v_job uuid;
  v_error text;
  v_held numeric := 0;
  v_budgeted boolean;
begin
  if p_fallbacks < 0 then
    raise exception 'fallbacks must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if p_reserve_usd < 0 then
    raise exception 'a reservation must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  -- The best few are enough: a claim skips only nodes filled or locked since scoring.
  select array_agg(s.node_id order by s.rank) into v_ranked
  from public.score_nodes(p_model, p_min_vram_gb, p_policy, p_region, p_latitude, p_longitude,
                          p_max_hourly_rate, false, greatest(32, 4 * (p_fallbacks + 1))) s;

  select * into v_node from private.claim_node(coalesce(v_ranked, '{}'));
  -- Hold the request's estimated cost against the key's budget, atomically, so that concurrent
  -- requests never overspend it by more than one request: a request is admitted while the
  -- budget covers what is spent and held, or when nothing is held and something is left.
  -- After the claim: nodes are always locked before keys (complete_job's order too); a refusal
  -- rolls the claim back. Keys without a budget hold nothing, so their requests never queue on
  -- the key's row.
  if p_api_key_id is not null and v_node.id is not null then
    update public.api_keys k set reserved_usd = k.reserved_usd + p_reserve_usd
    where k.id = p_api_key_id and k.budget_usd is not null
      and (k.spent_usd + k.reserved_usd + p_reserve_usd <= k.budget_usd
           or (k.reserved_usd = 0 and k.spent_usd < k.budget_usd));
    if found then
      v_held := p_reserve_usd;
    else
      select k.budget_usd is not null into v_budgeted from public.api_keys k where k.id = p_api_key_id;
      if not found then
        raise exception 'no api_key with id %', p_api_key_id using errcode = 'invalid_parameter_value';
      elsif v_budgeted then
        raise exception 'the budget of this API key is spent' using errcode = 'NG402';
      end if;
    end if;
  end if;

  if v_node.id is null then
    v_error := case when v_ranked is null then format('no capable node is online for %s', p_model)
                    else format('every capable node for %s is at capacity', p_model) end;
  end if;

  insert into public.jobs as j (api_key_id, owner_id, model_id, policy, status, node_id, attempts, stream,
                                region, min_vram_gb, reserved_usd, error, finished_at)
  values (p_api_key_id, (select k.owner_id from public.api_keys k where k.id = p_api_key_id), p_model,
          p_policy, case when v_node.id is null then 'failed' else 'running' end, v_node.id,
          case when v_node.id is null then 0 else 1 end, p_stream, p_region, v_min, v_held, v_error,
          case when v_node.id is null then now() end)
  returning j.id into v_job;

  if v_node.id is not null then
    insert into public.job_attempts (job_id, attempt, node_id) values (v_job, 1, v_node.id);
  end if;

  return query select v_job, v_node.id, v_node.endpoint_url, v_node.secret_hash,
    case when v_node.id is null then 0 else 1 end,
    array(select x from unnest(v_ranked) with ordinality as r (x, ord)
          where x is distinct from v_node.id order by ord limit p_fallbacks),
    v_error;
end;
$$;
comment on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric) is 'One atomic call per request: holds p_reserve_usd against the key''s budget (NG402 when spent), scores nodes, claims a slot on the best one, records the job and its first attempt, and returns the node (with the key the gateway signs requests to it with) and an ordered fallback list (node null and error set when none can take it). The overload taking the request''s size prices the hold itself.';

create function private.budget_hold(p_model text, p_prompt_bytes integer, p_max_output_tokens integer)
returns numeric
language sql stable
set search_path = ''
as $$
  -- About four bytes a token, and the answer at its full max_tokens: an upper bound, as a hold
  -- should be. A model the catalog does not price (or know) holds nothing.
  select coalesce((
    select ((p_prompt_bytes / 4.0) * coalesce(m.input_usd_per_mtok, 0)
            + p_max_output_tokens * coalesce(m.output_usd_per_mtok, 0)) / 1e6
    from public.models m where m.id = p_model), 0)
$$;
comment on function private.budget_hold(text, integer, integer) is 'The USD a request holds against its key''s budget until it ends: its prompt (bytes / 4 tokens) and max_output_tokens at the catalog''s per-token prices; 0 for a model without a price.';
revoke execute on function private.budget_hold(text, integer, integer) from public, anon, authenticated;
grant execute on function private.budget_hold(text, integer, integer) to service_role;

-- No defaults: a call with fewer than twelve arguments can only mean the overload above.
create function public.match_job(
  p_model text,
  p_api_key_id uuid,
  p_policy text,
  p_min_vram_gb real,
  p_region text,
  p_latitude double precision,
  p_longitude double precision,
  p_max_hourly_rate numeric,
  p_stream boolean,
  p_fallbacks integer,
  p_prompt_bytes integer,
  p_max_output_tokens integer
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text
)
language plpgsql
set search_path = ''
as $$
begin
  if p_prompt_bytes is null or p_max_output_tokens is null or p_prompt_bytes < 0 or p_max_output_tokens < 0 then
    raise exception 'prompt_bytes and max_output_tokens must be given and must not be negative'
      using errcode = 'invalid_parameter_value';
  end if;
  return query
  select * from public.match_job(p_model, p_api_key_id, p_policy, p_min_vram_gb, p_region, p_latitude, p_longitude,
                                 p_max_hourly_rate, p_stream, p_fallbacks,
                                 private.budget_hold(p_model, p_prompt_bytes, p_max_output_tokens));
end;
$$;
comment on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer) is 'match_job() with the budget hold priced in SQL: p_prompt_bytes (about four bytes a token) and p_max_output_tokens (0 for an embedding) at the catalog''s per-token prices, the way complete_jobs() prices the charge; 0 for a model the catalog does not price. Every argument is required.';
revoke execute on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer) from public, anon, authenticated;
grant execute on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer) to service_role;

-- Moving a job to its next node: one body for failover and handoff --------------------------------

create function private.move_job(
  p_job_id uuid, p_error text, p_http_status integer, p_candidates uuid[], p_fail_if_none boolean
) returns table (node_id uuid, endpoint_url text, node_key bytea, attempt integer)
language plpgsql
set search_path = ''
as $$
declare
  v_running public.job_attempts;
  v_tried uuid[];
  v_next integer;
  v_node public.nodes;
begin
  -- The running attempt, then its node, then (skipping locked rows) the next node: the order
  -- failover_job() has always taken these locks in.
  select * into v_running from public.job_attempts a
  where a.job_id = p_job_id and a.status = 'running'
  for no key update;
  if not found then
    raise exception 'job % has no running attempt', p_job_id using errcode = 'object_not_in_prerequisite_state';
  end if;
  perform from public.nodes n where n.id = v_running.node_id for no key update;
  select array_agg(a.node_id), max(a.attempt) + 1 into v_tried, v_next
  from public.job_attempts a where a.job_id = p_job_id;

  -- No waiting here: this transaction already holds the running node's row, and waiting on another
  -- move's node could deadlock with it.
  select * into v_node from private.claim_node(p_candidates, v_tried, false);
  if v_node.id is null and not p_fail_if_none then
    return;  -- nowhere to go, and told to change nothing
  end if;
  perform private.end_attempt(p_job_id, 'failed', p_error, p_http_status);
  if v_node.id is null then
    update public.jobs j set status = 'failed', error = p_error, finished_at = now() where j.id = p_job_id;
    perform private.release_reservation(p_job_id, 0);
    return;
  end if;
  insert into public.job_attempts (job_id, attempt, node_id) values (p_job_id, v_next, v_node.id);
  update public.jobs j set node_id = v_node.id, attempts = v_next where j.id = p_job_id;
  return query select v_node.id, v_node.endpoint_url, v_node.secret_hash, v_next;
end;
$$;
comment on function private.move_job(uuid, text, integer, uuid[], boolean) is 'Moves a running job to the first free candidate not yet tried: its running attempt fails (its node cools down) and a new attempt starts there. When no candidate is free: with p_fail_if_none, the attempt and the job fail and the hold is released; without, nothing changes. No row means the job did not move.';
revoke execute on function private.move_job(uuid, text, integer, uuid[], boolean) from public, anon, authenticated;
grant execute on function private.move_job(uuid, text, integer, uuid[], boolean) to service_role;

create or replace function public.failover_job(
  p_job_id uuid, p_error text, p_http_status integer default null, p_candidates uuid[] default '{}'
) returns table (node_id uuid, endpoint_url text, node_key bytea, attempt integer)
language plpgsql
set search_path = ''
as $$
begin
  return query select * from private.move_job(p_job_id, p_error, p_http_status, p_candidates, true);
end;
$$;
comment on function public.failover_job(uuid, text, integer, uuid[]) is 'Before the first byte: records the running attempt''s failure (cooling its node down) and claims the next free candidate not yet tried; no row means the job failed.';

create or replace function public.handoff_job(p_job_id uuid, p_error text, p_candidates uuid[] default '{}')
returns table (node_id uuid, endpoint_url text, node_key bytea, attempt integer)
language plpgsql
set search_path = ''
as $$
begin
  return query select * from private.move_job(p_job_id, p_error, null, p_candidates, false);
end;
$$;
comment on function public.handoff_job(uuid, text, uuid[]) is 'After the first byte: moves a running job to the next free candidate not yet tried, as failover_job() does (the running attempt fails and its node cools down); when there is none, changes nothing and returns no row, so the job ends later with the tokens its client already received.';

create or replace function public.reject_job(p_job_id uuid, p_error text, p_http_status integer default null)
returns void
language plpgsql
set search_path = ''
as $$
begin
  -- Two nodes failed this request the same way: the request is at fault. The running attempt ends
  -- neutral, the earlier attempts that failed the same way are forgiven (their failure and the
  -- cooldown it started undone), and the job ends cancelled, charging nothing.
  perform private.end_attempt(p_job_id, 'cancelled', p_error, p_http_status);
  with forgiven as (
    update public.job_attempts a set status = 'cancelled'
    where a.job_id = p_job_id and a.status = 'failed' and a.error = p_error
    returning a.node_id
  )
  update public.nodes n
  set failures = greatest(n.failures - 1, 0),
      consecutive_failures = greatest(n.consecutive_failures - 1, 0),
      cooldown_until = case when n.consecutive_failures <= 1 then null else n.cooldown_until end
  from forgiven f
  where n.id = f.node_id;
  update public.jobs j set status = 'cancelled', error = p_error, finished_at = now() where j.id = p_job_id;
  perform private.release_reservation(p_job_id, 0);
end;
$$;
comment on function public.reject_job(uuid, text, integer) is 'Ends a job whose request two nodes failed the same way: the request''s fault, so its attempts are neutral for the nodes (earlier failures with the same error forgiven) and nothing is charged.';

-- Ending jobs: one definition of the price, the moving averages and the cooldown ----------------

create or replace function public.complete_jobs(
  p_job_ids uuid[],
  p_statuses text[],
  p_prompt_tokens integer[],
  p_completion_tokens integer[],
  p_ttft_ms real[],
  p_latency_ms real[],
  p_errors text[]
) returns table (job_id uuid, cost_usd numeric, latency_ms real)
language plpgsql
set search_path = ''
as $$
declare
  v_count integer := coalesce(cardinality(p_job_ids), 0);
  v_running uuid[];
begin
  if v_count <> any (array[coalesce(cardinality(p_statuses), 0), coalesce(cardinality(p_prompt_tokens), 0),
                           coalesce(cardinality(p_completion_tokens), 0), coalesce(cardinality(p_ttft_ms), 0),
                           coalesce(cardinality(p_latency_ms), 0), coalesce(cardinality(p_errors), 0)]) then
    raise exception 'complete_jobs takes arrays of one length' using errcode = 'invalid_parameter_value';
  end if;
  if exists (select from unnest(p_statuses) s where s is null or s not in ('succeeded', 'failed', 'cancelled')) then
    raise exception 'a job ends succeeded, failed or cancelled' using errcode = 'invalid_parameter_value';
  end if;
  if exists (select from unnest(p_prompt_tokens, p_completion_tokens) t (p, c)
             where p is null or c is null or p < 0 or c < 0) then
    raise exception 'token counts must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if (select count(distinct j) from unnest(p_job_ids) j) <> v_count or array_position(p_job_ids, null) is not null then
    raise exception 'each job appears once in a batch' using errcode = 'invalid_parameter_value';
  end if;

  -- Locks in the order claims and completions take them (jobs, then nodes, then keys; each by id)
  -- so that batches and claims cannot deadlock one another. The sweepers lock in another order; a
  -- deadlock with one is detected by Postgres, and the gateway then writes the batch job by job.
  -- A job already ended (by the sweeper) is left out.
  -- "No key update", the lock an UPDATE takes: new jobs may still reference these nodes and keys.
  select array_agg(r.id) into v_running from (
    select j.id from public.jobs j where j.id = any (p_job_ids) and j.status = 'running'
    order by j.id for no key update
  ) r;
  if v_running is null then
    return;
  end if;
  perform from public.nodes n
  where n.id in (select a.node_id from public.job_attempts a where a.job_id = any (v_running) and a.status = 'running')
  order by n.id for no key update;
  perform from public.api_keys k
  where k.id in (select j.api_key_id from public.jobs j where j.id = any (v_running))
  order by k.id for no key update;

  return query
  with input as (
    select * from unnest(p_job_ids, p_statuses, p_prompt_tokens, p_completion_tokens, p_ttft_ms,
                         p_latency_ms, p_errors)
      with ordinality as i (job_id, status, prompt_tokens, completion_tokens, ttft_ms, latency_ms, error, ord)
    where i.job_id = any (v_running)
  ),
  ended as (
    update public.job_attempts a
    set status = i.status, error = i.error, ttft_ms = i.ttft_ms,
        latency_ms = coalesce(i.latency_ms, 1000 * extract(epoch from clock_timestamp() - a.started_at)),
        ended_at = clock_timestamp()
    from input i
    where a.job_id = i.job_id and a.status = 'running'
    returning a.job_id, a.node_id, a.latency_ms, i.status, i.prompt_tokens, i.completion_tokens,
              i.ttft_ms, i.error, i.ord
  ),
  priced as (
    select e.*, j.api_key_id, j.reserved_usd,
           -- The catalog's per-token price, else a slot of the node's time.
           coalesce(case
             when m.input_usd_per_mtok is not null then
               (e.prompt_tokens * m.input_usd_per_mtok + e.completion_tokens * coalesce(m.output_usd_per_mtok, 0)) / 1e6
             else (n.hourly_rate * (e.latency_ms / 3.6e6) / n.max_concurrency)::numeric
           end, 0) as cost,
           t.tps,
           t.tps / (n.tflops * m.tokens_per_s_per_tflop) as ratio,
           max(e.ord) filter (where e.status = 'succeeded') over (partition by e.node_id) as last_success
    from ended e
    join public.jobs j on j.id = e.job_id
    left join public.models m on m.id = j.model_id
    left join public.nodes n on n.id = e.node_id
    cross join lateral (
      select case when e.completion_tokens > 0 and e.latency_ms > coalesce(e.ttft_ms, 0)
                  then e.completion_tokens / ((e.latency_ms - coalesce(e.ttft_ms, 0)) / 1000.0) end as tps
    ) t
  ),
  jobs_done as (
    update public.jobs j
    set status = p.status, prompt_tokens = p.prompt_tokens, completion_tokens = p.completion_tokens,
        cost_usd = p.cost, ttft_ms = p.ttft_ms, latency_ms = p.latency_ms, error = p.error, finished_at = now()
    from priced p
    where j.id = p.job_id
  ),
  per_node as (
    select p.node_id,
           count(*) as ended,
           count(*) filter (where p.status = 'succeeded') as succeeded,
           count(*) filter (where p.status = 'failed') as failed,
           count(*) filter (where p.status = 'failed' and p.ord > coalesce(p.last_success, 0)) as failed_since_success,
           bool_or(p.last_success is not null) as any_success,
           (array_agg(p.status order by p.ord desc) filter (where p.status <> 'cancelled'))[1] as last_outcome,
           array_agg(p.latency_ms::float8 order by p.ord) filter (where p.status = 'succeeded') as latencies,
           array_agg(p.tps order by p.ord) filter (where p.status = 'succeeded') as speeds,
           array_agg(p.ratio order by p.ord) filter (where p.status = 'succeeded') as ratios
    from priced p
    where p.node_id is not null
    group by p.node_id
  ),
  nodes_done as (
    -- release_node() and the EWMA updates (latency, speed, speed ratio), once per node per batch.
    update public.nodes n
    set inflight = greatest(n.inflight - c.ended, 0),
        status = case when n.status = 'busy' then 'online' else n.status end,
        successes = n.successes + c.succeeded,
        failures = n.failures + c.failed,
        consecutive_failures = case when c.any_success then c.failed_since_success
                                    else n.consecutive_failures + c.failed end,
        cooldown_until = case c.last_outcome
          when 'succeeded' then null
          when 'failed' then private.cooldown_until(
            case when c.any_success then c.failed_since_success else n.consecutive_failures + c.failed end,
            s.cooldown_base_s, s.cooldown_max_s)
          else n.cooldown_until end,
        ewma_latency_ms = private.ewma_fold(n.ewma_latency_ms, c.latencies),
        ewma_tokens_per_s = private.ewma_fold(n.ewma_tokens_per_s, c.speeds),
        speed_ratio = private.ewma_fold(n.speed_ratio, c.ratios)
    from per_node c, public.platform_settings s
    where n.id = c.node_id
  ),
  keys_done as (
    -- release_reservation(), once per key.
    update public.api_keys k
    set reserved_usd = greatest(k.reserved_usd - t.held, 0), spent_usd = k.spent_usd + t.cost, last_used_at = now()
    -- Each charge rounded to the column's 8 decimals, as one ending after another leaves it.
    from (select p.api_key_id, sum(p.reserved_usd) as held, sum(round(p.cost, 8)) as cost
          from priced p where p.api_key_id is not null group by p.api_key_id) t
    where k.id = t.api_key_id
  )
  select p.job_id, p.cost, p.latency_ms from priced p order by p.ord;
end;
$$;
comment on function public.complete_jobs(uuid[], text[], integer[], integer[], real[], real[], text[]) is 'Ends a batch of running jobs (parallel arrays, one entry per job) as ending them one by one, in order, would: usage, cost charged to keys, node reputation and EWMA speed, slots released. Returns the jobs it ended; jobs no longer running are left out. The one place a job''s price and its node''s moving averages are computed.';

create or replace function public.complete_job(
  p_job_id uuid,
  p_status text default 'succeeded',
  p_prompt_tokens integer default 0,
  p_completion_tokens integer default 0,
  p_ttft_ms real default null,
  p_latency_ms real default null,
  p_error text default null
) returns table (cost_usd numeric, latency_ms real)
language plpgsql
set search_path = ''
as $$
begin
  return query
  select c.cost_usd, c.latency_ms
  from public.complete_jobs(array[p_job_id], array[p_status], array[p_prompt_tokens], array[p_completion_tokens],
                            array[p_ttft_ms], array[p_latency_ms], array[p_error]) c;
  if not found then
    raise exception 'job % is not running', p_job_id using errcode = 'object_not_in_prerequisite_state';
  end if;
end;
$$;
comment on function public.complete_job(uuid, text, integer, integer, real, real, text) is 'Ends one running job: complete_jobs() with a batch of one (usage, cost charged to its key, latency, the node''s reputation and EWMA speed, its slot released); raises when the job is not running.';

-- Sweeping: one function, run by the service's sweeper or by pg_cron ----------------------------

create or replace function public.sweep_stale_jobs(p_max_age interval default interval '1 hour')
returns table (job_id uuid)
language plpgsql
set search_path = ''
as $$
declare
  v_job uuid;
begin
  -- A job whose completion never came (a gateway crashed, a write was lost) would hold its node's
  -- slot and its key's budget forever: end it as failed, which gives both back.
  for v_job in
    select j.id from public.jobs j
    where j.status = 'running' and j.created_at < now() - p_max_age
    for update skip locked
  loop
    perform private.end_attempt(v_job, 'cancelled', 'abandoned: no completion within ' || p_max_age::text);
    update public.jobs j set status = 'failed', error = 'abandoned: no completion within ' || p_max_age::text,
      finished_at = now() where j.id = v_job;
    perform private.release_reservation(v_job, 0);
    job_id := v_job;
    return next;
  end loop;
end;
$$;
comment on function public.sweep_stale_jobs(interval) is 'Ends jobs still running after p_max_age (their completion was lost), giving back node slots and budget holds.';

create function public.sweep(p_max_job_age interval default interval '1 hour')
returns table (kind text, id uuid, name text)
language plpgsql
set search_path = ''
as $$
begin
  return query select 'node_offline'::text, s.node_id, s.name from public.sweep_stale_nodes() s;
  return query select 'job_abandoned'::text, s.job_id, null::text from public.sweep_stale_jobs(p_max_job_age) s;
end;
$$;
comment on function public.sweep(interval) is 'One sweep: silent nodes offline (sweep_stale_nodes()) and jobs running longer than p_max_job_age ended (sweep_stale_jobs()). Returns a row per node set offline (kind node_offline, with its name) and per job ended (kind job_abandoned). Run every second by pg_cron where it is installed, else by the service''s sweeper.';
revoke execute on function public.sweep(interval) from public, anon, authenticated;
grant execute on function public.sweep(interval) to service_role;

-- pg_cron's schedule of sweep() is made by public.schedule_sweep() (20261129000300_sweep_schedule.sql),
-- which also removes the job that ran sweep_stale_nodes() alone.

-- Triggers: the functions move, the triggers (bound by OID) keep firing them ---------------------

alter function public.set_updated_at() set schema private;
comment on function private.set_updated_at() is 'Trigger function: stamps updated_at on every update.';
revoke execute on function private.set_updated_at() from public, anon, authenticated, service_role;

alter function public.notify_api_key_change() set schema private;
comment on function private.notify_api_key_change() is 'Trigger: announces a revoked or re-limited key on channel neuralgrid_api_keys.';
revoke execute on function private.notify_api_key_change() from public, anon, authenticated, service_role;

alter function public.node_map_payload(public.nodes) set schema private;
comment on function private.node_map_payload(public.nodes) is 'A node as the public map may show it (the columns granted to anon).';
revoke execute on function private.node_map_payload(public.nodes) from public, anon, authenticated;
grant execute on function private.node_map_payload(public.nodes) to service_role;

alter function public.broadcast_node_change() set schema private;
create or replace function private.broadcast_node_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_node public.nodes := case when tg_op = 'DELETE' then old else new end;
  v_payload jsonb := jsonb_build_object('operation', tg_op, 'node', private.node_map_payload(v_node),
                                        'old_status', case when tg_op = 'UPDATE' then old.status end);
begin
  perform realtime.send(v_payload, 'node_' || lower(tg_op), 'node-map', false);
  if v_node.owner_id is not null then
    perform realtime.send(
      v_payload || jsonb_build_object('node', to_jsonb(v_node) - 'secret_hash'),
      'node_' || lower(tg_op), 'owner:' || v_node.owner_id, true);
  end if;
  return null;
end;
$$;
comment on function private.broadcast_node_change() is 'Trigger: broadcasts a node''s status or health change on node-map (public columns) and on its owner''s private topic (the whole row but the secret).';
revoke execute on function private.broadcast_node_change() from public, anon, authenticated, service_role;

alter function public.broadcast_job_change() set schema private;
comment on function private.broadcast_job_change() is 'Trigger: a developer''s job that finishes is broadcast on their private jobs topic.';
revoke execute on function private.broadcast_job_change() from public, anon, authenticated, service_role;
