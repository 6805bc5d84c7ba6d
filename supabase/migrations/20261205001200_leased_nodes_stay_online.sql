-- Leases (issue 42): a node whose slots are leased, in use or not, stays online.
--
-- move_lease_slots() set a node busy when its leases filled it, as a claim does: an idle node leased
-- whole by a gateway read busy on the map, in `nodes ls` and on its owner's page. Busy keeps meaning
-- what it meant (every slot in use by placed jobs); nodes.inflight, which every claim checks, still
-- counts the leased slots, so nothing can claim them.

create or replace function private.move_lease_slots(p_gateway uuid, p_model text, p_policy text, p_region text, p_node_ids uuid[], p_deltas integer[], p_expires_at timestamp with time zone) RETURNS integer
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
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
    -- A node full of leased slots stays online: it serves the gateways holding them (busy says its
    -- slots are all in use by placed jobs; full or not, inflight keeps every claim off it).
    set inflight = n.inflight + b.delta,
        status = case when b.delta < 0 and n.status = 'busy' and n.inflight + b.delta < n.max_concurrency then 'online'
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

comment on function private.move_lease_slots(uuid, text, text, text, uuid[], integer[], timestamptz) is 'Moves slots of gateway p_gateway''s leases in a lane: for each node of p_node_ids, claims p_deltas slots (positive; only as many as are free: inflight never passes max_concurrency) or gives back as many (negative; only idle ones), in nodes.inflight and the lease together; a node a claim had set busy is online again once not full. Leasing a node''s last slot leaves it online (it serves the gateways holding its slots). Nodes another transaction holds locked are skipped, not waited for. Returns the slots claimed less those given back.';
