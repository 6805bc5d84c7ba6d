-- Right-sizing when it matters: the reserve component.
--
-- Putting a small job on a big node costs nothing while big nodes are plentiful, and costs a
-- refusal when a request that only big nodes can serve arrives to find them full of small jobs.
-- The static `fit` component charged the same price in both cases, so it was either too weak to
-- matter (its default) or wasted fast GPUs when they were idle. `reserve` prices that risk from
-- what is happening now:
--
--   * Every VRAM need in the catalog is a level L. Once a second the sweeper measures, per level,
--     the platform's running jobs at that level (needing at least L GB, less than the next level;
--     smoothed over reserve_window_s) against the slots they can use: online nodes with at least
--     L GB, less what the bigger levels' jobs take (they can use nothing smaller). That is
--     pressure(L) in [0, 1] (private.refresh_vram_pressure(): running jobs and nodes read once).
--   * A request needing v GB placed on a node of V GB keeps that node from requests needing
--     more than v and at most V: reserve = 1 - max pressure(L) for v < L <= V. A node no bigger
--     than the request needs, or any node while big-VRAM demand is low, scores reserve = 1.
--
-- It ranks, never refuses: a small job still takes a big node when nothing smaller is free.

alter table public.matching_policies add column reserve real not null default 0;
alter table public.matching_policies add constraint "reserve weight must not be negative" check (reserve >= 0);
comment on column public.matching_policies.reserve is 'Weight of the reserve component: keeping big-VRAM nodes free for the requests only they can serve, in proportion to the current demand for them (private.vram_pressure).';

alter table public.platform_settings add column reserve_window_s real not null default 30;
alter table public.platform_settings add constraint "reserve_window_s must be positive" check (reserve_window_s > 0);
comment on column public.platform_settings.reserve_window_s is 'Time constant (seconds) over which the demand behind each VRAM level''s pressure is smoothed.';

create table private.vram_pressure (
  level_gb real primary key,
  busy double precision not null default 0,
  slots integer not null default 0,
  pressure double precision not null default 0,
  updated_at timestamptz not null default now(),
  constraint "busy and slots must not be negative" check (busy >= 0 and slots >= 0),
  constraint "pressure must be in [0, 1]" check (pressure between 0 and 1)
);
comment on table private.vram_pressure is 'Per VRAM level of the catalog: running jobs at that level (needing at least it, less than the next; smoothed), the slots of online nodes that have it, and the pressure on them, refreshed by the sweeper.';
revoke all on table private.vram_pressure from public, anon, authenticated;
grant select on table private.vram_pressure to service_role;

create function private.refresh_vram_pressure() returns void
language sql
set search_path = ''
as $$
  with levels as (
    select distinct m.min_vram_gb as level_gb from public.models m
  ),
  -- Each running job at its level: the biggest level it needs at least (the smallest, for a job
  -- needing less than any).
  running as materialized (
    select coalesce((select max(l.level_gb) from levels l where l.level_gb <= j.min_vram_gb),
                    (select min(l.level_gb) from levels l)) as level_gb
    from public.jobs j where j.status = 'running'
  ),
  -- Slots by VRAM size first (a handful of sizes), so that nodes are read once, not once per level
  -- (materialized: a correlated subquery would otherwise read them again for each level).
  sizes as materialized (
    select n.vram_gb, sum(n.max_concurrency) as slots
    from public.nodes n where n.status in ('online', 'busy')
    group by n.vram_gb
  ),
  measured as (
    select l.level_gb,
           (select count(*) from running r where r.level_gb = l.level_gb)::float8 as busy_now,
           coalesce((select sum(s.slots) from sizes s where s.vram_gb >= l.level_gb), 0)::integer as slots,
           -- The share of the last sample to keep: exp(-elapsed / window).
           exp(-least(extract(epoch from now() - p.updated_at)::float8, 1e6) / st.reserve_window_s) as keep,
           p.busy as busy_before
    from levels l
    left join private.vram_pressure p on p.level_gb = l.level_gb
    cross join public.platform_settings st
  ),
  smoothed as (
    select m.level_gb, m.slots,
           case when m.busy_before is null then m.busy_now
                else m.busy_before * m.keep + m.busy_now * (1 - m.keep) end as busy
    from measured m
  ),
  -- A level's jobs can use every node that has it, except the slots that bigger jobs, which can
  -- use nothing smaller, take first.
  pressed as (
    select s.level_gb, s.busy, s.slots,
           s.slots - coalesce(sum(s.busy) over (order by s.level_gb desc
                                                rows between unbounded preceding and 1 preceding), 0) as left_over
    from smoothed s
  ),
  upserted as (
    insert into private.vram_pressure as p (level_gb, busy, slots, pressure, updated_at)
    select s.level_gb, s.busy, s.slots,
           case when s.busy = 0 then 0 when s.left_over <= 0 then 1 else least(1.0, s.busy / s.left_over) end,
           now()
    from pressed s
    on conflict (level_gb) do update
    set busy = excluded.busy, slots = excluded.slots, pressure = excluded.pressure,
        updated_at = excluded.updated_at
    returning p.level_gb
  )
  -- Levels no model in the catalog needs any more.
  delete from private.vram_pressure p where p.level_gb not in (select l.level_gb from levels l)
