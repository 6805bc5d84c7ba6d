-- A renewal whose answer was lost no longer leaves a job it moved into a lease unknown to the
-- gateway. renew_leases() names the jobs SQL placed whose slots it moves into the gateway's lease
-- once (absorbed), and the gateway counts them in use there; when that answer never came back (the
-- connection broke after the commit), the next renewal's lease counted the job's slot while the
-- gateway thought it idle, and sent it another request while the job still ran: a node of one slot
-- answered two at once (tests/gateway/test_leased_requests.py). A lane now names the jobs SQL placed
-- that its gateway still thinks SQL's ("placed"); of them, those a lease already holds count in use
-- and are named again among the absorbed.

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
  v_placed jsonb;
  v_used record;
  v_lanes jsonb := '[]';  -- the lanes as read: [{model, policy, region, want, need, in_use, placed, reported}]
  v_absorbed uuid[] := '{}';  -- its jobs SQL placed whose slots joined its leases
  v_lock bigint;
  v_ranks boolean;  -- whether score_nodes() can rank the lane (private.lane_can_rank())
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
    if coalesce(jsonb_typeof(v_lane -> 'policy'), 'null') not in ('null', 'string') then
      raise exception 'lane %: "policy" must be a string', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_policy := coalesce(v_lane ->> 'policy', 'balanced');
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
    v_placed := coalesce(nullif(v_lane -> 'placed', 'null'), '[]');
    if jsonb_typeof(v_placed) <> 'array' or jsonb_array_length(v_placed) > 10000
       or exists (select from jsonb_array_elements(v_placed) p
                  where jsonb_typeof(p) <> 'string' or length(p #>> '{}') <> 36 or p #>> '{}' !~ uuid_shape) then
      raise exception 'lane %: "placed" must be an array of at most 10000 job ids', v_n
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
    -- A lane of a model or policy that does not exist (a request for one, refused, is wanted a while;
    -- a model's last node dropped it) gets nothing: renewed as a lane its gateway no longer names,
    -- but for the slots it says in use, which stay until their jobs end.
    v_ranks := private.lane_can_rank(v_model, v_policy);
    v_lanes := v_lanes || jsonb_build_object('model', v_model, 'policy', v_policy, 'region', v_region,
                                             'want', case when v_ranks then v_want::integer else 0 end,
                                             'need', case when v_ranks then v_need::integer else 0 end,
                                             'in_use', v_in_use, 'placed', v_placed, 'reported', v_ranks);
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

  -- The jobs SQL placed that it names as still SQL's (placed), whose slots an earlier renewal moved
  -- into its lease: that renewal's answer never reached it. In use where it says none is (else the
  -- slot is idle to it, and it sends another request to the node while the job runs), and named
  -- again among the jobs whose slots joined its leases.
  for r in
    select distinct x.n, a.job_id, a.node_id
    from jsonb_array_elements(v_lanes) with ordinality as x (lane, n)
    cross join lateral jsonb_array_elements_text(x.lane -> 'placed') as p (id)
    join public.job_attempts a on a.job_id = p.id::uuid and a.attempt = 1 and a.status = 'running' and a.leased
    join public.jobs j on j.id = a.job_id
    where j.gateway_id = p_gateway and j.status = 'running' and j.model_id = x.lane ->> 'model'
      and j.policy = x.lane ->> 'policy' and coalesce(j.region, '') = x.lane ->> 'region'
  loop
    v_lanes := jsonb_set(v_lanes, array[(r.n - 1)::text, 'in_use', r.node_id::text],
                         to_jsonb(coalesce((v_lanes #>> array[(r.n - 1)::text, 'in_use', r.node_id::text])::integer, 0) + 1));
    v_absorbed := v_absorbed || r.job_id;
  end loop;

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
    -- The lanes reported that can still be ranked (its model's last node may just have gone).
    from (select l.x from jsonb_array_elements(v_lanes) l (x)
          where (l.x ->> 'reported')::boolean and private.lane_can_rank(l.x ->> 'model', l.x ->> 'policy')) ranked
    cross join lateral public.score_nodes(ranked.x ->> 'model', null, ranked.x ->> 'policy',
                                          nullif(ranked.x ->> 'region', ''), null, null, null, false,
                                          private.ranking_limit(0), null) s
    join public.nodes n on n.id = s.node_id
    where not exists (select from held h where h.model_id = x ->> 'model' and h.policy = x ->> 'policy'
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

COMMENT ON FUNCTION public.renew_leases(p_gateway uuid, p_lanes jsonb) IS 'A gateway''s renewal of its slot leases, once a second, which also checks it in. One at a time with the gateway''s record_jobs() (an advisory lock per gateway). p_lanes: a JSON array of lanes, [{"model": m, "policy": p (default balanced), "region": r (null or absent: none), "want": slots wanted, "need": of them, slots needed (absent: all), "in_use": {node id: slots in use}, "placed": ids of its running jobs SQL placed that it knows no lease to hold (absent: none)}]. For each lane it records the demand, sets what is in use, gives back idle slots above the gateway''s fair share (private.lane_target()) from the lowest ranked node and claims free ones toward it from the best ranked (score_nodes()), as claims do (nodes.inflight, never past max_concurrency), those above the need (spares) one a node, only where the node keeps a slot free and the gateway holds no idle slot there already; a lane it leased in and no longer names is given back whole but for slots in use, and so is a lane of a model that does not exist (in no catalog row, held by no node) or of a policy that does not, which gets nothing (its slots in use stay until their jobs end). Returns every lease it may dispatch on (node online or busy, not cooling down, beating, holding the model) with the slots it may use (those held less those draining above its share; draining: how many drain), with where and how to reach the node and its hourly rate (a request''s price cap filters the leases, in their order), its rank in the lane (1: best), the lease''s end (now + platform_settings.lease_s) the ids of the gateway''s running jobs SQL had placed whose slots this renewal moved into the lease (absorbed: the gateway counts them in use there until they end; with them, those of "placed" an earlier renewal moved, whose answer the gateway never had, counted in use as it had not) and the gateway''s share of the lane''s slots (share: holding it, the gateway places none of the lane''s requests in SQL); then, with 0 slots and ranked after them, the lane''s best ranked nodes (score_nodes()) it holds no lease on: a failed leased job''s fallbacks. Bad input raises invalid_parameter_value and changes nothing.';
