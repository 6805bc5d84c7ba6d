-- Leases (issue 42): a lane that holds nothing is not starved by idle slots leased for other lanes.
--
-- A node's slots are leased per lane (model, policy, region). A node serving several models could be
-- leased whole for one of them, its slots idle, while a request for another model (its lane new,
-- holding nothing) found every slot taken and waited in line until those lanes went idle (seconds:
-- bench world's cold requests waited 10 s on the gateway next to the database). Now, on a full node
-- that holds the model of a live lane wanting slots and holding none, the other lanes give back their
-- idle slots at their next renewal and claim no more there, so the starved lane gets them at its own.

create or replace function private.renew_lane(p_gateway uuid, p_model text, p_policy text, p_region text, p_want integer, p_in_use jsonb, p_reported boolean, p_expires_at timestamp with time zone) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_ids uuid[];
  v_deltas integer[];
  v_ranked uuid[];
  v_scores float8[];
  v_limit integer;
  v_usable uuid[];  -- of the ranked nodes and those leased in the lane, the usable ones
  v_capacity integer;
  v_target integer;
  v_wanted_elsewhere uuid[];  -- full nodes a lane that holds nothing could be served on
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
  -- The lane's nodes that hold the model of another live lane that wants slots and holds none:
  -- once full, they keep no idle slot for this lane, and it claims no more on them, so that the
  -- starved lane (a model asked for the first time, on nodes leased for others) gets slots at its
  -- next renewal. Slots in use stay.
  v_wanted_elsewhere := array(
    select distinct nm.node_id
    from private.lane_demand d
    join private.gateways g on g.id = d.gateway_id
    join public.node_models nm on nm.model_id = d.model_id
    cross join public.platform_settings s
    where (d.model_id, d.policy, d.region) is distinct from (p_model, p_policy, p_region)
      and d.wanted > 0 and d.renewed_at >= now() - make_interval(secs => s.lease_s)
      and private.gateway_is_live(g.seen_at)
      and nm.node_id in (select l.node_id from private.slot_leases l
                         where l.model_id = p_model and l.policy = p_policy and l.region = p_region)
      and not exists (select from private.slot_leases x
                      where x.gateway_id = d.gateway_id and x.model_id = d.model_id and x.policy = d.policy
                        and x.region = d.region and x.slots > 0));
  v_target := case when p_reported then private.lane_target(p_gateway, p_model, p_policy, p_region, v_capacity) else 0 end;

  -- Given back: idle slots on nodes no longer usable, or holding more than they have slots (their
  -- server's slots went down); then idle slots above the target from the lowest ranked lease up.
  -- Claimed: free slots toward the target from the best ranked node down.
  with own as (
    select l.node_id, l.slots, l.in_use, n.inflight, n.max_concurrency,
           l.node_id = any (v_usable) as usable,
           n.inflight >= n.max_concurrency and l.node_id = any (v_wanted_elsewhere) as yields,
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
           case when not o.usable or o.yields then o.slots - o.in_use
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
    where r.id = any (v_usable) and r.id <> all (v_wanted_elsewhere)
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
