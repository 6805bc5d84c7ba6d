-- The matcher: score nodes for a request, claim capacity atomically, fail over, complete, sweep.
-- Python only binds parameters to these functions; it never re-implements the matching.

create function public.great_circle_km(
  lat1 double precision, lon1 double precision, lat2 double precision, lon2 double precision
) returns double precision
language sql immutable parallel safe
as $$
  select 2 * 6371.0088 * asin(sqrt(
    power(sin(radians(lat2 - lat1) / 2), 2)
    + cos(radians(lat1)) * cos(radians(lat2)) * power(sin(radians(lon2 - lon1) / 2), 2)
  ))
$$;
comment on function public.great_circle_km(double precision, double precision, double precision, double precision) is 'Haversine distance in km between two points on the mean-radius Earth.';

create function public.required_vram_gb(p_model text, p_min_vram_gb real default null)
returns real
language plpgsql stable
set search_path = ''
as $$
declare
  v_min real;
begin
  if p_min_vram_gb is not null and p_min_vram_gb <= 0 then
    raise exception 'min VRAM must be positive, got % GB', p_min_vram_gb using errcode = 'invalid_parameter_value';
  end if;
  select coalesce(p_min_vram_gb, m.min_vram_gb) into v_min from public.models m where m.id = p_model;
  if v_min is not null then
    return v_min;
  end if;
  if p_min_vram_gb is not null then
    return p_min_vram_gb;
  end if;
  -- A model missing from the catalog is still servable by the nodes that hold it; they prove it fits.
  if exists (select 1 from public.node_models nm where nm.model_id = p_model) then
    return 1;
  end if;
  raise exception 'unknown model "%": not in the catalog and held by no node', p_model
    using errcode = 'no_data_found';
end;
$$;
comment on function public.required_vram_gb(text, real) is 'VRAM (GB) a request for a model needs: the caller''s figure, else the catalog''s; raises no_data_found for a model nobody knows.';

-- Indexed matching. Keep every request-independent part of each node's score in an index, so that
-- match_job() reads the top k instead of scoring every candidate node.
--
-- For a policy with total weight W, a node's score is base + w_proximity * proximity / W, where base
-- holds all other components (capacity included) and proximity is in [0, 1]. If T is the k-th best
-- base among eligible nodes, the k-th best score is at least T, so a node whose base is below
-- T - w_proximity / W cannot be in the top k. score_nodes() therefore rescores only the nodes from
-- the index whose base is at least that: the ranking is exact.

-- One definition of the components and of the hard filters, shared by every path (inlined by the
-- planner: single-SELECT SQL functions).
create function public.balanced_components(
  w public.matching_policies, vram_gb double precision, tflops double precision,
  hourly_rate double precision, model_state text, inflight integer, max_concurrency integer,
  successes bigint, failures bigint, speed_ratio real, min_vram_gb double precision
) returns table (
  fit double precision, compute double precision, price double precision, warm double precision,
  capacity double precision, reputation double precision, base double precision
)
language sql immutable parallel safe
as $$
  select c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation,
         (w.fit * c.fit + w.compute * c.compute + w.price * c.price + w.warm * c.warm
          + w.capacity * c.capacity + w.reputation * c.reputation)
         / (w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity)
  from (select
    least(1.0::float8, min_vram_gb / vram_gb) as fit,
    -- Claimed TFLOPS, discounted to what was measured when a node delivers less than it claims.
    tflops * least(1.0, coalesce(speed_ratio, 1.0))
      / (tflops * least(1.0, coalesce(speed_ratio, 1.0)) + w.compute_half_tflops) as compute,
    -- Price per unit of work (USD per TFLOP-hour), not per hour: a fast GPU can cost less per token.
    w.price_half_usd_per_tflop_hour / (w.price_half_usd_per_tflop_hour
      + hourly_rate / (tflops * least(1.0, coalesce(speed_ratio, 1.0)))) as price,
    case when model_state = 'loaded' then 1.0::float8 else 0.0::float8 end as warm,
    1.0::float8 - inflight::float8 / max_concurrency as capacity,
    -- Laplace-smoothed success rate, scaled down for a node delivering under a quarter of the
    -- speed its claimed GPU should (nodes can lie about specs).
    (successes + 1)::float8 / (successes + failures + 2)
      * least(1.0, coalesce(speed_ratio, 1.0) / 0.25) as reputation
  ) c
