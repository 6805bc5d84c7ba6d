-- Leases (issue 42), step 2: renew_leases(), a gateway's renewal of every lane it leases slots in.
--
-- Once a second each gateway says, per lane (model, policy, region), how many slots it wants and how
-- many of each lease are in use; SQL ranks the lane's nodes with score_nodes(), works out the
-- gateway's fair share of the lane's slots, gives back idle slots above it (lowest ranked first) and
-- claims free ones toward it (best ranked first), and returns every usable lease the gateway holds.
--
-- * No overbooking: a lease's slots are counted in nodes.inflight, and slots are claimed only while
--   inflight + k <= max_concurrency on a locked row, the rule claim_node() keeps.
-- * No deadlock: a renewal takes an advisory lock per lane (in one sorted order: renewals of a lane
--   are serialized, so shares are worked out from one state), then its own lease rows, and then
--   node rows in id order with SKIP LOCKED: it never waits for a node another transaction holds (a
--   placement, a completion, a heartbeat, another lane's renewal); what it skips it moves at its next
--   renewal, a second later. Placements take no advisory lock and are not slowed by renewals.
-- * Fair shares: the lane's capacity C is the free slots of the nodes ranked for it plus the slots
--   any gateway leases in the lane (on usable nodes); a gateway's target is min(want, share), the
--   shares C x want / (sum of want) of the live gateways that renewed the lane within lease_s,
--   rounded by largest remainders (each gets the floor of its share; the slots left over go one
--   each to the largest fractional parts, ties to the larger want, then to the smaller gateway id),
--   so that they never sum above C.
-- * A slot in use is never given back by a renewal. A gateway that reports more in use on a node
--   than its lease holds there (the sweep took back idle slots of a lease that ended unrenewed while
--   the gateway was still dispatching on it) is given those slots back where the node has them free,
--   and its count is otherwise cut to what the lease holds: the renewal goes through.

create function private.lease_usable_nodes(p_model text, p_node_ids uuid[])
returns setof uuid
language plpgsql
stable
set search_path = ''
as $$
begin
  -- A node a lease may be dispatched to: online (or busy: full, most likely with leased slots), not
  -- cooling down, beating (score_nodes()'s freshness), and holding the model. (PL/pgSQL, not SQL: a
  -- function that pins its search_path is not inlined, and this way its plan is kept.)
  return query
  select n.id
  from public.nodes n
  join public.node_models nm on nm.node_id = n.id and nm.model_id = p_model
  left join public.node_liveness l on l.node_id = n.id
  cross join public.platform_settings s
  where n.id = any (p_node_ids)
    and n.status in ('online', 'busy')
    and (n.cooldown_until is null or n.cooldown_until <= now())
    and greatest(n.last_heartbeat_at, l.last_heartbeat_at)
        >= now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline);
end;
$$;
comment on function private.lease_usable_nodes(text, uuid[]) is 'Of p_node_ids, the nodes a lease for p_model may be dispatched to: online or busy, not cooling down, with a fresh heartbeat, holding the model.';
revoke execute on function private.lease_usable_nodes(text, uuid[]) from public, anon, authenticated;
grant execute on function private.lease_usable_nodes(text, uuid[]) to service_role;

create function private.move_lease_slots(
  p_gateway uuid, p_model text, p_policy text, p_region text, p_node_ids uuid[], p_deltas integer[],
  p_expires_at timestamptz
) returns integer
language plpgsql
set search_path = ''
as $$
declare
  v_locked uuid[];
  v_moved integer;
begin
  -- Node rows in id order, skipping those another transaction holds: never a wait, so never a
  -- deadlock. The next statement sees the locked rows as they are now.
  v_locked := array(select n.id from public.nodes n where n.id = any (p_node_ids)
                    order by n.id for no key update skip locked);
  with planned as (
    select u.id, sum(u.delta)::integer as delta
    from unnest(p_node_ids, p_deltas) as u (id, delta)
    where u.id = any (v_locked)
    group by u.id
  ),
  bounded as (
    -- Claims up to the node's free slots (inflight + k <= max_concurrency), gives back at most the
    -- lease's idle slots.
    select p.id,
           case when p.delta > 0 then least(p.delta, greatest(n.max_concurrency - n.inflight, 0))
                else -least(-p.delta, coalesce(l.slots - l.in_use, 0), n.inflight) end as delta
    from planned p
    join public.nodes n on n.id = p.id
    left join private.slot_leases l
      on l.gateway_id = p_gateway and l.node_id = p.id and l.model_id = p_model and l.policy = p_policy
         and l.region = p_region
    where p.delta <> 0
  ),
  nodes_moved as (
    update public.nodes n
    set inflight = n.inflight + b.delta,
        status = case when b.delta > 0 and n.status = 'online' and n.inflight + b.delta >= n.max_concurrency then 'busy'
                      when b.delta < 0 and n.status = 'busy' and n.inflight + b.delta < n.max_concurrency then 'online'
                      else n.status end
    from bounded b
    where n.id = b.id and b.delta <> 0
  ),
  given_back as (
    update private.slot_leases l
    set slots = l.slots + b.delta
    from bounded b
    where b.delta < 0 and l.gateway_id = p_gateway and l.node_id = b.id and l.model_id = p_model
      and l.policy = p_policy and l.region = p_region
  ),
  claimed as (
    insert into private.slot_leases as l (gateway_id, node_id, model_id, policy, region, slots, in_use, expires_at)
    select p_gateway, b.id, p_model, p_policy, p_region, b.delta, 0, p_expires_at
    from bounded b
    where b.delta > 0
    on conflict on constraint slot_leases_pkey do update set slots = l.slots + excluded.slots
  )
  select coalesce(sum(b.delta), 0)::integer into v_moved from bounded b;
  return v_moved;
