-- A gateway's lease renewals and its journal's writes are ordered in Postgres, not in the gateway
-- (issue 42: cold, at most 1 RTT). The two meet on the rows of the gateway's own jobs (a job SQL
-- placed, its end being written: a renewal moves its slot into the lease), so the gateway had sent
-- them one at a time; a far gateway's job ends then waited behind each renewal a whole round trip
-- (243 ms after the answer, median, at 200 ms), their slots held that long. Now renew_leases() and
-- record_jobs() each take the gateway's advisory lock first: both travel at once and Postgres runs
-- them one after the other, each seeing what the other committed.

CREATE OR REPLACE FUNCTION public.renew_leases(p_gateway uuid, p_lanes jsonb) RETURNS TABLE(model_id text, policy text, region text, node_id uuid, endpoint_url text, node_key bytea, slots integer, in_use integer, rank integer, tokens_per_s real, routes text[], expires_at timestamp with time zone, hourly_rate numeric, absorbed uuid[], draining integer, share integer)
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_lane jsonb;
  v_n integer;
  v_model text;
  v_policy text;
  v_region text;
  v_want numeric;
  v_need numeric;
  v_in_use jsonb;
  v_used record;
  v_lanes jsonb := '[]';  -- the lanes as read: [{model, policy, region, want, in_use}]
  v_absorbed uuid[] := '{}';  -- its jobs SQL placed whose slots joined its leases
  v_lock bigint;
  v_expires_at timestamptz;
  r record;
  -- A node id: 36 characters of this shape.
  uuid_shape constant text := '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}';
