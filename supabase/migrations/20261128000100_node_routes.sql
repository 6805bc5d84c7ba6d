-- The OpenAI routes each node serves, and the matcher filtering on them.
--
-- Nodes no longer all serve the same three routes: llama.cpp's server serves /v1/responses, and
-- /v1/rerank only with a reranking model; vLLM serves what its model's tasks allow (/v1/rerank and
-- /v1/score for a cross-encoder, /v1/audio/transcriptions for Whisper). Each node's agent detects
-- its server's routes and reports them in `backend.routes`; they are kept here as `nodes.routes`,
-- a column of known route names (the path after /v1/). Nodes that never reported keep the three
-- every node served before (chat/completions, completions, embeddings).
--
-- The matcher takes the request's route (p_route): a node that does not serve it is rejected like
-- one that is offline ("does not serve /v1/rerank"), in the full scan and in the indexed fast path
-- alike, so that both stay equal. A null route filters nothing: every earlier caller keeps its
-- answers. place_job() gains an overload with the route that also says why nothing was placed
-- (`refusal`): no capable node online, none serving the route, every one busy, or cooling down.
-- The catalog's kinds grow by the models these routes serve: rerankers, transcription and speech.

-- The catalog's kinds -------------------------------------------------------------------------------

alter table public.models drop constraint "kind must be chat, completion or embedding";
alter table public.models add constraint "kind must be chat, completion, embedding, rerank, transcription or speech"
  check (kind in ('chat', 'completion', 'embedding', 'rerank', 'transcription', 'speech'));
comment on column public.models.kind is 'What the model does, and so which routes serve it: chat and completion models /v1/chat/completions, /v1/completions and /v1/responses; embedding models /v1/embeddings, /v1/rerank and /v1/score; rerank models /v1/rerank and /v1/score; transcription models /v1/audio/transcriptions and /v1/audio/translations; speech models /v1/audio/speech.';

-- The routes a node serves ------------------------------------------------------------------------

alter table public.nodes add column routes text[] not null default '{chat/completions,completions,embeddings}';
-- The names are the paths after /v1/; neuralgrid.protocol.routes.ROUTES lists the same (a test
-- holds the two equal).
alter table public.nodes add constraint "routes must be known route names, at least one" check (
  cardinality(routes) >= 1
  and routes <@ '{chat/completions,completions,embeddings,responses,rerank,score,audio/transcriptions,audio/translations,audio/speech}'::text[]
);
comment on column public.nodes.routes is 'The OpenAI routes the node''s server serves, as the paths after /v1/ (chat/completions, responses, rerank, audio/speech, ...): what its agent reported in backend.routes, else the three every node served before. The matcher sends a request only to nodes serving its route.';
grant select (routes) on table public.nodes to anon, authenticated;

create function private.nodes_derive_routes() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- An agent that says nothing of routes (an earlier version, or null) leaves them as they were.
  case jsonb_typeof(new.backend -> 'routes')
    when 'array' then
      new.routes := array(select jsonb_array_elements_text(new.backend -> 'routes'));
    when 'null' then
      null;
    else
      if new.backend ? 'routes' then
        raise exception 'backend.routes must be an array of route names' using errcode = 'check_violation';
      end if;
  end case;
  return new;
end;
$$;
comment on function private.nodes_derive_routes() is 'Trigger: sets nodes.routes from the routes the agent reported in backend.routes (an array of route names); a backend without them leaves routes as they were.';
revoke execute on function private.nodes_derive_routes() from public, anon, authenticated, service_role;

create trigger nodes_derive_routes before insert or update of backend on public.nodes
  for each row execute function private.nodes_derive_routes();

-- The hard filters, with the route ------------------------------------------------------------------