end;
$$;
comment on function private.move_lease_slots(uuid, text, text, text, uuid[], integer[], timestamptz) is 'Moves slots of gateway p_gateway''s leases in a lane: for each node of p_node_ids, claims p_deltas slots (positive; only as many as are free: inflight never passes max_concurrency) or gives back as many (negative; only idle ones), in nodes.inflight and the lease together, and sets a node busy when full or online when no longer. Nodes another transaction holds locked are skipped, not waited for. Returns the slots claimed less those given back.';
revoke execute on function private.move_lease_slots(uuid, text, text, text, uuid[], integer[], timestamptz) from public, anon, authenticated;
grant execute on function private.move_lease_slots(uuid, text, text, text, uuid[], integer[], timestamptz) to service_role;

create function private.lane_target(
  p_gateway uuid, p_model text, p_policy text, p_region text, p_capacity integer
) returns integer
language sql
stable
set search_path = ''
as $$
  -- Largest remainders: each live gateway that renewed the lane within lease_s gets the floor of
  -- its share C x want / W, and the slots that leaves go one each to the largest fractional parts
  -- (ties: the larger want, then the smaller gateway id). Shares never sum above C; a gateway never
  -- gets more than it wants (when W <= C every share is at least its want).
  with demand as (
    select d.gateway_id, d.wanted
    from private.lane_demand d
    join private.gateways g on g.id = d.gateway_id
    cross join public.platform_settings s
    where d.model_id = p_model and d.policy = p_policy and d.region = p_region and d.wanted > 0
      and d.renewed_at >= now() - make_interval(secs => s.lease_s) and private.gateway_is_live(g.seen_at)
  ),
  shares as (
    select d.gateway_id, d.wanted, greatest(p_capacity, 0)::numeric * d.wanted / sum(d.wanted) over () as share
    from demand d
  ),
  placed as (
    select s.gateway_id, s.wanted, floor(s.share) as base,
           greatest(p_capacity, 0) - sum(floor(s.share)) over () as left_over,
           row_number() over (order by s.share - floor(s.share) desc, s.wanted desc, s.gateway_id) as place
    from shares s
  )
  select coalesce((select least(p.wanted, p.base + case when p.place <= p.left_over then 1 else 0 end)::integer
                   from placed p where p.gateway_id = p_gateway), 0)
$$;
comment on function private.lane_target(uuid, text, text, text, integer) is 'How many of a lane''s p_capacity slots gateway p_gateway may lease: its share in proportion to what each live gateway that renewed the lane within platform_settings.lease_s wants (private.lane_demand), never more than it wants, rounded by largest remainders (the left-over slots to the largest fractional parts; ties to the larger want, then the smaller gateway id) so that the shares never sum above p_capacity.';
revoke execute on function private.lane_target(uuid, text, text, text, integer) from public, anon, authenticated;
grant execute on function private.lane_target(uuid, text, text, text, integer) to service_role;

create function private.renew_lane(
  p_gateway uuid, p_model text, p_policy text, p_region text, p_want integer, p_in_use jsonb,
  p_reported boolean, p_expires_at timestamptz
) returns void
language plpgsql
set search_path = ''
as $$
declare
  v_ids uuid[];
  v_deltas integer[];
  v_ranked uuid[];
  v_scores float8[];
  v_limit integer;
  v_usable uuid[];  -- of the ranked nodes and those leased in the lane, the usable ones
  v_capacity integer;
  v_target integer;
