-- The matcher's per-node arithmetic, inlined.
--
-- Every claim and release rescored the node through private.balanced_components(), and every
-- score_nodes() call ran it once per candidate (32 per placed request). A SQL function is inlined
-- into the query that calls it only when it has no SET clause, and lint 0011 wants search_path
-- pinned on every function (20261128000400_search_path.sql), so each call was a separate function
-- execution: measured on a 16-node fleet, place_job() took 2.1 ms, and 1.4 ms with that one
-- function's search_path reset. A view is always inlined and pins nothing, so the components are a
-- view now, the one place their formulas live; the function is gone.

create view private.node_components with (security_invoker = true) as
select w.name as policy, nm.model_id, n.id as node_id, n.region, n.vram_gb::float8 as vram_gb,
       c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation,
       (w.fit * c.fit + w.compute * c.compute + w.price * c.price + w.warm * c.warm
        + w.capacity * c.capacity + w.reputation * c.reputation) / s.weight as base,
       w.fit::float8 / s.weight as fit_weight
from public.nodes n
join public.node_models nm on nm.node_id = n.id
-- The VRAM a held model needs, as required_vram_gb(model) gives it: the catalog's, else 1.
left join public.models m on m.id = nm.model_id
cross join public.matching_policies w
cross join lateral (
  select w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity + w.reserve as weight
) s
-- The node's numbers as the formulas take them (float8), its load being the platform's requests
-- plus its outside load.
cross join lateral (
  select n.vram_gb::float8 as vram_gb, n.tflops::float8 as tflops, n.hourly_rate::float8 as hourly_rate,
         coalesce(n.speed_ratio, 1.0) as speed_ratio, n.inflight + n.outside_load as load
) i
cross join lateral (
  select
    least(1.0::float8, coalesce(m.min_vram_gb, 1)::float8 / i.vram_gb) as fit,
    -- Claimed TFLOPS, discounted to what was measured when a node delivers less than it claims.
    i.tflops * least(1.0, i.speed_ratio) / (i.tflops * least(1.0, i.speed_ratio) + w.compute_half_tflops) as compute,
    -- Price per unit of work (USD per TFLOP-hour), not per hour: a fast GPU can cost less per token.
    w.price_half_usd_per_tflop_hour
      / (w.price_half_usd_per_tflop_hour + i.hourly_rate / (i.tflops * least(1.0, i.speed_ratio))) as price,
    case when nm.state = 'loaded' then 1.0::float8 else 0.0::float8 end as warm,
    greatest(0.0::float8, 1.0::float8 - i.load::float8 / n.max_concurrency) as capacity,
    -- Laplace-smoothed success rate, scaled down for a node delivering under a quarter of the
    -- speed its claimed GPU should (nodes can lie about specs).
    (n.successes + 1)::float8 / (n.successes + n.failures + 2) * least(1.0, i.speed_ratio / 0.25) as reputation
) c;
comment on view private.node_components is 'The request-independent score components of each node for each model it holds under each weighted policy, each in [0,1], with fit for the catalog''s VRAM need; base is their weighted share of the score, fit_weight the fit''s share (a request''s own need changes only that term).';
revoke all on table private.node_components from public, anon, authenticated;
grant select on table private.node_components to service_role;

create or replace view public.node_base_scores with (security_invoker = true) as
select c.policy, c.model_id, c.node_id, c.region, c.base as base_score, private.vram_tier(c.vram_gb) as tier_gb
from private.node_components c;

-- score_nodes() reads them; the per-request proximity and reserve are computed once per node.

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
        where t.tier_gb >= private.vram_tier(v_min));
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
comment on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) is 'Ranks the nodes that can serve p_model under a policy (seed or a row of matching_policies), best first, with each score component (reserve: how little it takes from requests needing more VRAM, under current demand); with p_route (the path after /v1/), only nodes serving that route; with p_explain, also lists every rejected node and why.';
revoke execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) from public, anon;
grant execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) to authenticated, service_role;

drop function private.balanced_components(
  public.matching_policies, double precision, double precision, double precision, text, integer, integer,
  bigint, bigint, real, double precision);