$$;
comment on function public.balanced_components(public.matching_policies, double precision, double precision, double precision, text, integer, integer, bigint, bigint, real, double precision) is 'The request-independent score components of a node for a model under a weighted policy, each in [0,1], and their weighted share of the score (base).';

create function public.proximity_component(
  w public.matching_policies, region text, latitude double precision, longitude double precision,
  p_region text, p_latitude double precision, p_longitude double precision
) returns double precision
language sql immutable parallel safe
as $$
  select case
    when p_latitude is not null and latitude is not null then
      w.distance_half_km / (w.distance_half_km + public.great_circle_km(p_latitude, p_longitude, latitude, longitude))
    when p_region is not null then (region = p_region)::integer::float8
    else 0.5::float8
  end
$$;
comment on function public.proximity_component(public.matching_policies, text, double precision, double precision, text, double precision, double precision) is 'How close a node is to the caller, in [0,1]: by great-circle distance, else by region, else 0.5 (unknown).';

create function public.reject_reason(
  n public.nodes, model_state text, p_model text, min_vram_gb double precision,
  fresh_after timestamptz, p_max_hourly_rate numeric, seed boolean
) returns text
language sql stable
as $$
  -- The first hard filter a node fails, or null when it may take the job. `seed` keeps the
  -- original's two filters (online, enough VRAM); the caller's price cap binds every policy.
  select case
    when n.status <> 'online' then 'status is ' || n.status
    when n.vram_gb < min_vram_gb then format('%s GB VRAM, needs %s GB', n.vram_gb, min_vram_gb)
    when p_max_hourly_rate is not null and n.hourly_rate > p_max_hourly_rate
      then format('costs $%s/h, over the cap of $%s/h', round(n.hourly_rate, 2), round(p_max_hourly_rate, 2))
    when seed then null
    when n.last_heartbeat_at is null or n.last_heartbeat_at < fresh_after
      then 'heartbeat is stale (last ' || coalesce(n.last_heartbeat_at::text, 'never') || ')'
    when model_state is null then format('does not hold %s', p_model)
    when n.inflight >= n.max_concurrency then format('at capacity (%s/%s)', n.inflight, n.max_concurrency)
    when n.cooldown_until > now() then 'cooling down until ' || n.cooldown_until::text
  end
$$;
comment on function public.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean) is 'The first hard filter a node fails for a request, as a sentence; null when the node is eligible.';

create function public.node_is_eligible(
  n public.nodes, min_vram_gb double precision, fresh_after timestamptz, p_max_hourly_rate numeric
) returns boolean
language sql stable
as $$
  -- reject_reason(...) is null, for a node that holds the model, as plain clauses the planner can
  -- estimate (tests check the two agree on random fleets).
  select n.status = 'online'
     and n.vram_gb >= min_vram_gb
     and (p_max_hourly_rate is null or n.hourly_rate <= p_max_hourly_rate)
     and n.last_heartbeat_at >= fresh_after
     and n.inflight < n.max_concurrency
     and (n.cooldown_until is null or n.cooldown_until <= now())
$$;
comment on function public.node_is_eligible(public.nodes, double precision, timestamptz, numeric) is 'True when a node that holds the model passes every hard filter of a weighted policy.';

revoke execute on function public.balanced_components(public.matching_policies, double precision, double precision, double precision, text, integer, integer, bigint, bigint, real, double precision) from public, anon;
revoke execute on function public.proximity_component(public.matching_policies, text, double precision, double precision, text, double precision, double precision) from public, anon;
revoke execute on function public.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean) from public, anon;
revoke execute on function public.node_is_eligible(public.nodes, double precision, timestamptz, numeric) from public, anon;
grant execute on function public.balanced_components(public.matching_policies, double precision, double precision, double precision, text, integer, integer, bigint, bigint, real, double precision) to authenticated, service_role;
grant execute on function public.proximity_component(public.matching_policies, text, double precision, double precision, text, double precision, double precision) to authenticated, service_role;
grant execute on function public.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean) to authenticated, service_role;
grant execute on function public.node_is_eligible(public.nodes, double precision, timestamptz, numeric) to authenticated, service_role;