drop function private.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean);
create function private.reject_reason(
  n public.nodes, model_state text, p_model text, min_vram_gb double precision,
  fresh_after timestamptz, p_max_hourly_rate numeric, seed boolean, p_route text
) returns text
language sql stable
as $$
  -- The first hard filter a node fails, or null when it may take the job. `seed` keeps the
  -- original's two filters (online, enough VRAM); the caller's price cap and route bind every policy.
  select case
    when n.status <> 'online' then 'status is ' || n.status
    when n.vram_gb < min_vram_gb then format('%s GB VRAM, needs %s GB', n.vram_gb, min_vram_gb)
    when p_max_hourly_rate is not null and n.hourly_rate > p_max_hourly_rate
      then format('costs $%s/h, over the cap of $%s/h', round(n.hourly_rate, 2), round(p_max_hourly_rate, 2))
    when p_route is not null and not p_route = any (n.routes) then 'does not serve /v1/' || p_route
    when seed then null
    when n.last_heartbeat_at is null or n.last_heartbeat_at < fresh_after
      then 'heartbeat is stale (last ' || coalesce(n.last_heartbeat_at::text, 'never') || ')'
    when model_state is null then format('does not hold %s', p_model)
    when n.inflight >= n.max_concurrency then format('at capacity (%s/%s)', n.inflight, n.max_concurrency)
    when n.cooldown_until > now() then 'cooling down until ' || n.cooldown_until::text
  end
$$;
comment on function private.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean, text) is 'The first hard filter a node fails for a request, as a sentence (a route it does not serve: "does not serve /v1/<route>"); null when the node is eligible.';
revoke execute on function private.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean, text) from public, anon, authenticated;
grant execute on function private.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean, text) to service_role;

drop function private.node_is_eligible(public.nodes, double precision, timestamptz, numeric);
create function private.node_is_eligible(
  n public.nodes, min_vram_gb double precision, fresh_after timestamptz, p_max_hourly_rate numeric,
  p_route text
) returns boolean
language sql stable
as $$
  -- reject_reason(...) is null, for a node that holds the model, as plain clauses the planner can
  -- estimate (tests check the two agree on random fleets).
  select n.status = 'online'
     and n.vram_gb >= min_vram_gb
     and (p_max_hourly_rate is null or n.hourly_rate <= p_max_hourly_rate)
     and (p_route is null or p_route = any (n.routes))
     and n.last_heartbeat_at >= fresh_after
     and n.inflight < n.max_concurrency
     and (n.cooldown_until is null or n.cooldown_until <= now())
$$;
comment on function private.node_is_eligible(public.nodes, double precision, timestamptz, numeric, text) is 'True when a node that holds the model passes every hard filter of a weighted policy, the request''s route (null: any) among them.';
revoke execute on function private.node_is_eligible(public.nodes, double precision, timestamptz, numeric, text) from public, anon, authenticated;
grant execute on function private.node_is_eligible(public.nodes, double precision, timestamptz, numeric, text) to service_role;

-- The fast path's walks, with the route ---------------------------------------------------------------

drop function private.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, boolean, double precision);
create function private.top_by_base(
  p_policy text, p_model text, p_k integer, p_min_vram_gb double precision,
  p_fresh_after timestamptz, p_max_hourly_rate numeric, p_route text,
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
  -- A route beyond the three every node served before may be rare: its cursor leaves out the nodes
  -- not serving it, so that they are walked past in SQL, not a row at a time here. (The common
  -- routes keep the plain cursor, cheaper when nearly every node serves them; the loop checks the
  -- route either way.)
  v_rare boolean := coalesce(p_route <> all ('{chat/completions,completions,embeddings}'::text[]), false);
begin
  if p_in_region and v_rare then
    open ranked for
      select s.node_id, s.base_score, s.region, n as node from public.node_scores s
      join public.nodes n on n.id = s.node_id
      where s.policy = p_policy and s.model_id = p_model and s.region = p_region and p_route = any (n.routes)
      order by s.base_score desc, s.node_id;
  elsif p_in_region then
    open ranked for
      select s.node_id, s.base_score, s.region, n as node from public.node_scores s
      join public.nodes n on n.id = s.node_id
      where s.policy = p_policy and s.model_id = p_model and s.region = p_region
      order by s.base_score desc, s.node_id;
  elsif v_rare then
    open ranked for
      select s.node_id, s.base_score, s.region, n as node from public.node_scores s
      join public.nodes n on n.id = s.node_id
      where s.policy = p_policy and s.model_id = p_model and p_route = any (n.routes)
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
    continue when not private.node_is_eligible(r.node, p_min_vram_gb, p_fresh_after, p_max_hourly_rate, p_route);
    node_id := r.node_id;
    base_score := r.base_score;
    return next;
    found_count := found_count + 1;
    exit when found_count >= p_k;
  end loop;
  close ranked;
end;
$$;
comment on function private.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, text, boolean, double precision) is 'The first p_k eligible nodes (serving p_route, when given) for a model in base-score order (optionally only in, or only out of, a region; stopping below p_floor).';
revoke execute on function private.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, text, boolean, double precision) from public, anon, authenticated;
grant execute on function private.top_by_base(text, text, integer, double precision, timestamptz, numeric, text, text, boolean, double precision) to service_role;

