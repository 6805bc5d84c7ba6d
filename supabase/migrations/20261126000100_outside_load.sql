-- Capacity from the backend. A node's inference server may be busy with work the platform did not
-- send (its owner's own use, another platform). Its agent reports how many requests the server is
-- running or holding (queue_depth: llama.cpp's /slots; vLLM's, SGLang's and TGI's gauges); what
-- exceeds the platform's own in-flight count at that moment is outside load, and the matcher counts
-- it against the node's free slots, in the spirit of llm-d's queue scorer. It stays a preference,
-- not a hard filter: the figure is as old as the last heartbeat (5 s), so a node is never refused
-- on it, only ranked below a node with slots free.

alter table public.nodes add column outside_load integer not null default 0;
alter table public.nodes add constraint "outside_load must not be negative" check (outside_load >= 0);
comment on column public.nodes.outside_load is 'Requests the node''s server ran or held beyond the platform''s own at its last heartbeat (queue_depth - inflight, at least 0): load from outside the platform.';

create function private.nodes_derive_outside_load() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- queue_depth counts the platform's requests too (the agent reports at least its own in-flight
  -- count): the rest came from elsewhere.
  new.outside_load := greatest(new.queue_depth - new.inflight, 0);
  return new;
end;
$$;
comment on function private.nodes_derive_outside_load() is 'Trigger: derives outside_load each time a heartbeat reports queue_depth.';
revoke execute on function private.nodes_derive_outside_load() from public, anon, authenticated, service_role;

-- `of queue_depth`: every heartbeat sets it; claims and releases (inflight alone) leave the figure be.
create trigger nodes_derive_outside_load before insert or update of queue_depth on public.nodes
  for each row execute function private.nodes_derive_outside_load();

-- A node's load (the platform's requests plus outside load) can exceed its slots: capacity stays in
-- [0, 1].
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
    greatest(0.0::float8, 1.0::float8 - inflight::float8 / max_concurrency) as capacity,
    -- Laplace-smoothed success rate, scaled down for a node delivering under a quarter of the
    -- speed its claimed GPU should (nodes can lie about specs).
    (successes + 1)::float8 / (successes + failures + 2)
      * least(1.0, coalesce(speed_ratio, 1.0) / 0.25) as reputation
  ) c
$$;
comment on function private.balanced_components(public.matching_policies, double precision, double precision, double precision, text, integer, integer, bigint, bigint, real, double precision) is 'The request-independent score components of a node for a model under a weighted policy, each in [0,1], and their weighted share of the score (base). inflight is the node''s load: the platform''s requests plus outside load.';

create or replace view public.node_base_scores with (security_invoker = true) as
select w.name as policy, nm.model_id, n.id as node_id, n.region, c.base as base_score
from public.nodes n
join public.node_models nm on nm.node_id = n.id
-- The VRAM a held model needs, as required_vram_gb(model) gives it: the catalog's, else 1.
left join public.models m on m.id = nm.model_id
cross join public.matching_policies w
cross join lateral private.balanced_components(
  w, n.vram_gb::float8, n.tflops::float8, n.hourly_rate::float8, nm.state, n.inflight + n.outside_load,
  n.max_concurrency, n.successes, n.failures, n.speed_ratio, coalesce(m.min_vram_gb, 1)::float8) c;

drop trigger nodes_refresh_scores_update on public.nodes;
create trigger nodes_refresh_scores_update after update on public.nodes
  for each row
  when ((old.region, old.vram_gb, old.tflops, old.hourly_rate, old.inflight, old.outside_load,
         old.max_concurrency, old.successes, old.failures, old.speed_ratio)
        is distinct from (new.region, new.vram_gb, new.tflops, new.hourly_rate, new.inflight,
                          new.outside_load, new.max_concurrency, new.successes, new.failures,
                          new.speed_ratio))
  execute function private.node_scores_after_node_update();

-- score_nodes() as before, each node's load (its in-flight requests plus outside load) in place of
-- its in-flight count.
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
        w, n.vram_gb::float8, n.tflops::float8, n.hourly_rate::float8, nm.state, n.inflight + n.outside_load,
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
           n.hourly_rate::float8 as hourly_rate, n.inflight + n.outside_load as inflight, n.max_concurrency, n.successes,
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
