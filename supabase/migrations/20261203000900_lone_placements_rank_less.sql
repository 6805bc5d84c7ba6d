-- A lone placement ranks for less.
--
-- Sequentially (one request per place_jobs() call, as a quiet gateway sends them) the ranking is a
-- fixed cost no group shares: 476 us of a placement's 1,079 us on 16 nodes (pg_stat_statements,
-- track all). Two parts of it did work whose answer was known before any node was read:
--
-- - score_nodes()'s fast path called private.proximity_component() and private.reserve_component()
--   for every candidate. With no caller location or region every node's proximity is 0.5 (the fast
--   path's own premise), and with no VRAM level under pressure every reserve is 1: the same numbers,
--   now without two SQL function calls per node (neither inlines: each pins its search_path). 90 us
--   of a ranking's 330 on 16 nodes, in a loop of its own.
-- - place_jobs() moved the ranking on after each claim (the claimed node's capacity read again, the
--   ranking re-sorted) for the request after it: the group's last request has none.
--
-- Measured with `neuralgrid bench sql --compare` (alternating rounds, 6 of 700 jobs): Postgres CPU
-- per job 0.92x alone, 0.97x in groups of 14; placing a lone request 0.89x.

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

create or replace function public.place_jobs(p_gateway text, p_requests jsonb)
returns table (
  ord integer, job_id uuid, node_id uuid, endpoint_url text, node_key bytea, attempt integer,
  fallback_ids uuid[], error text, max_output_tokens integer, busy boolean, tokens_per_s real[],
  refusal text, failure_state text, failure text)
language plpgsql
set search_path = ''
as $$
declare
  r record;
  v_placed record;
  v_cap integer;
  v_holding boolean := false;  -- whether an earlier request of the group may hold row locks
  -- The ranking the next request may start from, and what it was ranked for.
  v_for jsonb;
  v_key jsonb;
  v_limit integer;
  v_ids uuid[];
  v_scores float8[];
  v_caps float8[];  -- each ranked node's capacity term (private.node_components) when ranked
  v_last float8;  -- the lowest score when ranked
  v_full boolean;  -- whether the ranking was cut at its limit (nodes were left out)
  v_share float8;  -- the policy's capacity weight over all its weights
  v_cap_now float8;
  v_filled boolean;
  v_at integer;
  v_final integer;  -- the number of the group's last request
