-- Leases (issue 42): a request with a price cap is served from its lane's leases too.
--
-- A price cap (x-neuralgrid-max-price) is a hard filter of score_nodes(): it leaves the order of the
-- nodes within it as it is. renew_leases() now returns each node's hourly rate, and the gateway serves
-- a capped request from the best ranked lease within its cap (before, every capped request asked
-- Postgres: one round trip). The return type changes, so the function is dropped and made again.

drop function public.renew_leases(uuid, jsonb);

create function public.renew_leases(p_gateway uuid, p_lanes jsonb) RETURNS TABLE(model_id text, policy text, region text, node_id uuid, endpoint_url text, node_key bytea, slots integer, in_use integer, rank integer, tokens_per_s real, routes text[], expires_at timestamp with time zone, hourly_rate numeric)
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
  v_in_use jsonb;
  v_used record;
  v_lanes jsonb := '[]';  -- the lanes as read: [{model, policy, region, want, in_use}]
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
                                             'want', v_want::integer, 'in_use', v_in_use, 'reported', true);
  end loop;

  -- A renewal is a check-in.
  insert into private.gateways as g (id) values (p_gateway) on conflict (id) do update set seen_at = now();
  v_expires_at := now() + (select make_interval(secs => s.lease_s) from public.platform_settings s);

  -- The lanes it no longer reports but still holds or wanted: nothing wanted, nothing in use.
  select v_lanes || coalesce(jsonb_agg(jsonb_build_object('model', o.model_id, 'policy', o.policy,
                                                          'region', o.region, 'want', 0, 'in_use', '{}'::jsonb,
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

  for r in
    select x ->> 'model' as model, x ->> 'policy' as policy, x ->> 'region' as region,
           (x ->> 'want')::integer as want, x -> 'in_use' as in_use, (x ->> 'reported')::boolean as reported
    from jsonb_array_elements(v_lanes) x
    order by 1, 2, 3
  loop
    perform private.renew_lane(p_gateway, r.model, r.policy, r.region, r.want, r.in_use, r.reported, v_expires_at);
  end loop;

  -- Every lease it may dispatch on, ranked per lane: by the node's score now, or for a node the
  -- ranking leaves out (full, because leased), by its score when last ranked. After them, with no
  -- slot, the lane's best ranked nodes it holds none on: where a job moves (failover_job()) when its
  -- leased node fails and the gateway holds no other slot for it.
  return query
  with held as (
    select l.model_id, l.policy, l.region, l.node_id, n.endpoint_url, n.secret_hash, l.slots, l.in_use,
           l.score, n.ewma_tokens_per_s, n.routes, l.expires_at, n.hourly_rate
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
           n.ewma_tokens_per_s, n.routes, v_expires_at as expires_at, n.hourly_rate, s.rank
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
         u.ewma_tokens_per_s, u.routes, u.expires_at, u.hourly_rate
  from (select h.*, false as fallback, null::bigint as rank from held h
        union all
        select f.model_id, f.policy, f.region, f.node_id, f.endpoint_url, f.secret_hash, f.slots, f.in_use,
               f.score, f.ewma_tokens_per_s, f.routes, f.expires_at, f.hourly_rate, true, f.rank from fallbacks f) u
  order by u.model_id, u.policy, u.region, 9;
end;
$$;

comment on function public.renew_leases(uuid, jsonb) is 'A gateway''s renewal of its slot leases, once a second, which also checks it in. p_lanes: a JSON array of lanes, [{"model": m, "policy": p (default balanced), "region": r (null or absent: none), "want": slots wanted, "in_use": {node id: slots in use}}]. For each lane it records the demand, sets what is in use, gives back idle slots above the gateway''s fair share (private.lane_target()) from the lowest ranked node and claims free ones toward it from the best ranked (score_nodes()), as claims do (nodes.inflight, never past max_concurrency); a lane it leased in and no longer names is given back whole but for slots in use. Returns every lease it may dispatch on (node online or busy, not cooling down, beating, holding the model), with where and how to reach the node and its hourly rate (a request''s price cap filters the leases, in their order), its rank in the lane (1: best) and the lease''s end (now + platform_settings.lease_s); then, with 0 slots and ranked after them, the lane''s best ranked nodes (score_nodes()) it holds no lease on: a failed leased job''s fallbacks. Bad input raises invalid_parameter_value and changes nothing.';

revoke execute on function public.renew_leases(uuid, jsonb) from public, anon, authenticated;
grant execute on function public.renew_leases(uuid, jsonb) to service_role;