begin
  if p_gateway is null then
    raise exception 'renew_leases needs the gateway''s id' using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_typeof(p_lanes) is distinct from 'array' then
    raise exception 'renew_leases takes a JSON array of lanes' using errcode = 'invalid_parameter_value';
  end if;
  -- The gateway's renewals and journal writes, one at a time, ordered here rather than in the
  -- gateway: they meet on the rows of its own jobs, and each must see what the other committed.
  perform pg_advisory_xact_lock(hashtextextended('gateway' || E'\n' || p_gateway::text, 4242));
  -- Read and check every lane before anything changes.
  for v_lane, v_n in select x.lane, x.n::integer from jsonb_array_elements(p_lanes) with ordinality as x (lane, n) loop
    if jsonb_typeof(v_lane) is distinct from 'object' then
      raise exception 'lane %: a lane is a JSON object', v_n using errcode = 'invalid_parameter_value';
    end if;
    if jsonb_typeof(v_lane -> 'model') is distinct from 'string' then
      raise exception 'lane %: "model" must be a string', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_model := v_lane ->> 'model';
    if not exists (select from public.models m where m.id = v_model)
       and not exists (select from public.node_models nm where nm.model_id = v_model) then
      raise exception 'lane %: unknown model "%": not in the catalog and held by no node', v_n, v_model
        using errcode = 'invalid_parameter_value';
    end if;
    if coalesce(jsonb_typeof(v_lane -> 'policy'), 'null') not in ('null', 'string') then
      raise exception 'lane %: "policy" must be a string', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_policy := coalesce(v_lane ->> 'policy', 'balanced');
    if v_policy <> 'seed' and not exists (select from public.matching_policies w where w.name = v_policy) then
      raise exception 'lane %: unknown matching policy "%"', v_n, v_policy using errcode = 'invalid_parameter_value';
    end if;
    if coalesce(jsonb_typeof(v_lane -> 'region'), 'null') not in ('null', 'string') then
      raise exception 'lane %: "region" must be a string or null', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_region := coalesce(v_lane ->> 'region', '');
    if jsonb_typeof(v_lane -> 'want') is distinct from 'number' then
      raise exception 'lane %: "want" must be a number of slots', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_want := (v_lane -> 'want')::numeric;
    if v_want < 0 or v_want <> trunc(v_want) or v_want > 1000000 then
      raise exception 'lane %: "want" must be a whole number of slots from 0 to 1000000, not %', v_n, v_want
        using errcode = 'invalid_parameter_value';
    end if;
    if coalesce(jsonb_typeof(v_lane -> 'need'), 'null') not in ('null', 'number') then
      raise exception 'lane %: "need" must be a number of slots', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_need := coalesce((v_lane -> 'need')::numeric, v_want);  -- a gateway that says no need needs all it wants
    if v_need < 0 or v_need <> trunc(v_need) or v_need > v_want then
      raise exception 'lane %: "need" must be a whole number of slots from 0 to "want" (%), not %', v_n, v_want, v_need
        using errcode = 'invalid_parameter_value';
    end if;
    v_in_use := coalesce(nullif(v_lane -> 'in_use', 'null'), '{}');
    if jsonb_typeof(v_in_use) <> 'object' then
      raise exception 'lane %: "in_use" must be an object of counts by node id', v_n using errcode = 'invalid_parameter_value';
    end if;
    for v_used in select u.key, u.value from jsonb_each(v_in_use) u loop
      if length(v_used.key) <> 36 or v_used.key !~ uuid_shape then
        raise exception 'lane %: "in_use" names "%", which is not a node id', v_n, v_used.key
          using errcode = 'invalid_parameter_value';
      end if;
      if (case when jsonb_typeof(v_used.value) = 'number'
               then (v_used.value)::numeric < 0 or (v_used.value)::numeric <> trunc((v_used.value)::numeric)
                    or (v_used.value)::numeric > 1000000
               else true end) then
        raise exception 'lane %: slots in use on node % must be a whole number from 0, not %', v_n, v_used.key, v_used.value
          using errcode = 'invalid_parameter_value';
      end if;
    end loop;
    if exists (select from jsonb_array_elements(v_lanes) l
               where l ->> 'model' = v_model and l ->> 'policy' = v_policy and l ->> 'region' = v_region) then
      raise exception 'lane %: the lane (%, %, "%") is named twice', v_n, v_model, v_policy, v_region
        using errcode = 'invalid_parameter_value';
    end if;
    v_lanes := v_lanes || jsonb_build_object('model', v_model, 'policy', v_policy, 'region', v_region,
                                             'want', v_want::integer, 'need', v_need::integer, 'in_use', v_in_use,
                                             'reported', true);
  end loop;

  -- A renewal is a check-in.
  insert into private.gateways as g (id) values (p_gateway) on conflict (id) do update set seen_at = now();
  v_expires_at := now() + (select make_interval(secs => s.lease_s) from public.platform_settings s);

  -- The lanes it no longer reports but still holds or wanted: nothing wanted, nothing in use.
  select v_lanes || coalesce(jsonb_agg(jsonb_build_object('model', o.model_id, 'policy', o.policy,
                                                          'region', o.region, 'want', 0, 'need', 0, 'in_use', '{}'::jsonb,
                                                          'reported', false)), '[]')
    into v_lanes
  from (select l.model_id, l.policy, l.region from private.slot_leases l where l.gateway_id = p_gateway
        union
        select d.model_id, d.policy, d.region from private.lane_demand d where d.gateway_id = p_gateway) o
  where not exists (select from jsonb_array_elements(v_lanes) x
                    where x ->> 'model' = o.model_id and x ->> 'policy' = o.policy and x ->> 'region' = o.region);

  -- One renewal of a lane at a time, whichever gateway's: locks taken in one order, so no two
  -- renewals wait on each other in a circle.
  for v_lock in
    select distinct hashtextextended(x ->> 'model' || E'\n' || (x ->> 'policy') || E'\n' || (x ->> 'region'), 4242)
    from jsonb_array_elements(v_lanes) x
    order by 1
  loop
    perform pg_advisory_xact_lock(v_lock);
  end loop;
  perform from private.slot_leases l where l.gateway_id = p_gateway
  order by l.node_id, l.model_id, l.policy, l.region for no key update;

  -- What it wants and needs of each lane, for the shares, before any lane is renewed: a lane sees
  -- what the gateway's other lanes need now (a lane it no longer reports wants nothing).
  insert into private.lane_demand as d (gateway_id, model_id, policy, region, wanted, needed, renewed_at)
  select p_gateway, x ->> 'model', x ->> 'policy', x ->> 'region', (x ->> 'want')::integer, (x ->> 'need')::integer, now()
  from jsonb_array_elements(v_lanes) x
  where (x ->> 'reported')::boolean
  on conflict on constraint lane_demand_pkey
  do update set wanted = excluded.wanted, needed = excluded.needed, renewed_at = excluded.renewed_at;
  delete from private.lane_demand d
  where d.gateway_id = p_gateway
    and exists (select from jsonb_array_elements(v_lanes) x
                where not (x ->> 'reported')::boolean and x ->> 'model' = d.model_id and x ->> 'policy' = d.policy
                  and x ->> 'region' = d.region);

  -- What is in use on every lease of it, before any lane is renewed: a lane's spares are judged by
  -- what the gateway's other lanes use now, not at its last renewal.
  update private.slot_leases l
  set in_use = least(coalesce((x -> 'in_use' ->> l.node_id::text)::integer, 0), l.slots)
  from jsonb_array_elements(v_lanes) x
  where l.gateway_id = p_gateway and l.model_id = x ->> 'model' and l.policy = x ->> 'policy'
    and l.region = x ->> 'region'
    and l.in_use is distinct from least(coalesce((x -> 'in_use' ->> l.node_id::text)::integer, 0), l.slots);

  -- The lanes that need least first: what one gives back, a lane renewed after it may claim in the
  -- same call (one renewed before it claims at the next).
  for r in
    select x ->> 'model' as model, x ->> 'policy' as policy, x ->> 'region' as region,
           (x ->> 'want')::integer as want, (x ->> 'need')::integer as need, x -> 'in_use' as in_use, (x ->> 'reported')::boolean as reported
    from jsonb_array_elements(v_lanes) x
    order by 5, 1, 2, 3
  loop
    v_absorbed := v_absorbed
                  || private.renew_lane(p_gateway, r.model, r.policy, r.region, r.want, r.need, r.in_use, r.reported,
                                        v_expires_at);
  end loop;

  -- Every lease it may dispatch on, ranked per lane: by the node's score now, or for a node the
  -- ranking leaves out (full, because leased), by its score when last ranked. After them, with no
  -- slot, the lane's best ranked nodes it holds none on: where a job moves (failover_job()) when its
  -- leased node fails and the gateway holds no other slot for it.
  return query
  with held as (
    select l.model_id, l.policy, l.region, l.node_id, n.endpoint_url, n.secret_hash, l.slots - l.draining as slots,
           l.in_use, l.score, n.ewma_tokens_per_s, n.routes, l.expires_at, n.hourly_rate,
           array(select j.id from public.jobs j
                 join public.job_attempts a on a.job_id = j.id and a.status = 'running'
                 where j.id = any (v_absorbed) and a.node_id = l.node_id and j.model_id = l.model_id
                   and j.policy = l.policy and coalesce(j.region, '') = l.region) as absorbed,
           l.draining
    from private.slot_leases l
    join public.nodes n on n.id = l.node_id
    where l.gateway_id = p_gateway and l.slots > 0
      and (l.model_id, l.node_id) in (
        select m.model_id, u.id
        from (select distinct o.model_id from private.slot_leases o where o.gateway_id = p_gateway) m
        cross join lateral private.lease_usable_nodes(m.model_id, array(
          select o.node_id from private.slot_leases o where o.gateway_id = p_gateway and o.model_id = m.model_id)) u (id))
  ),
  fallbacks as (
    select x ->> 'model' as model_id, x ->> 'policy' as policy, x ->> 'region' as region, s.node_id,
           n.endpoint_url, n.secret_hash, 0 as slots, 0 as in_use, null::float8 as score,
           n.ewma_tokens_per_s, n.routes, v_expires_at as expires_at, n.hourly_rate, null::uuid[] as absorbed, 0 as draining, s.rank
    from jsonb_array_elements(v_lanes) x
    cross join lateral public.score_nodes(x ->> 'model', null, x ->> 'policy', nullif(x ->> 'region', ''), null, null,
                                          null, false, private.ranking_limit(0), null) s
    join public.nodes n on n.id = s.node_id
    where (x ->> 'reported')::boolean
      and not exists (select from held h where h.model_id = x ->> 'model' and h.policy = x ->> 'policy'
                                            and h.region = x ->> 'region' and h.node_id = s.node_id)
  )
  select u.model_id, u.policy, u.region, u.node_id, u.endpoint_url, u.secret_hash, u.slots, u.in_use,
         (row_number() over (partition by u.model_id, u.policy, u.region
                             order by u.fallback, u.score desc nulls last, u.rank, u.node_id))::integer,
         u.ewma_tokens_per_s, u.routes, u.expires_at, u.hourly_rate, u.absorbed, u.draining,
         (select d.share from private.lane_demand d
          where d.gateway_id = p_gateway and d.model_id = u.model_id and d.policy = u.policy and d.region = u.region)
  from (select h.*, false as fallback, null::bigint as rank from held h
        union all
        select f.model_id, f.policy, f.region, f.node_id, f.endpoint_url, f.secret_hash, f.slots, f.in_use,
               f.score, f.ewma_tokens_per_s, f.routes, f.expires_at, f.hourly_rate, f.absorbed, f.draining, true,
               f.rank
        from fallbacks f) u
  order by u.model_id, u.policy, u.region, 9;
