-- Issue 43: matching under scarcity keeps the big nodes for what only they can serve.
--
-- 1. The reserve sees all of the demand. A gateway reports, with its check-in (gateway_alive(),
--    every 2 s), how many requests wait in its lines per model; refresh_vram_pressure() counts them
--    at their level as it counts running jobs, for as long as the gateway is live
--    (platform_settings.gateway_timeout_s). In a burst the line is where the demand is.
-- 2. Scarcity as a rule, not only a weight. Under a policy that weighs the reserve, when a VRAM
--    level above a request's need is under pressure of at least platform_settings.reserve_threshold
--    and smaller online nodes could hold the request, the nodes that have that level are kept for
--    bigger jobs (private.kept_level()): place() leaves them out while the request may still wait in
--    the gateway's line, and ranks them after every other node when it may not. So a
--    small job takes a kept node only at its deadline, when no smaller node took it within it (the
--    gateway's last ask, p_wait false), or when it cannot wait at all. The simulator measured the
--    default (neuralgrid simulate; docs/matching.md).

alter table public.platform_settings
  add column reserve_threshold double precision not null default 0.2,
  add constraint "reserve_threshold must be positive" check (reserve_threshold > 0);

comment on column public.platform_settings.reserve_threshold is
  'Pressure (private.vram_pressure, 0 to 1) at which a VRAM level''s nodes are kept for the jobs that need it: a smaller job takes one only when no smaller node took it before its deadline (above 1: never kept).';

alter table private.gateways
  add column waiting jsonb not null default '{}',
  add constraint "waiting must be an object of counts" check (jsonb_typeof(waiting) = 'object');

comment on column private.gateways.waiting is
  'Requests waiting in the gateway''s lines at its last check-in, per model ({"model": count}): demand the sweep counts toward each VRAM level''s pressure while the gateway is live.';

create function public.gateway_alive(p_gateway_id uuid, p_internal_url text, p_waiting jsonb)
returns void
language sql
set search_path = ''
as $$
  insert into private.gateways as g (id, internal_url, waiting)
  values (p_gateway_id, p_internal_url, coalesce(p_waiting, '{}'))
  on conflict (id) do update
  set seen_at = now(), internal_url = excluded.internal_url, waiting = excluded.waiting;
$$;

comment on function public.gateway_alive(p_gateway_id uuid, p_internal_url text, p_waiting jsonb) is
  'A gateway checks in (every couple of seconds), says where the other gateways reach it (null: nowhere), and how many requests wait in its lines per model ({"model": count}): the jobs it placed stay its own, the tunnels it holds reachable through it, and its waiting requests count toward the VRAM pressure, while it does.';

revoke all on function public.gateway_alive(p_gateway_id uuid, p_internal_url text, p_waiting jsonb) from public, anon, authenticated;
grant execute on function public.gateway_alive(p_gateway_id uuid, p_internal_url text, p_waiting jsonb) to service_role;

create function private.kept_level(p_need_gb double precision)
returns real
language sql
stable
set search_path = ''
as $$
  -- The smallest level above the need under enough pressure, of those that some online node below
  -- them could still serve the request from (fewer slots reach the level than reach the request's
  -- own level: a job every node's size must serve keeps nothing from anyone).
  select min(p.level_gb)
  from private.vram_pressure p
  cross join public.platform_settings s
  where p.level_gb > p_need_gb and p.pressure >= s.reserve_threshold
    and p.slots < coalesce(
      (select o.slots from private.vram_pressure o where o.level_gb <= p_need_gb order by o.level_gb desc limit 1),
      (select max(o.slots) from private.vram_pressure o))
$$;

comment on function private.kept_level(p_need_gb double precision) is
  'The scarcity rule for a request needing p_need_gb: the smallest VRAM level above it whose pressure is at least platform_settings.reserve_threshold and that smaller online nodes do not all reach; nodes with that much VRAM are kept for bigger jobs. Null when none is.';

revoke all on function private.kept_level(p_need_gb double precision) from public;
grant execute on function private.kept_level(p_need_gb double precision) to service_role;

create function private.kept_last(p_ranked uuid[], p_kept real, p_wait boolean)
returns uuid[]
language sql
stable
set search_path = ''
as $$
  select coalesce(array_agg(r.id order by coalesce(n.vram_gb >= p_kept, false), r.ord)
                    filter (where not (p_wait and coalesce(n.vram_gb >= p_kept, false))), '{}')
  from unnest(p_ranked) with ordinality as r (id, ord)
  join public.nodes n on n.id = r.id
$$;

comment on function private.kept_last(p_ranked uuid[], p_kept real, p_wait boolean) is
  'A ranking under the scarcity rule: the nodes with at least p_kept GB of VRAM (kept for bigger jobs) left out while the request may wait (p_wait), else moved after every other node, each part in its order.';

revoke all on function private.kept_last(p_ranked uuid[], p_kept real, p_wait boolean) from public;
grant execute on function private.kept_last(p_ranked uuid[], p_kept real, p_wait boolean) to service_role;

create or replace function private.refresh_vram_pressure() RETURNS void
    LANGUAGE sql
    SET search_path TO ''
    AS $$
  with levels as (
    select distinct m.min_vram_gb as level_gb from public.models m
  ),
  -- Each running job at its level: the biggest level it needs at least (the smallest, for a job
  -- needing less than any).
  running as materialized (
    select coalesce((select max(l.level_gb) from levels l where l.level_gb <= j.min_vram_gb),
                    (select min(l.level_gb) from levels l)) as level_gb
    from public.jobs j
    where j.id = any (array(select a.job_id from public.job_attempts a where a.status = 'running')) and j.status = 'running'
  ),
  -- Requests waiting in the lines of live gateways (their last check-in, gateway_alive()), each at
  -- its model's level, counted as running jobs are: in a burst the line is where the demand is.
  waiting as materialized (
    select coalesce((select max(l.level_gb) from levels l where l.level_gb <= m.min_vram_gb),
                    (select min(l.level_gb) from levels l)) as level_gb,
           sum(w.requests) as requests
    from private.gateways g
    cross join public.platform_settings st
    cross join lateral jsonb_each_text(g.waiting) as e (model_id, value)
    cross join lateral (select e.value::integer as requests) w
    join public.models m on m.id = e.model_id
    where g.seen_at >= now() - make_interval(secs => st.gateway_timeout_s) and w.requests > 0
    group by 1
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
           (select count(*) from running r where r.level_gb = l.level_gb)::float8
             + coalesce((select w.requests from waiting w where w.level_gb = l.level_gb), 0)::float8 as busy_now,
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


create or replace function private.place(p_model text, p_api_key_id uuid, p_policy text, p_min_vram_gb real, p_region text, p_latitude double precision, p_longitude double precision, p_max_hourly_rate numeric, p_stream boolean, p_fallbacks integer, p_reserve_usd numeric, p_wait boolean, p_route text, p_ranked uuid[] DEFAULT NULL::uuid[]) RETURNS TABLE(job_id uuid, node_id uuid, endpoint_url text, node_key bytea, attempt integer, fallback_ids uuid[], error text, busy boolean, tokens_per_s real[], refusal text, reranked boolean)
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
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
  v_reranked boolean := false;
  v_kept real;  -- the scarcity rule: nodes with this much VRAM are kept for bigger jobs (null: none)
  v_all uuid[];
begin
  if p_fallbacks < 0 then
    raise exception 'fallbacks must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if p_reserve_usd < 0 then
    raise exception 'a reservation must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if p_route is not null and not p_route = any (
    '{chat/completions,completions,completions+echo,embeddings,responses,rerank,score,audio/transcriptions,audio/translations,audio/speech}'::text[]) then
    raise exception 'unknown route "%"', p_route using errcode = 'invalid_parameter_value';
  end if;
  -- A ranking handed in (place_jobs(): the one of the request before, moved on by its claim) is
  -- tried first; when it has no free node left, nodes it left out may rank now: ranked afresh. An
  -- empty one is a ranking too: nothing was eligible, and the group has freed nothing since.
  -- Under a policy that weighs the reserve, the nodes kept for bigger jobs (private.kept_level())
  -- take none while the request may still wait for a smaller one (p_wait); at its deadline (the
  -- gateway's last ask, p_wait false) they come after every other node.
  select private.kept_level(v_min) into v_kept
  from public.matching_policies w where w.name = p_policy and w.reserve > 0;
  if p_ranked is not null then
    v_ranked := case when v_kept is null then p_ranked else private.kept_last(p_ranked, v_kept, p_wait) end;
    select * into v_node from private.claim_node(v_ranked);
  end if;
  if v_node.id is null and coalesce(cardinality(p_ranked), 1) > 0 then
    -- The best few are enough: a claim skips only nodes filled or locked since scoring.
    select array_agg(s.node_id order by s.rank) into v_ranked
    from public.score_nodes(p_model, p_min_vram_gb, p_policy, p_region, p_latitude, p_longitude,
                            p_max_hourly_rate, false, private.ranking_limit(p_fallbacks), p_route) s;
    if v_kept is not null then
      v_all := v_ranked;
      v_ranked := private.kept_last(v_all, v_kept, p_wait);
      if cardinality(v_ranked) = 0 and cardinality(v_all) >= private.ranking_limit(p_fallbacks) then
        -- The best few were all kept: the nodes beyond them may not be.
        select array_agg(s.node_id order by s.rank) into v_all
        from public.score_nodes(p_model, p_min_vram_gb, p_policy, p_region, p_latitude, p_longitude,
                                p_max_hourly_rate, false, null, p_route) s;
        v_ranked := private.kept_last(v_all, v_kept, p_wait);
      end if;
    end if;
    v_reranked := p_ranked is not null;
    select * into v_node from private.claim_node(coalesce(v_ranked, '{}'));
  end if;

  if v_node.id is null then
    v_state := private.capacity_state(p_model, p_min_vram_gb, p_max_hourly_rate, p_route);
    if p_wait and v_state in ('busy', 'cooling') then
      -- Nothing recorded: the caller waits for a slot and asks again.
      return query select null::uuid, null::uuid, null::text, null::bytea, 0, '{}'::uuid[],
        null::text, true, '{}'::real[], v_state, v_reranked;
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
    v_state, v_reranked;
end;
$$;


comment on function private.place(p_model text, p_api_key_id uuid, p_policy text, p_min_vram_gb real, p_region text, p_latitude double precision, p_longitude double precision, p_max_hourly_rate numeric, p_stream boolean, p_fallbacks integer, p_reserve_usd numeric, p_wait boolean, p_route text, p_ranked uuid[]) is
  'match_job()''s body: holds p_reserve_usd against the key''s budget (NG402 when spent), scores the nodes serving p_route (null: any), claims a slot on the best one, records the job and its first attempt, and returns the node and an ordered fallback list. Under a policy that weighs the reserve, the nodes kept for bigger jobs (private.kept_level()) are left out with p_wait (the request waits for a smaller one) and come last without it. When no node is free: with p_wait and capable nodes busy (or cooling down, or kept), nothing is recorded and busy is true; otherwise the job is recorded as failed with the reason. refusal says which it was when no node was claimed: none (no capable node online), route (none serving p_route), busy or cooling. tokens_per_s: the node''s and each fallback''s measured decode speed (null until measured), in the same order. p_ranked (place_jobs()): a ranking to claim from first, ranked afresh if it has no free node (reranked says so).';