create table public.node_scores (
  policy text not null references public.matching_policies (name) on delete cascade on update cascade,
  model_id text not null,
  node_id uuid not null,
  region text not null,
  base_score double precision not null,
  primary key (policy, model_id, node_id),
  foreign key (node_id, model_id) references public.node_models (node_id, model_id) on delete cascade
);
comment on table public.node_scores is 'Derived, kept by triggers: each node''s base score per (policy, model), indexed so the matcher reads the top k.';

create index node_scores_rank_idx on public.node_scores (policy, model_id, base_score desc, node_id);
-- Requests from a region drain that region's capacity, sinking its nodes in the global order; this
-- index keeps the in-region walk short.
create index node_scores_region_rank_idx on public.node_scores (policy, model_id, region, base_score desc, node_id);
create index node_scores_node_idx on public.node_scores (node_id);

revoke all on table public.node_scores from anon, authenticated;
grant all on table public.node_scores to service_role;
alter table public.node_scores enable row level security;

create view public.node_base_scores with (security_invoker = true) as
select w.name as policy, nm.model_id, n.id as node_id, n.region, c.base as base_score
from public.nodes n
join public.node_models nm on nm.node_id = n.id
-- The VRAM a held model needs, as required_vram_gb(model) gives it: the catalog's, else 1.
left join public.models m on m.id = nm.model_id
cross join public.matching_policies w
cross join lateral public.balanced_components(
  w, n.vram_gb::float8, n.tflops::float8, n.hourly_rate::float8, nm.state, n.inflight,
  n.max_concurrency, n.successes, n.failures, n.speed_ratio, coalesce(m.min_vram_gb, 1)::float8) c;
comment on view public.node_base_scores is 'What node_scores must hold, computed from the current rows (the definition node_scores caches).';
revoke all on table public.node_base_scores from anon, authenticated;
grant select on table public.node_base_scores to service_role;

create function public.refresh_node_scores(
  p_node_ids uuid[] default null, p_model_id text default null, p_policy text default null
) returns void
language plpgsql
set search_path = ''
as $$
begin
  -- Two statements, not one with `p_node_ids is null or ...`: each keeps a cheap cached plan.
  if p_node_ids is not null then
    insert into public.node_scores as s (policy, model_id, node_id, region, base_score)
    select v.policy, v.model_id, v.node_id, v.region, v.base_score from public.node_base_scores v
    where v.node_id = any (p_node_ids)
    on conflict (policy, model_id, node_id) do update
    set base_score = excluded.base_score, region = excluded.region
    where (s.base_score, s.region) is distinct from (excluded.base_score, excluded.region);
  else
    insert into public.node_scores as s (policy, model_id, node_id, region, base_score)
    select v.policy, v.model_id, v.node_id, v.region, v.base_score from public.node_base_scores v
    where (p_model_id is null or v.model_id = p_model_id) and (p_policy is null or v.policy = p_policy)
    on conflict (policy, model_id, node_id) do update
    set base_score = excluded.base_score, region = excluded.region
    where (s.base_score, s.region) is distinct from (excluded.base_score, excluded.region);
  end if;
end;
$$;
comment on function public.refresh_node_scores(uuid[], text, text) is 'Recomputes node_scores for the given nodes, model and policy (null: all).';
revoke execute on function public.refresh_node_scores(uuid[], text, text) from public, anon, authenticated;
grant execute on function public.refresh_node_scores(uuid[], text, text) to service_role;

create function public.node_scores_after_nodes_insert() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  perform public.refresh_node_scores(array(select n.id from new_rows n));
  return null;
end;
$$;
comment on function public.node_scores_after_nodes_insert() is 'Trigger: scores newly inserted nodes (one statement for a bulk insert).';
revoke execute on function public.node_scores_after_nodes_insert() from public, anon, authenticated;

create function public.node_scores_after_node_update() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  -- Every claim and release lands here: one cached plan updating this node's rows in place.
  update public.node_scores s set base_score = v.base_score, region = v.region
  from public.node_base_scores v
  where v.node_id = new.id and s.node_id = new.id and s.policy = v.policy and s.model_id = v.model_id
    and (s.base_score, s.region) is distinct from (v.base_score, v.region);
  return null;