end;
$$;

COMMENT ON FUNCTION public.renew_leases(p_gateway uuid, p_lanes jsonb) IS 'A gateway''s renewal of its slot leases, once a second, which also checks it in. One at a time with the gateway''s record_jobs() (an advisory lock per gateway). p_lanes: a JSON array of lanes, [{"model": m, "policy": p (default balanced), "region": r (null or absent: none), "want": slots wanted, "need": of them, slots needed (absent: all), "in_use": {node id: slots in use}}]. For each lane it records the demand, sets what is in use, gives back idle slots above the gateway''s fair share (private.lane_target()) from the lowest ranked node and claims free ones toward it from the best ranked (score_nodes()), as claims do (nodes.inflight, never past max_concurrency), those above the need (spares) one a node, only where the node keeps a slot free and the gateway holds no idle slot there already; a lane it leased in and no longer names is given back whole but for slots in use. Returns every lease it may dispatch on (node online or busy, not cooling down, beating, holding the model) with the slots it may use (those held less those draining above its share; draining: how many drain), with where and how to reach the node and its hourly rate (a request''s price cap filters the leases, in their order), its rank in the lane (1: best), the lease''s end (now + platform_settings.lease_s) the ids of the gateway''s running jobs SQL had placed whose slots this renewal moved into the lease (absorbed: the gateway counts them in use there until they end) and the gateway''s share of the lane''s slots (share: holding it, the gateway places none of the lane''s requests in SQL); then, with 0 slots and ranked after them, the lane''s best ranked nodes (score_nodes()) it holds no lease on: a failed leased job''s fallbacks. Bad input raises invalid_parameter_value and changes nothing.';

