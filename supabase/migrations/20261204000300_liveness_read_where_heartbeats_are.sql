-- What reads a node's last heartbeat reads the batches' too (issue 41).
--
-- Since 20261204000200 a beat that changes nothing writes only public.node_liveness, so a node's last
-- heartbeat is the later of nodes.last_heartbeat_at and its node_liveness row. Each reader of it now
-- reads both:
--
-- - the matcher's freshness filter: private.node_is_eligible() and private.reject_reason() take the
--   node's last beat as an argument (a new signature each: the old ones are dropped), and the walks
--   that call them (private.top_by_base(), private.top_by_total(), score_nodes()'s full path) join
--   the node's node_liveness row by its key; private.capacity_state() too. No SQL function runs per
--   candidate for it (tests/db/matching/test_fast_path.py);
-- - the warm capacity that pre-warm counts (private.refresh_prewarm_demand());
-- - what the map and owners read: the node_map view, my_nodes() and my_node_stats().
--
-- The sweep (sweep_stale_nodes()) reads both since 20261204000200.

create function private.node_is_eligible(
  n public.nodes,
  p_last_beat timestamptz,
  min_vram_gb double precision,
  fresh_after timestamptz,
  p_max_hourly_rate numeric,
  p_route text
) returns boolean
language sql stable
set search_path = ''
as $$
  -- reject_reason(...) is null, for a node that holds the model, as plain clauses the planner can
  -- estimate (tests check the two agree on random fleets). p_last_beat: the node's last heartbeat,
  -- the later of n.last_heartbeat_at and its node_liveness row's.
  select n.status = 'online'
     and n.vram_gb >= min_vram_gb
     and (p_max_hourly_rate is null or n.hourly_rate <= p_max_hourly_rate)
     and (p_route is null or p_route = any (n.routes))
     and p_last_beat >= fresh_after
     and n.inflight < n.max_concurrency
     and (n.cooldown_until is null or n.cooldown_until <= now())
$$;
comment on function private.node_is_eligible(public.nodes, timestamptz, double precision, timestamptz, numeric, text) is 'True when a node that holds the model passes every hard filter of a weighted policy, the request''s route (null: any) among them; p_last_beat is its last heartbeat (the later of nodes.last_heartbeat_at and node_liveness).';
revoke execute on function private.node_is_eligible(public.nodes, timestamptz, double precision, timestamptz, numeric, text) from public;
grant execute on function private.node_is_eligible(public.nodes, timestamptz, double precision, timestamptz, numeric, text) to service_role;

create function private.reject_reason(
  n public.nodes,
  p_last_beat timestamptz,
  model_state text,
  p_model text,
  min_vram_gb double precision,
  fresh_after timestamptz,
  p_max_hourly_rate numeric,
  seed boolean,
  p_route text
) returns text
language sql stable
set search_path = ''
as $_$
  -- The first hard filter a node fails, or null when it may take the job. `seed` keeps the
  -- original's two filters (online, enough VRAM); the caller's price cap and route bind every policy.
  -- p_last_beat: the node's last heartbeat, the later of n.last_heartbeat_at and node_liveness's.
  select case
    when n.status <> 'online' then 'status is ' || n.status
    when n.vram_gb < min_vram_gb then format('%s GB VRAM, needs %s GB', n.vram_gb, min_vram_gb)
    when p_max_hourly_rate is not null and n.hourly_rate > p_max_hourly_rate
      then format('costs $%s/h, over the cap of $%s/h', round(n.hourly_rate, 2), round(p_max_hourly_rate, 2))
    when p_route is not null and not p_route = any (n.routes) then 'does not serve /v1/' || p_route
    when seed then null
    when p_last_beat is null or p_last_beat < fresh_after
      then 'heartbeat is stale (last ' || coalesce(p_last_beat::text, 'never') || ')'
    when model_state is null then format('does not hold %s', p_model)
    when n.inflight >= n.max_concurrency then format('at capacity (%s/%s)', n.inflight, n.max_concurrency)
    when n.cooldown_until > now() then 'cooling down until ' || n.cooldown_until::text
  end
$_$;
comment on function private.reject_reason(public.nodes, timestamptz, text, text, double precision, timestamptz, numeric, boolean, text) is 'The first hard filter a node fails for a request, as a sentence (a route it does not serve: "does not serve /v1/<route>"; a heartbeat older than fresh_after: "heartbeat is stale", p_last_beat being its last one); null when the node is eligible.';
revoke execute on function private.reject_reason(public.nodes, timestamptz, text, text, double precision, timestamptz, numeric, boolean, text) from public;
grant execute on function private.reject_reason(public.nodes, timestamptz, text, text, double precision, timestamptz, numeric, boolean, text) to service_role;

create or replace function private.top_by_base(
  p_policy text,
  p_model text,
  p_k integer,
  p_min_vram_gb double precision,
  p_fresh_after timestamptz,
  p_max_hourly_rate numeric,
  p_route text,
  p_region text default null,
  p_in_region boolean default null,
  p_floor double precision default null
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
  -- A route beyond the three every node served before may be rare: its cursor leaves out the nodes
  -- not serving it, so that they are walked past in SQL, not a row at a time here. (The common
  -- routes keep the plain cursor, cheaper when nearly every node serves them; the loop checks the
  -- route either way.)
  v_rare boolean := coalesce(p_route <> all ('{chat/completions,completions,embeddings}'::text[]), false);
begin
  -- Each cursor reads the node's last heartbeat with it: the later of its row's and its
  -- node_liveness row's (one probe of that table's key).
  if p_in_region and v_rare then
    open ranked for
      select s.node_id, s.base_score, s.region, n as node,
             greatest(n.last_heartbeat_at, l.last_heartbeat_at) as beat
      from public.node_scores s
      join public.nodes n on n.id = s.node_id
      left join public.node_liveness l on l.node_id = s.node_id
      where s.policy = p_policy and s.model_id = p_model and s.region = p_region and p_route = any (n.routes)
      order by s.base_score desc, s.node_id;
  elsif p_in_region then
    open ranked for
      select s.node_id, s.base_score, s.region, n as node,
             greatest(n.last_heartbeat_at, l.last_heartbeat_at) as beat
      from public.node_scores s
      join public.nodes n on n.id = s.node_id
      left join public.node_liveness l on l.node_id = s.node_id
      where s.policy = p_policy and s.model_id = p_model and s.region = p_region
      order by s.base_score desc, s.node_id;
  elsif v_rare then
    open ranked for
      select s.node_id, s.base_score, s.region, n as node,
             greatest(n.last_heartbeat_at, l.last_heartbeat_at) as beat
      from public.node_scores s
      join public.nodes n on n.id = s.node_id
      left join public.node_liveness l on l.node_id = s.node_id
      where s.policy = p_policy and s.model_id = p_model and p_route = any (n.routes)
      order by s.base_score desc, s.node_id;
  else
    open ranked for
      select s.node_id, s.base_score, s.region, n as node,
             greatest(n.last_heartbeat_at, l.last_heartbeat_at) as beat
      from public.node_scores s
      join public.nodes n on n.id = s.node_id
      left join public.node_liveness l on l.node_id = s.node_id
      where s.policy = p_policy and s.model_id = p_model
      order by s.base_score desc, s.node_id;
  end if;
  loop
    fetch ranked into r;
    exit when not found or r.base_score < p_floor;
    continue when p_in_region = false and r.region = p_region;
    continue when not private.node_is_eligible(r.node, r.beat, p_min_vram_gb, p_fresh_after, p_max_hourly_rate, p_route);
    node_id := r.node_id;
    base_score := r.base_score;
    return next;
    found_count := found_count + 1;
    exit when found_count >= p_k;
  end loop;
  close ranked;
end;
$$;

create or replace function private.top_by_total(
  w public.matching_policies,
  p_weight double precision,
  p_model text,
  p_tier real,
  p_k integer,
  p_min_vram_gb double precision,
  p_fresh_after timestamptz,
  p_max_hourly_rate numeric,
  p_route text,
  p_levels real[],
  p_pressures double precision[],
  p_region text,
  p_latitude double precision,
  p_longitude double precision
) returns setof uuid
language plpgsql stable
set search_path = ''
as $$
declare
  ranked refcursor;
  r record;
  v_reserve float8 := w.reserve * private.reserve_component(p_tier, p_min_vram_gb, p_levels, p_pressures) / p_weight;
  v_bonus_max float8 := v_reserve + w.proximity / p_weight;
  v_top float8[] := '{}';  -- the best k totals so far, best first
  v_total float8;
  v_rare boolean := coalesce(p_route <> all ('{chat/completions,completions,embeddings}'::text[]), false);  -- as in top_by_base
begin
  -- Each cursor reads the node's last heartbeat with it, as top_by_base()'s do.
  if v_rare then
    open ranked for
      select s.node_id, s.base_score, n as node, greatest(n.last_heartbeat_at, l.last_heartbeat_at) as beat
      from public.node_scores s
      join public.nodes n on n.id = s.node_id
      left join public.node_liveness l on l.node_id = s.node_id
      where s.policy = w.name and s.model_id = p_model and s.tier_gb = p_tier and p_route = any (n.routes)
      order by s.base_score desc, s.node_id;
  else
    open ranked for
      select s.node_id, s.base_score, n as node, greatest(n.last_heartbeat_at, l.last_heartbeat_at) as beat
      from public.node_scores s
      join public.nodes n on n.id = s.node_id
      left join public.node_liveness l on l.node_id = s.node_id
      where s.policy = w.name and s.model_id = p_model and s.tier_gb = p_tier
      order by s.base_score desc, s.node_id;
  end if;
  loop
    fetch ranked into r;
    -- The tolerance keeps a node that could tie the k-th total (ties go by node id).
    exit when not found
      or (cardinality(v_top) >= p_k and r.base_score + v_bonus_max < v_top[p_k] - 1e-12);
    continue when not private.node_is_eligible(r.node, r.beat, p_min_vram_gb, p_fresh_after, p_max_hourly_rate, p_route);
    v_total := r.base_score + v_reserve
      + w.proximity * private.proximity_component(
          w, (r.node).region, (r.node).latitude, (r.node).longitude, p_region, p_latitude, p_longitude)
        / p_weight;
    if cardinality(v_top) < p_k or v_total >= v_top[p_k] - 1e-12 then
      v_top := (select array_agg(t order by t desc) from (
                  select t from unnest(v_top || v_total) t order by t desc limit p_k) x);
      return next r.node_id;
    end if;
  end loop;
  close ranked;
end;
$$;

create or replace function public.score_nodes(
  p_model text,
  p_min_vram_gb real default null,
  p_policy text default 'balanced',
  p_region text default null,
  p_latitude double precision default null,
  p_longitude double precision default null,
  p_max_hourly_rate numeric default null,
  p_explain boolean default false,
  p_limit integer default null,
  p_route text default null
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
  reserve double precision,
  reject_reason text
)
language plpgsql stable
-- Definer: it reads node_scores, the VRAM pressure and whole node rows, and returns only what the
-- map shows anyway.
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
  v_levels real[];
  v_pressures float8[];
begin
  if not v_seed then
    select * into w from public.matching_policies mp where mp.name = p_policy;
    if not found then
      raise exception 'unknown matching policy "%"', p_policy using errcode = 'invalid_parameter_value';
    end if;
    v_weight := w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity + w.reserve;
    -- Only levels above this request's need can cost it anything.
    if w.reserve > 0 then
      select array_agg(p.level_gb order by p.level_gb), array_agg(p.pressure order by p.level_gb)
        into v_levels, v_pressures
      from private.vram_pressure p where p.level_gb > v_min and p.pressure > 0;
    end if;
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
  -- scores assume the catalog's VRAM need, so a custom need takes the full path). The route is a
  -- hard filter inside each walk, so a walk never stops short of k nodes that serve it.
  if not v_seed and not p_explain and p_limit is not null
     and v_min = private.required_vram_gb(p_model) then
    if v_levels is not null then
      -- Some bigger VRAM level is under pressure: the reserve differs between tiers. Each tier
      -- that can hold the request is walked on its own (below the request's own, all too small).
      v_candidates := array(
        select private.top_by_total(
          w, v_weight, p_model, t.tier_gb, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route,
          v_levels, v_pressures, p_region, p_latitude, p_longitude)
        from (select 0::real as tier_gb union select m.min_vram_gb from public.models m) t
        where t.tier_gb >= private.vram_tier(v_min)
          -- A tier with no node has nothing to walk. One index probe per tier: a subquery with a
          -- limit is run per row, where an EXISTS would be joined to every row of the model; and
          -- in the index's order, which a scan of the table cannot give without reading it all.
          and (select true from public.node_scores s
               where s.policy = p_policy and s.model_id = p_model and s.tier_gb = t.tier_gb
               order by s.base_score desc limit 1));
    elsif p_latitude is null and p_region is null then
      -- Every node's proximity is the same 0.5: the top k by base are the top k.
      v_candidates := array(select t.node_id from private.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route) t);
    elsif p_latitude is null then
      -- Proximity is 1 in the caller's region and 0 elsewhere: the top k is within the top k of
      -- each side.
      v_candidates := array(
        select t.node_id from private.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route, p_region, true) t
        union all
        select t.node_id from private.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route, p_region, false) t);
    else
      -- Proximity varies continuously: every node whose base is within the proximity weight of
      -- the k-th best base may still rank.
      select min(t.base_score) into v_kth from private.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route) t;
      v_candidates := array(select t.node_id from private.top_by_base(
        p_policy, p_model, 2147483647, v_min, v_fresh_after, p_max_hourly_rate, p_route, null, null,
        v_kth - w.proximity / v_weight - 1e-12) t);
    end if;
    return query
    select r.id, r.name, row_number() over (order by r.total desc, r.id), r.total,
           r.fit, r.compute, r.price, r.warm, r.capacity, r.reputation, r.prox, r.reserve, null::text
    from (
      select n.id, n.name, c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, x.prox, x.reserve,
             c.base + (w.proximity * x.prox + w.reserve * x.reserve) / v_weight as total
      from unnest(v_candidates) as k (id)
      join public.nodes n on n.id = k.id
      join private.node_components c on c.node_id = n.id and c.model_id = p_model and c.policy = p_policy
      cross join lateral (
        -- Known without the node: an unknown caller is 0.5 from everyone, and with no level under
        -- pressure nothing is reserved (what the two functions return then, without calling them).
        select case when p_region is null and p_latitude is null then 0.5::float8
                    else private.proximity_component(w, n.region, n.latitude, n.longitude, p_region, p_latitude, p_longitude)
               end as prox,
               case when v_levels is null then 1.0::float8
                    else private.reserve_component(c.vram_gb, v_min, v_levels, v_pressures) end as reserve
        offset 0  -- once per node: not again for the total
      ) x
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
           n.hourly_rate::float8 as hourly_rate, n.region, n.latitude, n.longitude,
           private.reject_reason(n, greatest(n.last_heartbeat_at, l.last_heartbeat_at), nm.state, p_model, v_min,
                                 v_fresh_after, p_max_hourly_rate, v_seed, p_route) as reason
    from public.nodes n
    left join public.node_liveness l on l.node_id = n.id
    left join public.node_models nm on nm.node_id = n.id and nm.model_id = p_model
    where p_explain or n.status = 'online'
  ),
  ranked as (
    select j.id, j.name, c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, c.prox,
           c.reserve, c.total
    from judged j
    cross join lateral (
      select 0.3 * (j.vram_gb / v_min) + 0.5 * (j.tflops / 100.0) + 0.2 * (1.0 / (j.hourly_rate + 0.01)) as total,
             j.vram_gb / v_min as fit, j.tflops / 100.0 as compute, 1.0 / (j.hourly_rate + 0.01) as price,
             null::float8 as warm, null::float8 as capacity, null::float8 as reputation, null::float8 as prox,
             null::float8 as reserve
      where v_seed
      union all
      -- The view's fit and base are for the catalog's VRAM need; this request's need changes only
      -- the fit term.
      select c.base + c.fit_weight * (f.fit - c.fit) + (w.proximity * x.prox + w.reserve * x.reserve) / v_weight,
             f.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, x.prox, x.reserve
      from private.node_components c
      cross join lateral (select least(1.0::float8, v_min / c.vram_gb) as fit) f
      cross join lateral (
        select private.proximity_component(w, j.region, j.latitude, j.longitude, p_region, p_latitude, p_longitude)
                 as prox,
               private.reserve_component(c.vram_gb, v_min, v_levels, v_pressures) as reserve
        offset 0
      ) x
      where not v_seed and c.node_id = j.id and c.model_id = p_model and c.policy = p_policy
    ) c
    where j.reason is null
    order by c.total desc, j.id
    limit p_limit
  )
  select r.id, r.name, row_number() over (order by r.total desc, r.id), r.total,
         r.fit, r.compute, r.price, r.warm, r.capacity, r.reputation, r.prox, r.reserve, null::text
  from ranked r
  union all
  select j.id, j.name, null, null, null, null, null, null, null, null, null, null, j.reason
  from judged j
  where p_explain and j.reason is not null
  order by 3 nulls last, 1;
