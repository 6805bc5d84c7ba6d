-- Leases (issue 42): where a leased job goes when its node fails, and no overbooking at a lease's end.
--
-- renew_leases() also returns, after the leases and with no slot, the lane's best ranked nodes the
-- gateway holds nothing on: the fallbacks failover_job() is handed when a leased node fails and the
-- gateway holds no other slot for the lane (before, it had none to hand, and the request failed).
--
-- sweep_leases(): a lease past its end gave back its idle slots at once, but "idle" was as of its last
-- renewal, and requests its gateway dispatched after that renewal may still run on them: the node
-- could be overbooked. The idle slots now wait platform_settings.gateway_timeout_s past the lease's
-- end (when a gateway that stopped renewing is judged dead anyway, and loses them all).

create or replace function public.renew_leases(p_gateway uuid, p_lanes jsonb) RETURNS TABLE(model_id text, policy text, region text, node_id uuid, endpoint_url text, node_key bytea, slots integer, in_use integer, rank integer, tokens_per_s real, routes text[], expires_at timestamp with time zone)
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
           l.score, n.ewma_tokens_per_s, n.routes, l.expires_at
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
           n.ewma_tokens_per_s, n.routes, v_expires_at as expires_at, s.rank
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
         u.ewma_tokens_per_s, u.routes, u.expires_at
  from (select h.*, false as fallback, null::bigint as rank from held h
        union all
        select f.model_id, f.policy, f.region, f.node_id, f.endpoint_url, f.secret_hash, f.slots, f.in_use,
               f.score, f.ewma_tokens_per_s, f.routes, f.expires_at, true, f.rank from fallbacks f) u
  order by u.model_id, u.policy, u.region, 9;
end;
$$;

create or replace function private.sweep_leases() RETURNS void
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_dead uuid[];
  v_gateways uuid[];
  v_nodes uuid[];
  v_models text[];
  v_policies text[];
  v_regions text[];
  v_freed integer[];
  -- A lease past its end keeps its slots this much longer: requests its gateway dispatched after
  -- its last renewal may still run on them (that renewal's in_use does not count them), and a
  -- gateway that cannot renew has stopped dispatching at the end by its own clock.
  v_grace interval := (select make_interval(secs => s.gateway_timeout_s) from public.platform_settings s);
begin
  -- The gateways judged dead that still hold something (a row the sweep forgot counts as dead).
  v_dead := array(
    select h.gateway_id
    from (select l.gateway_id from private.slot_leases l
          union select e.gateway_id from private.key_escrows e
          union select d.gateway_id from private.lane_demand d) h
    left join private.gateways g on g.id = h.gateway_id
    where g.id is null or not private.gateway_is_live(g.seen_at));

  -- What each lease gives back: all of a dead gateway's, the idle slots of one past its end and grace.
  select array_agg(l.gateway_id), array_agg(l.node_id), array_agg(l.model_id), array_agg(l.policy),
         array_agg(l.region), array_agg(case when l.gateway_id = any (v_dead) then l.slots else l.slots - l.in_use end)
    into v_gateways, v_nodes, v_models, v_policies, v_regions, v_freed
  from (
    select l.* from private.slot_leases l
    where l.gateway_id = any (v_dead) or (l.expires_at + v_grace < now() and l.slots > l.in_use)
    for update skip locked
  ) l;
  if v_nodes is not null then
    perform from public.nodes n where n.id = any (v_nodes) order by n.id for no key update;
    with freed as (
      select u.node, sum(u.freed)::integer as freed
      from unnest(v_nodes, v_freed) as u (node, freed)
      group by u.node
    )
    update public.nodes n
    set inflight = greatest(n.inflight - f.freed, 0),
        status = case when n.status = 'busy' and n.inflight - f.freed < n.max_concurrency then 'online'
                      else n.status end
    from freed f
    where n.id = f.node and f.freed > 0;
    update private.slot_leases l
    set slots = l.slots - g.freed, in_use = least(l.in_use, l.slots - g.freed)
    from unnest(v_gateways, v_nodes, v_models, v_policies, v_regions, v_freed)
      as g (gateway_id, node_id, model_id, policy, region, freed)
    where l.gateway_id = g.gateway_id and l.node_id = g.node_id and l.model_id = g.model_id
      and l.policy = g.policy and l.region = g.region;
    delete from private.slot_leases l
    where l.slots = 0
      and (l.gateway_id, l.node_id, l.model_id, l.policy, l.region)
          in (select * from unnest(v_gateways, v_nodes, v_models, v_policies, v_regions));
  end if;

  if cardinality(v_dead) > 0 then
    -- A dead gateway's escrows go back to their keys (keys by id, then the escrows).
    perform from public.api_keys k
    where k.id in (select e.api_key_id from private.key_escrows e where e.gateway_id = any (v_dead))
    order by k.id for no key update;
    with returned as (
      delete from private.key_escrows e where e.gateway_id = any (v_dead)
      returning e.api_key_id, e.usd
    )
    update public.api_keys k set reserved_usd = greatest(k.reserved_usd - r.usd, 0)
    from (select x.api_key_id, sum(x.usd) as usd from returned x group by x.api_key_id) r
    where k.id = r.api_key_id;
    delete from private.lane_demand d where d.gateway_id = any (v_dead);
  end if;
end;
$$;

comment on function public.renew_leases(uuid, jsonb) is 'A gateway''s renewal of its slot leases, once a second, which also checks it in. p_lanes: a JSON array of lanes, [{"model": m, "policy": p (default balanced), "region": r (null or absent: none), "want": slots wanted, "in_use": {node id: slots in use}}]. For each lane it records the demand, sets what is in use, gives back idle slots above the gateway''s fair share (private.lane_target()) from the lowest ranked node and claims free ones toward it from the best ranked (score_nodes()), as claims do (nodes.inflight, never past max_concurrency); a lane it leased in and no longer names is given back whole but for slots in use. Returns every lease it may dispatch on (node online or busy, not cooling down, beating, holding the model), with where and how to reach the node, its rank in the lane (1: best) and the lease''s end (now + platform_settings.lease_s); then, with 0 slots and ranked after them, the lane''s best ranked nodes (score_nodes()) it holds no lease on: a failed leased job''s fallbacks. Bad input raises invalid_parameter_value and changes nothing.';

comment on function private.sweep_leases() is 'The sweep''s part in leases: a lease past its end by more than platform_settings.gateway_timeout_s gives back its idle slots (those in use at its last renewal stay held; requests dispatched since may still run on the others until then); a gateway silent for gateway_timeout_s loses all its leases (every slot freed), its escrows (returned to their keys'' reserved_usd) and its lane demand. Lease rows a renewal holds are left for it.';