drop function private.top_by_total(public.matching_policies, double precision, text, real, integer, double precision, timestamptz, numeric, real[], double precision[], text, double precision, double precision);
create function private.top_by_total(
  w public.matching_policies, p_weight double precision, p_model text, p_tier real, p_k integer,
  p_min_vram_gb double precision, p_fresh_after timestamptz, p_max_hourly_rate numeric, p_route text,
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
  v_rare boolean := coalesce(p_route <> all ('{chat/completions,completions,embeddings}'::text[]), false);  -- as in top_by_base
begin
  if v_rare then
    open ranked for
      select s.node_id, s.base_score, n as node from public.node_scores s
      join public.nodes n on n.id = s.node_id
      where s.policy = w.name and s.model_id = p_model and s.tier_gb = p_tier and p_route = any (n.routes)
      order by s.base_score desc, s.node_id;
  else
    open ranked for
      select s.node_id, s.base_score, n as node from public.node_scores s
      join public.nodes n on n.id = s.node_id
      where s.policy = w.name and s.model_id = p_model and s.tier_gb = p_tier
      order by s.base_score desc, s.node_id;
  end if;
  loop
    fetch ranked into r;
    -- The tolerance keeps a node that could tie the k-th total (ties go by node id).
    exit when not found
      or (cardinality(v_top) >= p_k and r.base_score + v_bonus_max < v_top[p_k] - 1e-12);
    continue when not private.node_is_eligible(r.node, p_min_vram_gb, p_fresh_after, p_max_hourly_rate, p_route);
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
comment on function private.top_by_total(public.matching_policies, double precision, text, real, integer, double precision, timestamptz, numeric, text, real[], double precision[], text, double precision, double precision) is 'Candidates that contain the top p_k nodes (serving p_route, when given) of one VRAM tier by total score (base plus reserve and proximity), walking the tier''s base-score index only as far as a later node could still rank.';
revoke execute on function private.top_by_total(public.matching_policies, double precision, text, real, integer, double precision, timestamptz, numeric, text, real[], double precision[], text, double precision, double precision) from public, anon, authenticated, service_role;

-- score_nodes() with the route ------------------------------------------------------------------------

-- A trailing parameter with a default: every call written for the nine parameters means the same.
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
comment on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) is 'Ranks the nodes that can serve p_model under a policy (seed or a row of matching_policies), best first, with each score component (reserve: how little it takes from requests needing more VRAM, under current demand); with p_route (the path after /v1/), only nodes serving that route; with p_explain, also lists every rejected node and why.';
revoke execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) from public, anon;
grant execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) to authenticated, service_role;

-- Why nothing was placed, with the route --------------------------------------------------------------

drop function private.capacity_state(text, real, numeric);
create function private.capacity_state(p_model text, p_min_vram_gb real, p_max_hourly_rate numeric, p_route text)
returns text
language sql stable
set search_path = ''
as $$
  -- Nodes that hold the model and pass every filter but a free slot and the route; then, among the
  -- ones serving the route, what a request may wait for.
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
  cross join public.platform_settings s
  cross join lateral (select p_route is null or p_route = any (n.routes) as serves) c
  where nm.model_id = p_model
    and n.status in ('online', 'busy')
    and n.vram_gb >= private.required_vram_gb(p_model, p_min_vram_gb)
    and (p_max_hourly_rate is null or n.hourly_rate <= p_max_hourly_rate)
    and n.last_heartbeat_at >= now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