end;
$$;

create or replace function private.capacity_state(p_model text, p_min_vram_gb real, p_max_hourly_rate numeric, p_route text)
returns text
language sql stable
set search_path = ''
as $$
  -- Nodes that hold the model and pass every filter but a free slot and the route; then, among the
  -- ones serving the route, what a request may wait for. A node's last heartbeat: the later of its
  -- row's and its node_liveness row's.
  select case
    when count(*) = 0 then 'none'
    when count(*) filter (where c.serves) = 0 then 'route'
    when count(*) filter (where c.serves and n.inflight < n.max_concurrency
                            and n.cooldown_until is not null and n.cooldown_until > now()) > 0
      and count(*) filter (where c.serves and n.inflight >= n.max_concurrency) = 0
      then 'cooling'
    else 'busy' end
  from public.node_models nm
  join public.nodes n on n.id = nm.node_id
  left join public.node_liveness l on l.node_id = n.id
  cross join public.platform_settings s
  cross join lateral (select p_route is null or p_route = any (n.routes) as serves) c
  where nm.model_id = p_model
    and n.status in ('online', 'busy')
    and n.vram_gb >= private.required_vram_gb(p_model, p_min_vram_gb)
    and (p_max_hourly_rate is null or n.hourly_rate <= p_max_hourly_rate)
    and greatest(n.last_heartbeat_at, l.last_heartbeat_at)
        >= now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