CREATE OR REPLACE FUNCTION public.record_jobs(p_gateway uuid, p_jobs jsonb) RETURNS TABLE(job_id uuid, cost_usd numeric, recorded text)
    LANGUAGE plpgsql
    SET search_path TO ''
    SET plan_cache_mode TO 'force_generic_plan'
    AS $_$
declare
  v_uuid constant text := '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$';
  v_time constant text := '^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)?$';
  v_usd constant text := '^\d{1,8}(\.\d{1,20})?([eE][-+]?\d{1,2})?$';  -- also as Python's str(Decimal) writes it
  v_bad record;
  v_n integer;
  v_ids uuid[];
  v_keys uuid[];
  v_models text[];
  v_policies text[];
  v_regions text[];
  v_streams boolean[];
  v_nodes uuid[];
  v_starts timestamptz[];
  v_holds numeric[];
  v_users text[];
  v_ends jsonb[];
  v_new uuid[];  -- the jobs this call records
  v_fresh uuid[];  -- those of them it records ended (start and end together)
  v_stale uuid[];  -- jobs it found new that a call beside it recorded first
  v_ending uuid[];  -- the jobs whose end this call writes
  v_costs jsonb;  -- {job id: cost} of the jobs it ended
  v_end_ids uuid[];  -- the ends to write, by job id, as complete_jobs() takes them
  v_statuses text[];
  v_prompts integer[];
  v_completions integer[];
  v_ttfts real[];
  v_latencies real[];
  v_errors text[];
  v_at integer;