end;
$$;
comment on function public.node_scores_after_node_update() is 'Trigger: rescores a node whose scored columns changed (a claim, a release, new specs).';
revoke execute on function public.node_scores_after_node_update() from public, anon, authenticated;

create function public.node_scores_after_node_models_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  perform public.refresh_node_scores(array(select distinct node_id from new_rows));
  return null;
end;
$$;
comment on function public.node_scores_after_node_models_change() is 'Trigger: refreshes node_scores for nodes whose models were added or changed state.';
revoke execute on function public.node_scores_after_node_models_change() from public, anon, authenticated;

create function public.node_scores_after_catalog_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  if tg_table_name = 'matching_policies' then
    perform public.refresh_node_scores(null, null, new.name);
  else
    perform public.refresh_node_scores(null, coalesce(new.id, old.id), null);
  end if;
  return null;
end;
$$;
comment on function public.node_scores_after_catalog_change() is 'Trigger: refreshes node_scores after a policy''s weights or a model''s VRAM need change.';
revoke execute on function public.node_scores_after_catalog_change() from public, anon, authenticated;

create trigger nodes_refresh_scores_insert after insert on public.nodes
  referencing new table as new_rows
  for each statement execute function public.node_scores_after_nodes_insert();
-- Only the columns the base score reads: heartbeats and status changes cost nothing here.
create trigger nodes_refresh_scores_update after update on public.nodes
  for each row
  when ((old.region, old.vram_gb, old.tflops, old.hourly_rate, old.inflight, old.max_concurrency,
         old.successes, old.failures, old.speed_ratio)
        is distinct from (new.region, new.vram_gb, new.tflops, new.hourly_rate, new.inflight,
                          new.max_concurrency, new.successes, new.failures, new.speed_ratio))
  execute function public.node_scores_after_node_update();
create trigger node_models_refresh_scores_insert after insert on public.node_models
  referencing new table as new_rows
  for each statement execute function public.node_scores_after_node_models_change();
create trigger node_models_refresh_scores_update after update on public.node_models
  referencing new table as new_rows
  for each statement execute function public.node_scores_after_node_models_change();
create trigger matching_policies_refresh_scores after insert or update on public.matching_policies
  for each row execute function public.node_scores_after_catalog_change();
create trigger models_refresh_scores after insert or update or delete on public.models
  for each row execute function public.node_scores_after_catalog_change();

select public.refresh_node_scores();

create function public.top_by_base(
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
    continue when not public.node_is_eligible(r.node, p_min_vram_gb, p_fresh_after, p_max_hourly_rate);
    node_id := r.node_id;
    base_score := r.base_score;
    return next;
    found_count := found_count + 1;
    exit when found_count >= p_k;
  end loop;
  close ranked;
end;
$$;
comment on function public.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, boolean, double precision) is 'The first p_k eligible nodes for a model in base-score order (optionally only in, or only out of, a region; stopping below p_floor).';
revoke execute on function public.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, boolean, double precision) from public, anon, authenticated;
grant execute on function public.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, boolean, double precision) to service_role;