begin
  -- What the gateway wants, for the shares (a lane it no longer reports wants nothing).
  if p_reported then
    insert into private.lane_demand as d (gateway_id, model_id, policy, region, wanted, renewed_at)
    values (p_gateway, p_model, p_policy, p_region, p_want, now())
    on conflict on constraint lane_demand_pkey do update set wanted = excluded.wanted, renewed_at = excluded.renewed_at;
  else
    delete from private.lane_demand d
    where d.gateway_id = p_gateway and d.model_id = p_model and d.policy = p_policy and d.region = p_region;
  end if;

  -- A count above what the lease holds: the slots are taken back where the node has them free.
  select array_agg(u.id order by u.id), array_agg(u.used - coalesce(l.slots, 0) order by u.id) into v_ids, v_deltas
  from (select r.key::uuid as id, r.value::integer as used from jsonb_each_text(p_in_use) r) u
  join public.nodes n on n.id = u.id
  left join private.slot_leases l
    on l.gateway_id = p_gateway and l.node_id = u.id and l.model_id = p_model and l.policy = p_policy
       and l.region = p_region
  where u.used > coalesce(l.slots, 0);
  if v_ids is not null then
    perform private.move_lease_slots(p_gateway, p_model, p_policy, p_region, v_ids, v_deltas, p_expires_at);
  end if;
  update private.slot_leases l
  set in_use = least(coalesce((p_in_use ->> l.node_id::text)::integer, 0), l.slots)
  where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region
    and l.in_use is distinct from least(coalesce((p_in_use ->> l.node_id::text)::integer, 0), l.slots);

  -- The lane's nodes as score_nodes() ranks them now (only nodes with a free slot), enough of them
  -- to hold what every gateway wants.
  select least(greatest(private.ranking_limit(0), coalesce(sum(d.wanted), 0)), 1000)::integer into v_limit
  from private.lane_demand d
  where d.model_id = p_model and d.policy = p_policy and d.region = p_region;
  select array_agg(s.node_id order by s.rank), array_agg(s.score order by s.rank) into v_ranked, v_scores
  from public.score_nodes(p_model, null, p_policy, nullif(p_region, ''), null, null, null, false, v_limit, null) s;
  v_ranked := coalesce(v_ranked, '{}');

  -- The lane's capacity: free slots on the ranked nodes, and the slots leased in the lane (by any
  -- gateway) on nodes still usable.
  v_usable := array(select private.lease_usable_nodes(p_model, v_ranked || array(
                      select l.node_id from private.slot_leases l
                      where l.model_id = p_model and l.policy = p_policy and l.region = p_region)));
  select coalesce(sum(greatest(n.max_concurrency - n.inflight + coalesce(h.slots, 0), 0)), 0)::integer into v_capacity
  from public.nodes n
  left join lateral (
    select sum(l.slots) as slots from private.slot_leases l
    where l.node_id = n.id and l.model_id = p_model and l.policy = p_policy and l.region = p_region
  ) h on true
  where n.id = any (v_usable);
  v_target := case when p_reported then private.lane_target(p_gateway, p_model, p_policy, p_region, v_capacity) else 0 end;

  -- Given back: idle slots on nodes no longer usable, or holding more than they have slots (their
  -- server's slots went down); then idle slots above the target from the lowest ranked lease up.
  -- Claimed: free slots toward the target from the best ranked node down.
  with own as (
    select l.node_id, l.slots, l.in_use, n.inflight, n.max_concurrency,
           l.node_id = any (v_usable) as usable,
           coalesce(r.score, l.score, (select s.base_score from public.node_scores s
                                       where s.node_id = l.node_id and s.policy = p_policy and s.model_id = p_model),
                    '-Infinity'::float8) as score
    from private.slot_leases l
    join public.nodes n on n.id = l.node_id
    left join unnest(v_ranked, v_scores) as r (id, score) on r.id = l.node_id
    where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region
  ),
  forced as (
    select o.node_id, o.usable, o.score, o.in_use,
           case when not o.usable then o.slots - o.in_use
                else least(o.slots - o.in_use, greatest(o.inflight - o.max_concurrency, 0)) end as k,
           o.slots
    from own o
  ),
  kept as (
    select f.node_id, f.slots - f.k as slots, f.in_use, f.score,
           sum(f.slots - f.k) over () as held
    from forced f
    where f.usable
  ),
  shrunk as (
    select k.node_id,
           least(k.slots - k.in_use,
                 greatest(k.held - v_target
                          - coalesce(sum(k.slots - k.in_use) over (order by k.score, k.node_id desc
                                                                   rows between unbounded preceding and 1 preceding), 0),
                          0)) as k
    from kept k
  ),
  room as (
    select r.id, r.ord, greatest(n.max_concurrency - n.inflight, 0) as free
    from unnest(v_ranked) with ordinality as r (id, ord)
    join public.nodes n on n.id = r.id
    where r.id = any (v_usable)
  ),
  grown as (
    select f.id as node_id,
           least(f.free,
                 greatest(v_target - coalesce((select max(k.held) from kept k), 0)
                          - coalesce(sum(f.free) over (order by f.ord rows between unbounded preceding and 1 preceding), 0),
                          0)) as k
    from room f
  ),
  moves as (
    select f.node_id, -f.k as delta from forced f where f.k > 0
    union all
    select s.node_id, -s.k from shrunk s where s.k > 0
    union all
    select g.node_id, g.k from grown g where g.k > 0
  )
  select array_agg(m.node_id), array_agg(m.delta) into v_ids, v_deltas from moves m;
  if v_ids is not null then
    perform private.move_lease_slots(p_gateway, p_model, p_policy, p_region, v_ids, v_deltas, p_expires_at);
  end if;

  -- Renewed: until the new end, with the score each node ranks by; leases holding nothing are gone.
  update private.slot_leases l
  set expires_at = p_expires_at,
      score = coalesce((select r.score from unnest(v_ranked, v_scores) as r (id, score) where r.id = l.node_id),
                       l.score,
                       (select s.base_score from public.node_scores s
                        where s.node_id = l.node_id and s.policy = p_policy and s.model_id = p_model))
  where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region;
  delete from private.slot_leases l
  where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region
    and l.slots = 0 and l.in_use = 0;
end;
$$;
comment on function private.renew_lane(uuid, text, text, text, integer, jsonb, boolean, timestamptz) is 'renew_leases() for one lane of one gateway: records its demand (p_reported false: a lane it no longer reports, wanting nothing), sets its leases'' slots in use from p_in_use ({node id: count}), works out its target (private.lane_target()) over the lane''s capacity, gives back idle slots (on nodes no longer usable, then above the target from the lowest ranked), claims free ones toward the target from the best ranked (private.move_lease_slots()), and renews the leases until p_expires_at.';
revoke execute on function private.renew_lane(uuid, text, text, text, integer, jsonb, boolean, timestamptz) from public, anon, authenticated;
grant execute on function private.renew_lane(uuid, text, text, text, integer, jsonb, boolean, timestamptz) to service_role;

create function public.renew_leases(p_gateway uuid, p_lanes jsonb)
returns table (
  model_id text, policy text, region text, node_id uuid, endpoint_url text, node_key bytea, slots integer,
  in_use integer, rank integer, tokens_per_s real, routes text[], expires_at timestamptz
)
language plpgsql
set search_path = ''
as $$
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
  -- ranking leaves out (full, because leased), by its score when last ranked.
  return query
  select l.model_id, l.policy, l.region, l.node_id, n.endpoint_url, n.secret_hash, l.slots, l.in_use,
         (row_number() over (partition by l.model_id, l.policy, l.region
                             order by l.score desc nulls last, l.node_id))::integer,
         n.ewma_tokens_per_s, n.routes, l.expires_at
  from private.slot_leases l
  join public.nodes n on n.id = l.node_id
  where l.gateway_id = p_gateway and l.slots > 0
    and (l.model_id, l.node_id) in (
      select m.model_id, u.id
      from (select distinct o.model_id from private.slot_leases o where o.gateway_id = p_gateway) m
      cross join lateral private.lease_usable_nodes(m.model_id, array(
        select o.node_id from private.slot_leases o where o.gateway_id = p_gateway and o.model_id = m.model_id)) u (id))
  order by l.model_id, l.policy, l.region, 9;
end;
$$;
comment on function public.renew_leases(uuid, jsonb) is 'A gateway''s renewal of its slot leases, once a second, which also checks it in. p_lanes: a JSON array of lanes, [{"model": m, "policy": p (default balanced), "region": r (null or absent: none), "want": slots wanted, "in_use": {node id: slots in use}}]. For each lane it records the demand, sets what is in use, gives back idle slots above the gateway''s fair share (private.lane_target()) from the lowest ranked node and claims free ones toward it from the best ranked (score_nodes()), as claims do (nodes.inflight, never past max_concurrency); a lane it leased in and no longer names is given back whole but for slots in use. Returns every lease it may dispatch on (node online or busy, not cooling down, beating, holding the model), with where and how to reach the node, its rank in the lane (1: best) and the lease''s end (now + platform_settings.lease_s). Bad input raises invalid_parameter_value and changes nothing.';
revoke execute on function public.renew_leases(uuid, jsonb) from public, anon, authenticated;
grant execute on function public.renew_leases(uuid, jsonb) to service_role;