begin
  if p_gateway is null then
    raise exception 'record_jobs needs the gateway''s id' using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_typeof(p_jobs) is distinct from 'array' then
    raise exception 'record_jobs takes a JSON array of job records' using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_array_length(p_jobs) > 1000 then
    raise exception 'record_jobs takes at most 1000 records, not %', jsonb_array_length(p_jobs)
      using errcode = 'invalid_parameter_value';
  end if;
  -- The gateway's renewals and journal writes, one at a time, ordered here rather than in the
  -- gateway: they meet on the rows of its own jobs, and each must see what the other committed.
  perform pg_advisory_xact_lock(hashtextextended('gateway' || E'\n' || p_gateway::text, 4242));

  -- Each record's first fault, if any: the call is refused naming the first record at fault.
  select x.n, x.e ->> 'id' as id, x.fault into v_bad
  from (
    select j.n, j.e, case
      when jsonb_typeof(j.e) is distinct from 'object' then 'a job record is a JSON object'
      when jsonb_typeof(j.e -> 'id') is distinct from 'string' or length(j.e ->> 'id') <> 36 or j.e ->> 'id' !~ v_uuid
        then '"id" must be the job''s id (a UUID)'
      when coalesce(jsonb_typeof(j.e -> 'key'), 'null') not in ('null', 'string')
           or length(j.e ->> 'key') <> 36 or j.e ->> 'key' !~ v_uuid
        then '"key" must be an API key''s id (a UUID) or null'
      when jsonb_typeof(j.e -> 'model') is distinct from 'string' then '"model" must be a string'
      when jsonb_typeof(j.e -> 'policy') is distinct from 'string' then '"policy" must be a string'
      when coalesce(jsonb_typeof(j.e -> 'region'), 'null') not in ('null', 'string') then '"region" must be a string or null'
      when coalesce(jsonb_typeof(j.e -> 'stream'), 'null') not in ('null', 'boolean') then '"stream" must be true or false'
      when jsonb_typeof(j.e -> 'node') is distinct from 'string' or length(j.e ->> 'node') <> 36 or j.e ->> 'node' !~ v_uuid
        then '"node" must be the node''s id (a UUID)'
      when jsonb_typeof(j.e -> 'started_at') is distinct from 'string' or j.e ->> 'started_at' !~ v_time
        then '"started_at" must be a time (ISO 8601)'
      when coalesce(jsonb_typeof(j.e -> 'hold_usd'), 'null') not in ('number', 'string') or j.e ->> 'hold_usd' !~ v_usd
        then '"hold_usd" must be an amount in USD, 0 or more'
      when coalesce(jsonb_typeof(j.e -> 'end_user'), 'null') not in ('null', 'string') or length(j.e ->> 'end_user') > 256
        then '"end_user" must be a string of at most 256 characters, or null'
      when coalesce(jsonb_typeof(j.e -> 'end'), 'null') not in ('null', 'object') then '"end" must be an object or null'
      when jsonb_typeof(j.e -> 'end') = 'object' then case
        when coalesce(j.e -> 'end' ->> 'status', '') not in ('succeeded', 'failed', 'cancelled')
          then 'its end''s "status" must be succeeded, failed or cancelled'
        when coalesce(jsonb_typeof(j.e -> 'end' -> 'prompt_tokens'), 'number') <> 'number'
             or coalesce(jsonb_typeof(j.e -> 'end' -> 'completion_tokens'), 'number') <> 'number'
             or coalesce(j.e -> 'end' ->> 'prompt_tokens', '0') !~ '^\d{1,9}$'
             or coalesce(j.e -> 'end' ->> 'completion_tokens', '0') !~ '^\d{1,9}$'
          then 'its end''s token counts must be whole numbers, 0 or more'
        when coalesce(jsonb_typeof(j.e -> 'end' -> 'ttft_ms'), 'null') not in ('null', 'number')
             or coalesce(jsonb_typeof(j.e -> 'end' -> 'latency_ms'), 'null') not in ('null', 'number')
          then 'its end''s "ttft_ms" and "latency_ms" must be numbers or null'
        when coalesce(jsonb_typeof(j.e -> 'end' -> 'error'), 'null') not in ('null', 'string')
          then 'its end''s "error" must be a string or null'
        end
      end as fault
    from jsonb_array_elements(p_jobs) with ordinality as j (e, n)
  ) x
  where x.fault is not null
  order by x.n
  limit 1;
  if found then
    raise exception 'job record % (%): %', v_bad.n, coalesce(v_bad.id, '?'), v_bad.fault
      using errcode = 'invalid_parameter_value';
  end if;

  begin
    select array_agg((j.e ->> 'id')::uuid order by j.n), array_agg((j.e ->> 'key')::uuid order by j.n),
           array_agg(j.e ->> 'model' order by j.n), array_agg(j.e ->> 'policy' order by j.n),
           array_agg(j.e ->> 'region' order by j.n), array_agg(coalesce((j.e ->> 'stream')::boolean, false) order by j.n),
           array_agg((j.e ->> 'node')::uuid order by j.n), array_agg((j.e ->> 'started_at')::timestamptz order by j.n),
           array_agg((j.e ->> 'hold_usd')::numeric order by j.n), array_agg(j.e ->> 'end_user' order by j.n),
           array_agg(nullif(j.e -> 'end', 'null') order by j.n)
      into v_ids, v_keys, v_models, v_policies, v_regions, v_streams, v_nodes, v_starts, v_holds, v_users, v_ends
    from jsonb_array_elements(p_jobs) with ordinality as j (e, n);
  exception when data_exception then
    raise exception 'a job record could not be read: %', sqlerrm using errcode = 'invalid_parameter_value';
  end;
  if v_ids is null then
    return;
  end if;
  select min(u.n) filter (where u.n > f.first) into v_n
  from unnest(v_ids) with ordinality as u (id, n)
  join (select w.id, min(w.n) as first from unnest(v_ids) with ordinality as w (id, n) group by w.id) f on f.id = u.id;
  if v_n is not null then
    raise exception 'job record % (%): the job appears twice in the batch', v_n, v_ids[v_n]
      using errcode = 'invalid_parameter_value';
  end if;

  -- Locks as complete_jobs() takes them: the jobs named that exist, by id.
  perform from public.jobs j where j.id = any (v_ids) order by j.id for no key update;
  -- What a new job names must exist, and its lane be one a placement could have asked for.
  select u.n, u.id, case
      when not exists (select from public.nodes n where n.id = u.node) then format('no node with id %s', u.node)
      when u.key is not null and not exists (select from public.api_keys k where k.id = u.key)
        then format('no API key with id %s', u.key)
    end as fault,
    case
      when not exists (select from public.models m where m.id = u.model)
           and not exists (select from public.node_models nm where nm.model_id = u.model)
        then format('unknown model "%s": not in the catalog and held by no node', u.model)
      when u.policy <> 'seed' and not exists (select from public.matching_policies w where w.name = u.policy)
        then format('unknown matching policy "%s"', u.policy)
    end as bad_lane
    into v_bad
  from unnest(v_ids, v_nodes, v_keys, v_models, v_policies) with ordinality as u (id, node, key, model, policy, n)
  where not exists (select from public.jobs j where j.id = u.id)
    and (not exists (select from public.nodes n where n.id = u.node)
         or (u.key is not null and not exists (select from public.api_keys k where k.id = u.key))
         or (not exists (select from public.models m where m.id = u.model)
             and not exists (select from public.node_models nm where nm.model_id = u.model))
         or (u.policy <> 'seed' and not exists (select from public.matching_policies w where w.name = u.policy)))
  order by u.n
  limit 1;
  if found and v_bad.fault is not null then
    raise exception 'job record % (%): %', v_bad.n, v_bad.id, v_bad.fault using errcode = 'foreign_key_violation';
  elsif found then
    raise exception 'job record % (%): %', v_bad.n, v_bad.id, v_bad.bad_lane using errcode = 'invalid_parameter_value';
  end if;

  -- The new jobs: those still running recorded as place() records a placed one, each with its
  -- leased first attempt; those that have ended are written ended, by end_jobs() below.
  v_fresh := array(select u.id from unnest(v_ids, v_ends) u (id, e)
                   where u.e is not null and not exists (select from public.jobs j where j.id = u.id)
                   order by u.id);
  with input as (
    select u.*, k.budget_usd is not null as budgeted, k.owner_id
    from unnest(v_ids, v_keys, v_models, v_policies, v_regions, v_streams, v_nodes, v_starts, v_holds, v_users, v_ends)
      with ordinality as u (id, key, model, policy, region, stream, node, started_at, hold, end_user, e, n)
    left join public.api_keys k on k.id = u.key
    where u.e is null and not exists (select from public.jobs j where j.id = u.id)
  ),
  recorded as (
    insert into public.jobs as j (id, api_key_id, owner_id, model_id, policy, status, node_id, attempts, stream,
                                  region, min_vram_gb, reserved_usd, created_at, gateway_id, end_user)
    select i.id, i.key, i.owner_id, i.model, i.policy, 'running', i.node, 1, i.stream, i.region,
           private.required_vram_gb(i.model), case when i.budgeted then i.hold else 0 end, i.started_at, p_gateway,
           i.end_user
    from input i
    order by i.n
    on conflict on constraint jobs_pkey do nothing
    returning j.id, j.node_id, j.created_at
  ),
  attempts as (
    insert into public.job_attempts (job_id, attempt, node_id, leased, started_at)
    select r.id, 1, r.node_id, true, r.created_at from recorded r
  )
  select coalesce(array_agg(r.id), '{}') || v_fresh into v_new from recorded r;

  -- The nodes and keys of what it ends, in complete_jobs()'s order: nodes by id, then keys by id.
  v_ending := array(
    select u.id from unnest(v_ids, v_ends) as u (id, e)
    join public.jobs j on j.id = u.id
    where u.e is not null and j.status = 'running');
  perform from public.nodes n
  where n.id in (select a.node_id from public.job_attempts a where a.job_id = any (v_ending) and a.status = 'running'
                 union select u.node from unnest(v_ids, v_nodes) u (id, node) where u.id = any (v_fresh))
  order by n.id for no key update;
  perform from public.api_keys k
  where k.id in (select j.api_key_id from public.jobs j where j.id = any (v_new || v_ending)
                 union select u.key from unnest(v_ids, v_keys) u (id, key) where u.id = any (v_fresh))
  order by k.id for no key update;
  -- A call beside this one may have recorded one of the jobs it found new (a retried batch, a spool
  -- written twice): it held their nodes until it committed, so the ledger now says which are.
  if v_fresh <> '{}' then
    v_stale := array(select f from unnest(v_fresh) f where exists (select from public.jobs j where j.id = f));
    if v_stale <> '{}' then
      v_fresh := array(select f from unnest(v_fresh) f where not f = any (v_stale));
      v_new := array(select f from unnest(v_new) f where not f = any (v_stale));
      v_ending := v_ending || array(select j.id from public.jobs j where j.id = any (v_stale) and j.status = 'running');
    end if;
  end if;

  -- The new jobs' holds leave the gateway's escrows for their keys (what an escrow lacks is held on
  -- the key anew).
  with held as (
    select u.key as api_key_id, sum(round(u.hold, 8)) as usd
    from unnest(v_ids, v_keys, v_holds) u (id, key, hold)
    join public.api_keys k on k.id = u.key and k.budget_usd is not null
    where u.id = any (v_new) and u.hold > 0
    group by u.key
  ),
  escrowed as (
    select h.api_key_id, h.usd, least(h.usd, coalesce(e.usd, 0)) as taken
    from held h
    left join private.key_escrows e on e.gateway_id = p_gateway and e.api_key_id = h.api_key_id
  ),
  escrows_moved as (
    update private.key_escrows e set usd = e.usd - x.taken
    from escrowed x
    where e.gateway_id = p_gateway and e.api_key_id = x.api_key_id and x.taken > 0
  )
  update public.api_keys k set reserved_usd = k.reserved_usd + x.usd - x.taken
  from escrowed x
  where k.id = x.api_key_id and x.usd > x.taken;

  -- The ends, written as every ending is, a slice at a time (the statement grows faster than its
  -- batch past about a hundred jobs; the locks are all held already).
  select array_agg(u.id order by u.id), array_agg(u.e ->> 'status' order by u.id),
         array_agg(coalesce((u.e ->> 'prompt_tokens')::integer, 0) order by u.id),
         array_agg(coalesce((u.e ->> 'completion_tokens')::integer, 0) order by u.id),
         array_agg((u.e ->> 'ttft_ms')::real order by u.id), array_agg((u.e ->> 'latency_ms')::real order by u.id),
         array_agg(u.e ->> 'error' order by u.id)
    into v_end_ids, v_statuses, v_prompts, v_completions, v_ttfts, v_latencies, v_errors
  from unnest(v_ids, v_ends) as u (id, e)
  where u.id = any (v_ending) or u.id = any (v_fresh);
  v_costs := '{}';
  for v_at in 1 .. coalesce(cardinality(v_end_ids), 0) by 64 loop
    select v_costs || coalesce(jsonb_object_agg(c.job_id, c.cost_usd), '{}') into v_costs
    from private.end_jobs(v_end_ids[v_at:v_at + 63], v_statuses[v_at:v_at + 63], v_prompts[v_at:v_at + 63],
                          v_completions[v_at:v_at + 63], v_ttfts[v_at:v_at + 63], v_latencies[v_at:v_at + 63],
                          v_errors[v_at:v_at + 63], p_gateway,
                          (select jsonb_agg(j.e) from jsonb_array_elements(p_jobs) j (e)
                           where (j.e ->> 'id')::uuid = any (v_fresh)
                             and (j.e ->> 'id')::uuid = any (v_end_ids[v_at:v_at + 63]))) c;
  end loop;

  return query
  select u.id,
         case when v_costs ? u.id::text then (v_costs ->> u.id::text)::numeric
              when j.status <> 'running' then j.cost_usd end,
         case when u.id = any (v_new) and v_costs ? u.id::text then 'started+ended'
              when u.id = any (v_new) then 'started'
              when v_costs ? u.id::text then 'ended'
              else 'already' end
  from unnest(v_ids) with ordinality as u (id, n)
  join public.jobs j on j.id = u.id
  order by u.n;