$$;
comment on function private.capacity_state(text, real, numeric, text) is 'Why no node took a request for a model: ''busy'' (capable nodes serving the route online, every slot taken), ''cooling'' (those with free slots are all cooling down after failures), ''route'' (capable nodes online, none serving p_route) or ''none'' (no capable node online).';
revoke execute on function private.capacity_state(text, real, numeric, text) from public, anon, authenticated;
grant execute on function private.capacity_state(text, real, numeric, text) to service_role;

drop function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean);
create function private.place(
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
  p_reserve_usd numeric,
  p_wait boolean,
  p_route text
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text,
  busy boolean,
  tokens_per_s real[],
  refusal text
)
language plpgsql
set search_path = ''
as $$
declare
  v_min real := private.required_vram_gb(p_model, p_min_vram_gb);
  v_ranked uuid[];
  v_fallbacks uuid[];
  v_node public.nodes;
  v_job uuid;
  v_error text;
  v_state text;
  v_held numeric := 0;
  v_budgeted boolean;
begin
  if p_fallbacks < 0 then
    raise exception 'fallbacks must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if p_reserve_usd < 0 then
    raise exception 'a reservation must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if p_route is not null and not p_route = any (
    '{chat/completions,completions,embeddings,responses,rerank,score,audio/transcriptions,audio/translations,audio/speech}'::text[]) then
    raise exception 'unknown route "%"', p_route using errcode = 'invalid_parameter_value';
  end if;
  -- The best few are enough: a claim skips only nodes filled or locked since scoring.
  select array_agg(s.node_id order by s.rank) into v_ranked
  from public.score_nodes(p_model, p_min_vram_gb, p_policy, p_region, p_latitude, p_longitude,
                          p_max_hourly_rate, false, greatest(32, 4 * (p_fallbacks + 1)), p_route) s;

  select * into v_node from private.claim_node(coalesce(v_ranked, '{}'));

  if v_node.id is null then
    v_state := private.capacity_state(p_model, p_min_vram_gb, p_max_hourly_rate, p_route);
    if p_wait and v_state in ('busy', 'cooling') then
      -- Nothing recorded: the caller waits for a slot and asks again.
      return query select null::uuid, null::uuid, null::text, null::bytea, 0, '{}'::uuid[],
        null::text, true, '{}'::real[], v_state;
      return;
    end if;
    v_error := case v_state
      when 'none' then format('no capable node is online for %s', p_model)
      when 'route' then format('no online node serves /v1/%s for %s', p_route, p_model)
      when 'cooling' then format('every capable node for %s is cooling down after failures', p_model)
      else format('every capable node for %s is busy: all their slots are taken', p_model) end;
  end if;

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

  v_fallbacks := array(select x from unnest(v_ranked) with ordinality as r (x, ord)
                       where x is distinct from v_node.id order by ord limit p_fallbacks);
  return query select v_job, v_node.id, v_node.endpoint_url, v_node.secret_hash,
    case when v_node.id is null then 0 else 1 end, v_fallbacks, v_error, false,
    -- How fast each has answered (for the gateway's timeouts; null until measured).
    case when v_node.id is null then '{}'::real[] else array(
      select n.ewma_tokens_per_s
      from unnest(v_node.id || v_fallbacks) with ordinality as c (id, ord)
      join public.nodes n on n.id = c.id
      order by c.ord) end,
    v_state;
end;
$$;
comment on function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean, text) is 'match_job()''s body: holds p_reserve_usd against the key''s budget (NG402 when spent), scores the nodes serving p_route (null: any), claims a slot on the best one, records the job and its first attempt, and returns the node and an ordered fallback list. When no node is free: with p_wait and capable nodes busy (or cooling down), nothing is recorded and busy is true; otherwise the job is recorded as failed with the reason. refusal says which it was when no node was claimed: none (no capable node online), route (none serving p_route), busy or cooling. tokens_per_s: the node''s and each fallback''s measured decode speed (null until measured), in the same order.';
revoke execute on function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean, text) from public, anon, authenticated;
grant execute on function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean, text) to service_role;

-- match_job() with the hold in USD: any route, as before.
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
language sql
set search_path = ''
as $$
  select p.job_id, p.node_id, p.endpoint_url, p.node_key, p.attempt, p.fallback_ids, p.error
  from private.place(p_model, p_api_key_id, p_policy, p_min_vram_gb, p_region, p_latitude, p_longitude,
                     p_max_hourly_rate, p_stream, p_fallbacks, p_reserve_usd, false, null) p