$$;

drop function private.node_is_eligible(public.nodes, double precision, timestamptz, numeric, text);
drop function private.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean, text);

create or replace function private.refresh_prewarm_demand()
returns void
language plpgsql
set search_path = ''
as $$
declare
  s public.platform_settings;
  v_window interval;
begin
  select * into s from public.platform_settings;
  v_window := make_interval(secs => s.prewarm_window_s);
  -- Requests no agent answered in time (it went away, or predates pre-warm). Rows a heartbeat holds
  -- are left to it: that heartbeat expires its own.
  update public.prewarm_requests r set outcome = 'expired', answered_at = now()
  where r.id in (
    select o.id from public.prewarm_requests o
    where o.outcome = 'requested' and o.requested_at < now() - make_interval(secs => s.prewarm_expiry_s)
    for update skip locked
  );

  -- One pass over the window's jobs (jobs_created_at_idx). A job's region is the caller's, else the
  -- region of the node that took it.
  with recent as (
    select j.model_id, coalesce(j.region, n.region) as region, j.created_at,
           (j.attempts = 0 and j.status = 'failed') or coalesce(j.cold_start, false) as unmet,
           case when j.attempts > 0 then
             least(coalesce(j.latency_ms / 1000.0, extract(epoch from now() - j.created_at)::float8), s.prewarm_window_s)
           end as busy_s
    from public.jobs j
    left join public.nodes n on n.id = j.node_id
    where j.created_at >= now() - v_window
  ), demand as (
    select r.model_id, r.region, count(*)::integer as requests,
           -- Unmet since the last pre-load asked for here: what that one has not answered yet.
           (count(*) filter (where r.unmet and r.created_at > coalesce(p.last_requested_at, '-infinity')))::integer as unmet,
           (coalesce(sum(r.busy_s), 0) / s.prewarm_window_s)::real as load
    from recent r
    -- Joined on a key that can be hashed (a node's region is never empty).
    left join private.prewarm_demand p on p.model_id = r.model_id and coalesce(p.region, '') = coalesce(r.region, '')
    group by r.model_id, r.region
  ), warm as materialized (
    -- Warm capacity now, only for the models in demand (node_models_model_idx); computed once.
    select nm.model_id, n.region, sum(n.max_concurrency)::integer as slots
    from public.node_models nm
    join public.nodes n on n.id = nm.node_id
    left join public.node_liveness l on l.node_id = n.id
    where nm.model_id in (select d.model_id from demand d) and nm.state = 'loaded'
      and n.status in ('online', 'busy') and n.backend_up
      and greatest(n.last_heartbeat_at, l.last_heartbeat_at)
          >= now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
      and (n.cooldown_until is null or n.cooldown_until <= now())
    group by nm.model_id, n.region
  ), sized as (
    select d.*, coalesce((select sum(w.slots) from warm w
                          where w.model_id = d.model_id and (d.region is null or w.region = d.region)), 0)::integer as warm_slots
    from demand d
  )
  insert into private.prewarm_demand as p (model_id, region, requests, unmet, load, warm_slots, wanted, computed_at)
  select z.model_id, z.region, z.requests, z.unmet, z.load, z.warm_slots,
         z.unmet > 0 or z.warm_slots = 0 or z.load >= s.prewarm_busy_ratio * z.warm_slots, now()
  from sized z
  on conflict (model_id, region) do update
  set requests = excluded.requests, unmet = excluded.unmet, load = excluded.load,
      warm_slots = excluded.warm_slots, wanted = excluded.wanted, computed_at = excluded.computed_at;

  -- Demand that left the window.
  delete from private.prewarm_demand p where p.computed_at <> now();
  update private.prewarm_clock set refreshed_at = now();
end;
$$;


create or replace view public.node_map with (security_invoker = true) as
select n.id,
    n.name,
    n.gpu_model,
    n.gpu_count,
    n.vram_gb,
    n.tflops,
    n.hourly_rate,
    n.region,
    n.latitude,
    n.longitude,
    n.status,
    n.max_concurrency,
    n.inflight,
    -- The node's last heartbeat: the later of its row's and the batches' (node_liveness).
    greatest(n.last_heartbeat_at, max(l.last_heartbeat_at)) as last_heartbeat_at,
    n.successes,
    n.failures,
    n.ewma_latency_ms,
    n.ewma_tokens_per_s,
    n.cooldown_until,
    coalesce(array_agg(m.model_id order by m.model_id) filter (where m.state = 'loaded'), '{}'::text[]) as warm_models,
    coalesce(array_agg(m.model_id order by m.model_id) filter (where m.state = 'available'), '{}'::text[]) as available_models,
    n.missed_heartbeats,
    n.gpu_utilization,
    n.free_vram_gb,
    n.queue_depth
from public.nodes n
left join public.node_liveness l on l.node_id = n.id
left join public.node_models m on m.node_id = n.id
group by n.id;

create or replace function public.my_nodes()
returns table (
  id uuid, name text, status text, endpoint_url text, tunnel_connected boolean, backend_up boolean,
  backend jsonb, routes text[], gpu_model text, gpu_count integer, vram_gb real, tflops real,
  hourly_rate numeric, region text, latitude double precision, longitude double precision,
  max_concurrency integer, inflight integer, queue_depth integer, last_heartbeat_at timestamptz,
  successes bigint, failures bigint, ewma_latency_ms real, ewma_tokens_per_s real, cooldown_until timestamptz,
  warm_models text[], available_models text[], agent_version text, created_at timestamptz
)
language sql stable
set search_path = ''
as $$
  -- As the caller: the owner filter keeps it to their rows, and the endpoints' policy would too. The
  -- last heartbeat: the later of the row's and the batches' (node_liveness).
  select n.id, n.name, n.status, e.endpoint_url, n.tunnel_connected, n.backend_up, n.backend, n.routes,
         n.gpu_model, n.gpu_count, n.vram_gb, n.tflops, n.hourly_rate, n.region, n.latitude, n.longitude,
         n.max_concurrency, n.inflight, n.queue_depth, greatest(n.last_heartbeat_at, l.last_heartbeat_at),
         n.successes, n.failures, n.ewma_latency_ms, n.ewma_tokens_per_s, n.cooldown_until,
         coalesce((select array_agg(m.model_id order by m.model_id) from public.node_models m
                   where m.node_id = n.id and m.state = 'loaded'), '{}'),
         coalesce((select array_agg(m.model_id order by m.model_id) from public.node_models m
                   where m.node_id = n.id and m.state = 'available'), '{}'),
         n.agent_version, n.created_at
  from public.nodes n
  left join public.node_endpoints e on e.node_id = n.id
  left join public.node_liveness l on l.node_id = n.id
  where n.owner_id = (select auth.uid())
  order by n.name, n.id
$$;

create or replace function public.my_node_stats(p_window interval default '7 days')
returns table (
  node_id uuid, name text, status text, gpu_model text, gpu_count integer, region text, hourly_rate numeric,
  uptime double precision, observed_s double precision, jobs_served bigint, failures bigint,
  reputation double precision, warm_models text[], last_heartbeat_at timestamptz
)
language sql stable
set search_path = ''
as $$
  with mine as (
    -- The last heartbeat: the later of the row's and the batches' (node_liveness).
    select n.id, n.name, n.status, n.gpu_model, n.gpu_count, n.region, n.hourly_rate, n.successes, n.failures,
           n.speed_ratio, greatest(n.last_heartbeat_at, l.last_heartbeat_at) as last_heartbeat_at
    from public.nodes n
    left join public.node_liveness l on l.node_id = n.id
    where n.owner_id = (select auth.uid())
  ),
  recorded as (
    -- The changes inside the window, and the last one before it (the status the window starts in).
    select c.node_id, c.status, c.changed_at, c.id
    from mine m join public.node_status_changes c on c.node_id = m.id
    where c.changed_at >= now() - p_window
    union all
    select b.node_id, b.status, b.changed_at, b.id
    from mine m
    cross join lateral (
      select c.node_id, c.status, c.changed_at, c.id from public.node_status_changes c
      where c.node_id = m.id and c.changed_at < now() - p_window
      order by c.changed_at desc, c.id desc limit 1
    ) b
  ),
  spans as (
    select r.node_id, r.status in ('online', 'busy') as up,
           extract(epoch from coalesce(lead(r.changed_at) over w, now())
                              - greatest(r.changed_at, now() - p_window))::float8 as seconds
    from recorded r
    window w as (partition by r.node_id order by r.changed_at, r.id)
  ),
  uptime as (
    select s.node_id, coalesce(sum(s.seconds) filter (where s.up), 0) as up_s, sum(s.seconds) as observed_s
    from spans s group by s.node_id
  )
  select m.id, m.name, m.status, m.gpu_model, m.gpu_count, m.region, m.hourly_rate,
         u.up_s / nullif(u.observed_s, 0), coalesce(u.observed_s, 0), m.successes, m.failures,
         -- The matcher's reputation (private.balanced_components): Laplace-smoothed success rate,
         -- scaled down below a quarter of the claimed speed. A test keeps the two equal.
         (m.successes + 1)::float8 / (m.successes + m.failures + 2)
           * least(1.0, coalesce(m.speed_ratio, 1.0) / 0.25),
         coalesce((select array_agg(nm.model_id order by nm.model_id) from public.node_models nm
                   where nm.node_id = m.id and nm.state = 'loaded'), '{}'),
         m.last_heartbeat_at
  from mine m
  left join uptime u on u.node_id = m.id
  order by m.name, m.id
$$;