end;
$_$;

COMMENT ON FUNCTION public.record_jobs(p_gateway uuid, p_jobs jsonb) IS 'A gateway''s leased jobs, written behind, idempotently. One at a time with the gateway''s renew_leases() (an advisory lock per gateway). p_jobs: a JSON array (at most 1000) of records, {"id": the job''s id (made at the gateway), "key": API key id or null, "model", "policy", "region": text or null, "stream": bool, "node": node id, "started_at": ISO 8601 time, "hold_usd": the budget hold, "end_user": text or null, "end": null or {"status": succeeded|failed|cancelled, "prompt_tokens", "completion_tokens", "ttft_ms", "latency_ms", "error"}}. A job not yet recorded is recorded as p_gateway''s, its first attempt leased, its hold moved from the gateway''s escrow for the key (private.key_escrows) to the job: running, or, when its record carries its end, ended at once (one insert each of the job and its attempt); an end is written by private.end_jobs() as complete_jobs() writes one (price, charge, earnings, reputation, moving averages; no slot freed for a leased attempt) unless the job has ended already. Returns a row per record, in order: the job''s cost once ended, and what was done (started, ended, started+ended, already). A batch with a record at fault changes nothing: invalid_parameter_value (foreign_key_violation for a node or key that does not exist) naming the record.';