$$;

-- place_job() with the route: the gateway's call from now on.
create function public.place_job(
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
  p_max_output_tokens integer,
  p_wait boolean,
  p_route text
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text,
  max_output_tokens integer,
  busy boolean,
  tokens_per_s real[],
  refusal text
)
language plpgsql
set search_path = ''
as $$
declare
  v_cap integer := p_max_output_tokens;
  v_left numeric;
  v_input_price numeric;
  v_output_price numeric;
begin
  if p_prompt_bytes is null or p_max_output_tokens is null or p_prompt_bytes < 0 or p_max_output_tokens < 0 then
    raise exception 'prompt_bytes and max_output_tokens must be given and must not be negative'
      using errcode = 'invalid_parameter_value';
  end if;
  select k.budget_usd - k.spent_usd - k.reserved_usd into v_left
  from public.api_keys k where k.id = p_api_key_id and k.budget_usd is not null;
  select m.input_usd_per_mtok, m.output_usd_per_mtok into v_input_price, v_output_price
  from public.models m where m.id = p_model;
  if v_left is not null and coalesce(v_output_price, 0) > 0 then
    -- Read without a lock: the hold below is checked again, atomically, when it is taken.
    v_cap := least(p_max_output_tokens::bigint, floor(greatest(
      v_left - p_prompt_bytes / 4.0 * coalesce(v_input_price, 0) / 1e6, 0) * 1e6 / v_output_price)::bigint);
    if v_cap < least(p_max_output_tokens, 1) then
      raise exception 'the budget left on this API key ($%) cannot pay for this request''s prompt and one token of answer',
        round(greatest(v_left, 0), 6) using errcode = 'NG402';
    end if;
  end if;
  return query
  select p.job_id, p.node_id, p.endpoint_url, p.node_key, p.attempt, p.fallback_ids, p.error, v_cap, p.busy,
    p.tokens_per_s, p.refusal
  from private.place(p_model, p_api_key_id, p_policy, p_min_vram_gb, p_region, p_latitude, p_longitude,
                     p_max_hourly_rate, p_stream, p_fallbacks,
                     private.budget_hold(p_model, p_prompt_bytes, v_cap), p_wait, p_route) p;
end;
$$;
comment on function public.place_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer, boolean, text) is 'The gateway''s match_job() for one route (p_route, the path after /v1/: chat/completions, responses, rerank, ...; null: any): only nodes serving it are scored. The budget hold priced in SQL from p_prompt_bytes (about four bytes a token) and up to p_max_output_tokens of answer at the catalog''s prices, the answer capped at what the key''s remaining budget pays for (max_output_tokens; NG402 when not one token). With p_wait, a request that finds every capable node busy is not recorded: busy is true, and the gateway asks again when a slot frees (LISTEN neuralgrid_slots). tokens_per_s: the measured decode speed of the node and of each fallback, in order. refusal, when no node was claimed: none, route (capable nodes online but none serving p_route), busy or cooling.';
revoke execute on function public.place_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer, boolean, text) from public, anon, authenticated;
grant execute on function public.place_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer, boolean, text) to service_role;

-- The earlier place_job(): any route, its answers as before.
create or replace function public.place_job(
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
  p_max_output_tokens integer,
  p_wait boolean
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text,
  max_output_tokens integer,
  busy boolean,
  tokens_per_s real[]
)
language sql
set search_path = ''
as $$
  select p.job_id, p.node_id, p.endpoint_url, p.node_key, p.attempt, p.fallback_ids, p.error,
    p.max_output_tokens, p.busy, p.tokens_per_s
  from public.place_job(p_model, p_api_key_id, p_policy, p_min_vram_gb, p_region, p_latitude, p_longitude,
                        p_max_hourly_rate, p_stream, p_fallbacks, p_prompt_bytes, p_max_output_tokens, p_wait,
                        null) p
$$;
comment on function public.place_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer, boolean) is 'place_job() for any route (gateways before routes): the overload with p_route, asked for none.';