create function public.score_nodes(
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
  v_min float8 := public.required_vram_gb(p_model, p_min_vram_gb);
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
     and v_min = public.required_vram_gb(p_model) then
    if p_latitude is null and p_region is null then
      -- Every node's proximity is the same 0.5: the top k by base are the top k.
      v_candidates := array(select t.node_id from public.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate) t);
    elsif p_latitude is null then
      -- Proximity is 1 in the caller's region and 0 elsewhere: the top k is within the top k of
      -- each side.
      v_candidates := array(
        select t.node_id from public.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_region, true) t
        union all
        select t.node_id from public.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_region, false) t);
    else
      -- Proximity varies continuously: every node whose base is within the proximity weight of
      -- the k-th best base may still rank.
      select min(t.base_score) into v_kth from public.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate) t;
      v_candidates := array(select t.node_id from public.top_by_base(
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
      cross join lateral public.balanced_components(
        w, n.vram_gb::float8, n.tflops::float8, n.hourly_rate::float8, nm.state, n.inflight,
        n.max_concurrency, n.successes, n.failures, n.speed_ratio, v_min) c
      cross join lateral (select public.proximity_component(
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
           public.reject_reason(n, nm.state, p_model, v_min, v_fresh_after, p_max_hourly_rate, v_seed) as reason
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
      from public.balanced_components(w, j.vram_gb, j.tflops, j.hourly_rate, j.state, j.inflight,
                                       j.max_concurrency, j.successes, j.failures, j.speed_ratio, v_min) b
      cross join lateral (select public.proximity_component(
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
revoke execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer) from public, anon;
grant execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer) to authenticated, service_role;

create function public.claim_node(p_candidates uuid[], p_exclude uuid[] default '{}', p_wait boolean default true)
returns setof public.nodes
language plpgsql
set search_path = ''
as $$
declare
  v_id uuid;
begin
  -- Lock the first candidate (in the given order) that is online, has a free slot and is not
  -- cooling down. SKIP LOCKED lets concurrent claims pass each other; the lock re-checks the row,
  -- so inflight can never exceed max_concurrency.
  select c.id into v_id
  from unnest(p_candidates) with ordinality as r (id, ord)
  join public.nodes c on c.id = r.id
  where c.status = 'online' and c.inflight < c.max_concurrency
    and (c.cooldown_until is null or c.cooldown_until <= now()) and c.id <> all (p_exclude)
  order by r.ord limit 1
  for update of c skip locked;
  if v_id is null and p_wait then
    -- Every free candidate was locked by someone (a claim, a completion, a heartbeat): wait for
    -- the first one rather than report a small fleet full. One row only, so no lock is held on
    -- rows passed over (that would let two claims deadlock).
    select c.id into v_id
    from unnest(p_candidates) with ordinality as r (id, ord)
    join public.nodes c on c.id = r.id
    where c.status = 'online' and c.inflight < c.max_concurrency
      and (c.cooldown_until is null or c.cooldown_until <= now()) and c.id <> all (p_exclude)
    order by r.ord limit 1;
    select c.id into v_id from public.nodes c
    where c.id = v_id and c.status = 'online' and c.inflight < c.max_concurrency
      and (c.cooldown_until is null or c.cooldown_until <= now())
    for update;
  end if;
  if v_id is null then
    return;
  end if;
  return query
    update public.nodes n
    set inflight = n.inflight + 1,
        status = case when n.inflight + 1 >= n.max_concurrency then 'busy' else n.status end
    where n.id = v_id
    returning n.*;
end;
$$;
comment on function public.claim_node(uuid[], uuid[], boolean) is 'Claims one slot on the first available candidate node, in order; returns it, or nothing when none is free.';
revoke execute on function public.claim_node(uuid[], uuid[], boolean) from public, anon, authenticated;
grant execute on function public.claim_node(uuid[], uuid[], boolean) to service_role;

create function public.release_reservation(p_job_id uuid, p_cost_usd numeric)
returns void
language sql
set search_path = ''
as $$
  -- A finished job stops holding its estimate and charges what it really cost.
  update public.api_keys k
  set reserved_usd = greatest(k.reserved_usd - j.reserved_usd, 0),
      spent_usd = k.spent_usd + p_cost_usd,
      last_used_at = now()
  from public.jobs j
  where j.id = p_job_id and k.id = j.api_key_id
$$;
comment on function public.release_reservation(uuid, numeric) is 'Releases the budget a job held and charges its key the job''s real cost.';
revoke execute on function public.release_reservation(uuid, numeric) from public, anon, authenticated;
grant execute on function public.release_reservation(uuid, numeric) to service_role;

create function public.match_job(
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
  v_min real := public.required_vram_gb(p_model, p_min_vram_gb);
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

  select * into v_node from public.claim_node(coalesce(v_ranked, '{}'));
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
comment on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric) is 'One atomic call per request: holds the estimated cost against the key''s budget (NG402 when spent), scores nodes, claims a slot on the best one, records the job and its first attempt, and returns the node (with the key the gateway signs requests to it with) and an ordered fallback list (node null and error set when none can take it).';
revoke execute on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric) from public, anon, authenticated;
grant execute on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric) to service_role;

create function public.release_node(p_node_id uuid, p_outcome text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  if p_outcome not in ('succeeded', 'failed', 'cancelled') then
    raise exception 'unknown outcome "%"', p_outcome using errcode = 'invalid_parameter_value';
  end if;
  -- Failures cool a node down exponentially (base * 2^(n-1), capped) so requests route around it.
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
        when 'failed' then now() + make_interval(secs => least(
          s.cooldown_max_s, s.cooldown_base_s * power(2, least(n.consecutive_failures, 30))))
        else n.cooldown_until end
  from public.platform_settings s
  where n.id = p_node_id;
end;
$$;
comment on function public.release_node(uuid, text) is 'Frees the slot a finished attempt held and records its outcome in the node''s reputation and cooldown.';
revoke execute on function public.release_node(uuid, text) from public, anon, authenticated;
grant execute on function public.release_node(uuid, text) to service_role;

create function public.end_attempt(
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
  perform public.release_node(v_attempt.node_id, p_outcome);
  return v_attempt;
end;
$$;
comment on function public.end_attempt(uuid, text, text, integer, real, real) is 'Ends a job''s running attempt with an outcome and releases its node.';
revoke execute on function public.end_attempt(uuid, text, text, integer, real, real) from public, anon, authenticated;
grant execute on function public.end_attempt(uuid, text, text, integer, real, real) to service_role;

create function public.failover_job(
  p_job_id uuid, p_error text, p_http_status integer default null, p_candidates uuid[] default '{}'
) returns table (node_id uuid, endpoint_url text, node_key bytea, attempt integer)
language plpgsql
set search_path = ''
as $$
declare
  v_tried uuid[];
  v_node public.nodes;
  v_attempt integer;
begin
  perform public.end_attempt(p_job_id, 'failed', p_error, p_http_status);
  select array_agg(a.node_id), max(a.attempt) into v_tried, v_attempt
  from public.job_attempts a where a.job_id = p_job_id;

  -- No waiting here: this transaction already holds the failed node's row, and waiting on another
  -- failover's node could deadlock with it.
  select * into v_node from public.claim_node(p_candidates, v_tried, false);
  if v_node.id is null then
    update public.jobs j set status = 'failed', error = p_error, finished_at = now() where j.id = p_job_id;
    perform public.release_reservation(p_job_id, 0);
    return;
  end if;
  insert into public.job_attempts (job_id, attempt, node_id) values (p_job_id, v_attempt + 1, v_node.id);
  update public.jobs j set node_id = v_node.id, attempts = v_attempt + 1 where j.id = p_job_id;
  return query select v_node.id, v_node.endpoint_url, v_node.secret_hash, v_attempt + 1;
end;
$$;
comment on function public.failover_job(uuid, text, integer, uuid[]) is 'Records the running attempt''s failure (cooling its node down) and claims the next free candidate not yet tried; no row means the job failed.';
revoke execute on function public.failover_job(uuid, text, integer, uuid[]) from public, anon, authenticated;
grant execute on function public.failover_job(uuid, text, integer, uuid[]) to service_role;

create function public.complete_job(
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
declare
  v_job public.jobs;
  v_attempt public.job_attempts;
  v_node public.nodes;
  v_model public.models;
  v_cost numeric;
  v_decode_s double precision;
  v_tps double precision;
  v_ratio double precision;
begin
  if p_status not in ('succeeded', 'failed', 'cancelled') then
    raise exception 'a job ends succeeded, failed or cancelled, not "%"', p_status using errcode = 'invalid_parameter_value';
  end if;
  if p_prompt_tokens < 0 or p_completion_tokens < 0 then
    raise exception 'token counts must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  select * into v_job from public.jobs j where j.id = p_job_id for update;
  if not found or v_job.status <> 'running' then
    raise exception 'job % is not running', p_job_id using errcode = 'object_not_in_prerequisite_state';
  end if;
  v_attempt := public.end_attempt(p_job_id, p_status, p_error, null, p_ttft_ms, p_latency_ms);
  select * into v_node from public.nodes n where n.id = v_attempt.node_id;
  select * into v_model from public.models m where m.id = v_job.model_id;

  -- Per-token catalog price when the model has one; otherwise the node's time: one of its
  -- max_concurrency slots for the attempt's duration.
  v_cost := case
    when v_model.input_usd_per_mtok is not null then
      (p_prompt_tokens * v_model.input_usd_per_mtok + p_completion_tokens * coalesce(v_model.output_usd_per_mtok, 0)) / 1e6
    else v_node.hourly_rate * (v_attempt.latency_ms / 3.6e6) / v_node.max_concurrency
  end;
  v_cost := coalesce(v_cost, 0);  -- the node was deleted mid-job: its time has no price left

  update public.jobs j
  set status = p_status, prompt_tokens = p_prompt_tokens, completion_tokens = p_completion_tokens,
      cost_usd = v_cost, ttft_ms = p_ttft_ms, latency_ms = v_attempt.latency_ms, error = p_error,
      finished_at = now()
  where j.id = p_job_id;

  if p_status = 'succeeded' then
    v_decode_s := (v_attempt.latency_ms - coalesce(p_ttft_ms, 0)) / 1000.0;
    v_tps := case when p_completion_tokens > 0 and v_decode_s > 0 then p_completion_tokens / v_decode_s end;
    -- Measured against claimed: the speed this model should reach on the node's claimed TFLOPS.
    v_ratio := v_tps / (v_node.tflops * v_model.tokens_per_s_per_tflop);
    update public.nodes n
    set ewma_latency_ms = coalesce(0.8 * n.ewma_latency_ms + 0.2 * v_attempt.latency_ms, v_attempt.latency_ms),
        ewma_tokens_per_s = coalesce(0.8 * n.ewma_tokens_per_s + 0.2 * v_tps, v_tps, n.ewma_tokens_per_s),
        speed_ratio = coalesce(0.8 * n.speed_ratio + 0.2 * v_ratio, v_ratio, n.speed_ratio)
    where n.id = v_node.id;
  end if;

  perform public.release_reservation(p_job_id, v_cost);
  return query select v_cost, v_attempt.latency_ms;
end;
$$;
comment on function public.complete_job(uuid, text, integer, integer, real, real, text) is 'Ends a running job: usage, cost (charged to its key), latency, the node''s reputation and EWMA speed, and releases its slot.';
revoke execute on function public.complete_job(uuid, text, integer, integer, real, real, text) from public, anon, authenticated;
grant execute on function public.complete_job(uuid, text, integer, integer, real, real, text) to service_role;

create function public.node_heartbeat(p_node_id uuid, p_loaded_models text[] default null)
returns text
language plpgsql
set search_path = ''
as $$
declare
  v_status text;
begin
  update public.nodes n
  set last_heartbeat_at = now(), missed_heartbeats = 0,
      status = case when n.status = 'offline' then 'online' else n.status end
  where n.id = p_node_id
  returning n.status into v_status;
  if not found then
    raise exception 'no node %', p_node_id using errcode = 'no_data_found';
  end if;
  if p_loaded_models is not null then
    insert into public.node_models (node_id, model_id, state)
    select p_node_id, m, 'loaded' from unnest(p_loaded_models) as m
    on conflict (node_id, model_id) do update set state = 'loaded' where public.node_models.state <> 'loaded';
    update public.node_models nm set state = 'available'
    where nm.node_id = p_node_id and nm.state = 'loaded' and nm.model_id <> all (p_loaded_models);
  end if;
  return v_status;
end;
$$;
comment on function public.node_heartbeat(uuid, text[]) is 'A node''s heartbeat: marks it fresh (back online if it was offline) and, when given, syncs its warm models.';
revoke execute on function public.node_heartbeat(uuid, text[]) from public, anon, authenticated;
grant execute on function public.node_heartbeat(uuid, text[]) to service_role;

create function public.sweep_stale_nodes()
returns table (node_id uuid, name text, last_heartbeat_at timestamptz)
language sql
set search_path = ''
as $$
  -- A node silent for missed_heartbeats_offline intervals goes offline (5 s x 3 = 15 s by default).
  update public.nodes n
  set status = 'offline',
      missed_heartbeats = coalesce(floor(extract(epoch from now() - n.last_heartbeat_at) / s.heartbeat_interval_s)::integer,
                                   s.missed_heartbeats_offline)
  from public.platform_settings s
  where n.status <> 'offline'
    and (n.last_heartbeat_at is null
         or n.last_heartbeat_at < now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline))
  returning n.id, n.name, n.last_heartbeat_at
$$;
comment on function public.sweep_stale_nodes() is 'Marks silent nodes offline and returns them; run every second by the service, or by pg_cron on Supabase.';
revoke execute on function public.sweep_stale_nodes() from public, anon, authenticated;
grant execute on function public.sweep_stale_nodes() to service_role;