begin
  if jsonb_typeof(p_requests) is distinct from 'array' then
    raise exception 'place_jobs takes a JSON array of requests' using errcode = 'invalid_parameter_value';
  end if;
  -- Each request runs in a subtransaction of its own (so that it can fail alone), and a claim that
  -- fills a node runs up to two more (realtime.send(), for the map and the owner); past 64 in one
  -- transaction Postgres's per-backend cache of them overflows and every snapshot reads pg_subtrans.
  if jsonb_array_length(p_requests) > 16 then
    raise exception 'place_jobs takes at most 16 requests, not %', jsonb_array_length(p_requests)
      using errcode = 'invalid_parameter_value';
  end if;
  v_final := jsonb_array_length(p_requests);
  perform set_config('neuralgrid.gateway_id', coalesce(p_gateway, ''), true);  -- stamp_job_gateway()
  for r in
    select * from rows from (jsonb_to_recordset(p_requests) as (
      model text, key uuid, policy text, min_vram real, region text, lat float8, lon float8,
      max_rate numeric, stream boolean, fallbacks integer, prompt_bytes integer, max_out integer,
      wait boolean, route text, end_user text))
    with ordinality as x (model, key, policy, min_vram, region, lat, lon, max_rate, stream, fallbacks,
                          prompt_bytes, max_out, wait, route, end_user, n)
  loop
    begin
      perform set_config('neuralgrid.end_user', coalesce(r.end_user, ''), true),
              set_config('lock_timeout', case when v_holding then '10ms' else '100ms' end, true);
      v_cap := private.answer_cap(r.model, r.key, r.prompt_bytes, r.max_out);
      v_key := jsonb_build_array(r.model, r.policy, r.min_vram, r.region, r.lat, r.lon, r.max_rate, r.route,
                                 coalesce(r.fallbacks, 0));
      if v_key is distinct from v_for then
        v_for := null;
        -- As private.place() ranks: the same call, with the scores kept.
        v_limit := private.ranking_limit(coalesce(r.fallbacks, 0));
        select array_agg(s.node_id order by s.rank), array_agg(s.score order by s.rank),
               array_agg(s.capacity order by s.rank), min(s.score), count(*) >= v_limit
          into v_ids, v_scores, v_caps, v_last, v_full
        from public.score_nodes(r.model, r.min_vram, r.policy, r.region, r.lat, r.lon, r.max_rate, false,
                                v_limit, r.route) s;
        -- In float8 over the weights' sum in real, as private.node_components divides.
        select w.capacity::float8 / (w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity + w.reserve)::float8
          into v_share from public.matching_policies w where w.name = r.policy;  -- none for seed
        v_for := v_key;
      end if;
      select * into v_placed
      from private.place(r.model, r.key, r.policy, r.min_vram, r.region, r.lat, r.lon, r.max_rate,
                         coalesce(r.stream, false), coalesce(r.fallbacks, 0),
                         private.budget_hold(r.model, r.prompt_bytes, v_cap), coalesce(r.wait, false), r.route,
                         coalesce(v_ids, '{}')) p;
      v_holding := true;  -- its claim may have locked rows, even one that claimed nothing
      v_at := array_position(v_ids, v_placed.node_id);
      if r.n = v_final then
        null;  -- no request after it to rank for
      elsif v_placed.reranked or v_at is null then
        v_for := null;  -- claimed from a fresh ranking, or nothing claimed: the next ranks afresh
      else
        -- The claimed node's capacity term now (none for seed, which has none), and whether it is full.
        select c.capacity, n.inflight >= n.max_concurrency into v_cap_now, v_filled
        from public.nodes n
        left join private.node_components c on c.node_id = n.id and c.policy = r.policy and c.model_id = r.model
        where n.id = v_placed.node_id;
        v_scores[v_at] := v_scores[v_at] - coalesce(v_share * (v_caps[v_at] - v_cap_now), 0);
        v_caps[v_at] := v_cap_now;
        if v_full and (v_filled or v_scores[v_at] <= v_last) then
          v_for := null;  -- a node left out of the ranking may take its place now
        elsif v_filled then  -- no longer eligible: out of the ranking, as score_nodes() would leave it
          v_ids := v_ids[:v_at - 1] || v_ids[v_at + 1:];
          v_scores := v_scores[:v_at - 1] || v_scores[v_at + 1:];
          v_caps := v_caps[:v_at - 1] || v_caps[v_at + 1:];
        else
          select array_agg(u.id order by u.score desc, u.id), array_agg(u.score order by u.score desc, u.id),
                 array_agg(u.capacity order by u.score desc, u.id)
            into v_ids, v_scores, v_caps
          from unnest(v_ids, v_scores, v_caps) as u (id, score, capacity);
        end if;
      end if;
      return query
      select r.n::integer, v_placed.job_id, v_placed.node_id, v_placed.endpoint_url, v_placed.node_key,
        v_placed.attempt, v_placed.fallback_ids, v_placed.error, v_cap, v_placed.busy,
        v_placed.tokens_per_s, v_placed.refusal, null::text, null::text;
    exception when others then
      v_for := null;  -- what it claimed is undone: its ranking's move with it
      return query
      select r.n::integer, null::uuid, null::uuid, null::text, null::bytea, 0, '{}'::uuid[], null::text,
        null::integer, false, '{}'::real[], null::text, sqlstate, sqlerrm;
    end;
  end loop;
end;
$$;
