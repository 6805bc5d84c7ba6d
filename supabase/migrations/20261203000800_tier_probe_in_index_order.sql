-- The tier probe reads the index on an analyzed fleet.
--
-- Found: bench matching measured score_nodes() under VRAM pressure at 100,000 nodes at 3.5 ms p50 on
-- a new database and 19.3 ms once autovacuum had analyzed node_scores. With statistics, the planner
-- expects thousands of rows per tier and probes a tier by reading the table until the first match
-- (a Limit over a Seq Scan): for a tier that holds no node of the model, the whole table, once per
-- catalog tier. Measured on one scratch fleet of 100,000 nodes: 3.7 ms a ranking before analyze,
-- 20.9 ms after. Asked in the index's order (node_scores_tier_rank_idx: policy, model, tier, score),
-- the probe is one index lookup whatever the statistics say. Nothing else changes.

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
        select private.proximity_component(w, n.region, n.latitude, n.longitude, p_region, p_latitude, p_longitude)
                 as prox,
               private.reserve_component(c.vram_gb, v_min, v_levels, v_pressures) as reserve
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
           private.reject_reason(n, nm.state, p_model, v_min, v_fresh_after, p_max_hourly_rate, v_seed, p_route) as reason
    from public.nodes n
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