$$;
comment on function private.refresh_vram_pressure() is 'Measures each VRAM level''s pressure: its running jobs (smoothed over platform_settings.reserve_window_s) per slot they can use (online nodes that have the level, less what bigger jobs take). Run by sweep() every second.';
revoke execute on function private.refresh_vram_pressure() from public, anon, authenticated;
grant execute on function private.refresh_vram_pressure() to service_role;

create function private.reserve_component(
  vram_gb double precision, need_gb double precision, levels real[], pressures double precision[]
) returns double precision
language sql immutable parallel safe
set search_path = ''
as $$
  -- The pressure of the biggest demand this node could serve that the request does not need.
  select 1.0::float8 - coalesce(max(u.pressure), 0.0)
  from unnest(levels, pressures) as u (level_gb, pressure)
  where u.level_gb > need_gb and u.level_gb <= vram_gb
$$;
comment on function private.reserve_component(double precision, double precision, real[], double precision[]) is 'How little a request needing need_gb takes from bigger requests by running on a node of vram_gb: 1 minus the highest pressure among the VRAM levels above the need that the node reaches, in [0,1].';
revoke execute on function private.reserve_component(double precision, double precision, real[], double precision[]) from public, anon, authenticated, service_role;

-- The weighted mean now has one more weight in its denominator.
create or replace function private.balanced_components(
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
         / (w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity + w.reserve)
  from (select
    least(1.0::float8, min_vram_gb / vram_gb) as fit,
    -- Claimed TFLOPS, discounted to what was measured when a node delivers less than it claims.
    tflops * least(1.0, coalesce(speed_ratio, 1.0))
      / (tflops * least(1.0, coalesce(speed_ratio, 1.0)) + w.compute_half_tflops) as compute,
    -- Price per unit of work (USD per TFLOP-hour), not per hour: a fast GPU can cost less per token.
    w.price_half_usd_per_tflop_hour / (w.price_half_usd_per_tflop_hour
      + hourly_rate / (tflops * least(1.0, coalesce(speed_ratio, 1.0)))) as price,
    case when model_state = 'loaded' then 1.0::float8 else 0.0::float8 end as warm,
    greatest(0.0::float8, 1.0::float8 - inflight::float8 / max_concurrency) as capacity,
    -- Laplace-smoothed success rate, scaled down for a node delivering under a quarter of the
    -- speed its claimed GPU should (nodes can lie about specs).
    (successes + 1)::float8 / (successes + failures + 2)
      * least(1.0, coalesce(speed_ratio, 1.0) / 0.25) as reputation
  ) c
$$;

-- Each node's VRAM tier: the biggest catalog level it reaches. A request's reserve is the same for
-- every node of a tier, so under pressure the matcher walks each tier's index in base order.
create function private.vram_tier(vram_gb double precision) returns real
language sql stable parallel safe
set search_path = ''
as $$
  select coalesce(max(m.min_vram_gb), 0) from public.models m where m.min_vram_gb <= vram_gb
$$;
comment on function private.vram_tier(double precision) is 'The biggest VRAM need in the catalog that a node of vram_gb meets (0 if none): nodes of one tier share every request''s reserve component.';
revoke execute on function private.vram_tier(double precision) from public, anon, authenticated, service_role;

alter table public.node_scores add column tier_gb real not null default 0;
comment on column public.node_scores.tier_gb is 'The node''s VRAM tier (private.vram_tier()): the biggest catalog VRAM need it meets.';
create index node_scores_tier_rank_idx on public.node_scores (policy, model_id, tier_gb, base_score desc, node_id);

create or replace view public.node_base_scores with (security_invoker = true) as
select w.name as policy, nm.model_id, n.id as node_id, n.region, c.base as base_score,
       private.vram_tier(n.vram_gb::float8) as tier_gb
from public.nodes n
join public.node_models nm on nm.node_id = n.id
-- The VRAM a held model needs, as required_vram_gb(model) gives it: the catalog's, else 1.
left join public.models m on m.id = nm.model_id
cross join public.matching_policies w
cross join lateral private.balanced_components(
  w, n.vram_gb::float8, n.tflops::float8, n.hourly_rate::float8, nm.state, n.inflight + n.outside_load,
  n.max_concurrency, n.successes, n.failures, n.speed_ratio, coalesce(m.min_vram_gb, 1)::float8) c;

create or replace function private.refresh_node_scores(
  p_node_ids uuid[] default null, p_model_id text default null, p_policy text default null
) returns void
language plpgsql
set search_path = ''
as $$
begin
  -- Two statements, not one with `p_node_ids is null or ...`: each keeps a cheap cached plan.
  if p_node_ids is not null then
    insert into public.node_scores as s (policy, model_id, node_id, region, base_score, tier_gb)
    select v.policy, v.model_id, v.node_id, v.region, v.base_score, v.tier_gb from public.node_base_scores v
    where v.node_id = any (p_node_ids)
    on conflict (policy, model_id, node_id) do update
    set base_score = excluded.base_score, region = excluded.region, tier_gb = excluded.tier_gb
    where (s.base_score, s.region, s.tier_gb) is distinct from (excluded.base_score, excluded.region, excluded.tier_gb);
  else
    insert into public.node_scores as s (policy, model_id, node_id, region, base_score, tier_gb)
    select v.policy, v.model_id, v.node_id, v.region, v.base_score, v.tier_gb from public.node_base_scores v
    where (p_model_id is null or v.model_id = p_model_id) and (p_policy is null or v.policy = p_policy)
    on conflict (policy, model_id, node_id) do update
    set base_score = excluded.base_score, region = excluded.region, tier_gb = excluded.tier_gb
    where (s.base_score, s.region, s.tier_gb) is distinct from (excluded.base_score, excluded.region, excluded.tier_gb);
  end if;
end;
$$;

-- A model's VRAM need is a tier boundary for every node, not only for that model's rows.
create or replace function private.node_scores_after_catalog_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  if tg_table_name = 'matching_policies' then
    perform private.refresh_node_scores(null, null, new.name);
  elsif tg_op = 'UPDATE' and new.min_vram_gb is not distinct from old.min_vram_gb then
    perform private.refresh_node_scores(null, new.id, null);
  else
    perform private.refresh_node_scores();
  end if;
  return null;
end;
$$;

-- The walk of one VRAM tier when some level is under pressure. Base scores come from the tier's
-- index in order; each eligible node's total adds what depends on the request: the tier's reserve
-- (the same for all its nodes) and proximity, in [0, w.proximity]. Once the next base plus the most
-- those can add cannot reach the k-th best total seen, no later node of the tier can rank: the
-- walk stops (Fagin's threshold algorithm). Exact; with proximity weightless, k nodes per tier.
create function private.top_by_total(
  w public.matching_policies, p_weight double precision, p_model text, p_tier real, p_k integer,
  p_min_vram_gb double precision, p_fresh_after timestamptz, p_max_hourly_rate numeric,
  p_levels real[], p_pressures double precision[],
  p_region text, p_latitude double precision, p_longitude double precision
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
begin
  open ranked for
    select s.node_id, s.base_score, n as node from public.node_scores s
    join public.nodes n on n.id = s.node_id
    where s.policy = w.name and s.model_id = p_model and s.tier_gb = p_tier
    order by s.base_score desc, s.node_id;
  loop
    fetch ranked into r;
    -- The tolerance keeps a node that could tie the k-th total (ties go by node id).
    exit when not found
      or (cardinality(v_top) >= p_k and r.base_score + v_bonus_max < v_top[p_k] - 1e-12);
    continue when not private.node_is_eligible(r.node, p_min_vram_gb, p_fresh_after, p_max_hourly_rate);
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
comment on function private.top_by_total(public.matching_policies, double precision, text, real, integer, double precision, timestamptz, numeric, real[], double precision[], text, double precision, double precision) is 'Candidates that contain the top p_k nodes of one VRAM tier by total score (base plus reserve and proximity), walking the tier''s base-score index only as far as a later node could still rank.';
revoke execute on function private.top_by_total(public.matching_policies, double precision, text, real, integer, double precision, timestamptz, numeric, real[], double precision[], text, double precision, double precision) from public, anon, authenticated, service_role;

-- score_nodes() gains the reserve column; its return type changes, so it is dropped and made again.
drop function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer);
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
  -- scores assume the catalog's VRAM need, so a custom need takes the full path).
  if not v_seed and not p_explain and p_limit is not null
     and v_min = private.required_vram_gb(p_model) then
    if v_levels is not null then
      -- Some bigger VRAM level is under pressure: the reserve differs between tiers. Each tier
      -- that can hold the request is walked on its own (below the request's own, all too small).
      v_candidates := array(
        select private.top_by_total(
          w, v_weight, p_model, t.tier_gb, p_limit, v_min, v_fresh_after, p_max_hourly_rate, v_levels,
          v_pressures, p_region, p_latitude, p_longitude)
        from (select 0::real as tier_gb union select m.min_vram_gb from public.models m) t
        where t.tier_gb >= private.vram_tier(v_min));
    elsif p_latitude is null and p_region is null then
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
           r.fit, r.compute, r.price, r.warm, r.capacity, r.reputation, r.prox, r.reserve, null::text
    from (
      select n.id, n.name, c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, p.prox, v.reserve,
             c.base + (w.proximity * p.prox + w.reserve * v.reserve) / v_weight as total
      from unnest(v_candidates) as k (id)
      join public.nodes n on n.id = k.id
      join public.node_models nm on nm.node_id = n.id and nm.model_id = p_model
      cross join lateral private.balanced_components(
        w, n.vram_gb::float8, n.tflops::float8, n.hourly_rate::float8, nm.state, n.inflight + n.outside_load,
        n.max_concurrency, n.successes, n.failures, n.speed_ratio, v_min) c
      cross join lateral (select private.proximity_component(
        w, n.region, n.latitude, n.longitude, p_region, p_latitude, p_longitude) as prox) p
      cross join lateral (select private.reserve_component(
        n.vram_gb::float8, v_min, v_levels, v_pressures) as reserve) v
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
           n.hourly_rate::float8 as hourly_rate, n.inflight + n.outside_load as inflight, n.max_concurrency, n.successes,
           n.failures, n.speed_ratio, n.region, n.latitude, n.longitude, nm.state,
           private.reject_reason(n, nm.state, p_model, v_min, v_fresh_after, p_max_hourly_rate, v_seed) as reason
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
      select b.base + (w.proximity * p.prox + w.reserve * v.reserve) / v_weight, b.fit, b.compute, b.price,
             b.warm, b.capacity, b.reputation, p.prox, v.reserve
      from private.balanced_components(w, j.vram_gb, j.tflops, j.hourly_rate, j.state, j.inflight,
                                       j.max_concurrency, j.successes, j.failures, j.speed_ratio, v_min) b
      cross join lateral (select private.proximity_component(
        w, j.region, j.latitude, j.longitude, p_region, p_latitude, p_longitude) as prox) p
      cross join lateral (select private.reserve_component(
        j.vram_gb, v_min, v_levels, v_pressures) as reserve) v
      where not v_seed
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
comment on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer) is 'Ranks the nodes that can serve p_model under a policy (seed or a row of matching_policies), best first, with each score component (reserve: how little it takes from requests needing more VRAM, under current demand); with p_explain, also lists every rejected node and why.';
revoke execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer) from public, anon;
grant execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer) to authenticated, service_role;

-- The sweep measures the pressure once a second too.
create or replace function public.sweep(p_max_job_age interval default null)
returns table (kind text, id uuid, name text)
language plpgsql
set search_path = ''
as $$
declare
  v_max_job_age interval := coalesce(
    p_max_job_age, (select make_interval(secs => s.job_deadline_s) from public.platform_settings s));
begin
  return query select 'node_offline'::text, s.node_id, s.name from public.sweep_stale_nodes() s;
  return query select 'node_offline'::text, s.node_id, s.name from private.sweep_dead_tunnels() s;
  return query select 'job_orphaned'::text, s.job_id, null::text from private.sweep_orphaned_jobs() s;
  return query select 'job_abandoned'::text, s.job_id, null::text from public.sweep_stale_jobs(v_max_job_age) s;
  perform private.refresh_vram_pressure();
end;
$$;

-- Default weights re-tuned with the simulator's honest performance model (docs/simulation.md):
-- right-sizing (fit) now leads. With decode bound by memory bandwidth, a big GPU is no longer many
-- times faster than a small one, so a small job on a small card costs less per token at nearly the
-- same latency, and the big nodes stay free for what only they can serve; reserve adds to that
-- price while big-VRAM demand is high.
update public.matching_policies
set fit = 0.66, compute = 0.08, price = 0.06, warm = 0.11, capacity = 0.02, reputation = 0.01,
    proximity = 0, reserve = 0.06
where name = 'balanced';
select private.refresh_node_scores();
