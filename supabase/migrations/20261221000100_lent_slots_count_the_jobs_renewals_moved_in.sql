-- A slot a gateway lends counts in use the slots of the gateway's jobs SQL placed that a renewal
-- moved into that lease, unknown to the gateway yet.
--
-- A renewal moves the slot of each of its gateway's running jobs SQL placed (on their first
-- attempt) into the lane's lease (private.renew_lane()), in use, and the gateway learns of it from
-- the renewal's answer. Until then, a placement lending that lease as idle ("busy": the slots the
-- gateway has in use on it) could get the slot such a job ran on, the node past its slots (a
-- review, 2026-12-07). A lent slot now names them ("placed": the gateway's running jobs SQL placed
-- of that lane on that node), and SQL counts those it moved into the lease as in use too. Counted
-- by the gateway instead, every one of them in use whether moved or not, a short key's requests
-- (each placed in SQL, lending) were refused the slots they lent and starved
-- (tests/gateway/test_leased_requests.py, 3 runs in 12).

CREATE OR REPLACE FUNCTION private.return_lent_slot(p_gateway uuid, p_model text, p_policy text, p_min_vram_gb real, p_max_hourly_rate numeric, p_route text, p_offered jsonb) RETURNS uuid
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_lease record;
begin
  -- The best offered lease that could serve the request and holds more slots than the gateway's
  -- jobs hold on it: those it has in use ("busy": a renewal under way may have given idle slots back
  -- meanwhile) and those of its jobs SQL placed ("placed") that a renewal moved into it.
  select l.node_id, l.model_id, l.policy, l.region, o.busy, o.placed into v_lease
  from (
    select x.node, x.model, coalesce(x.policy, 'balanced') as policy, coalesce(x.region, '') as region,
           coalesce(x.busy, 0) as busy,
           array(select jsonb_array_elements_text(coalesce(x.placed, '[]'))::uuid) as placed
    from jsonb_to_recordset(p_offered) as x (node uuid, model text, policy text, region text, busy integer,
                                             placed jsonb)
  ) o
  join private.slot_leases l
    on l.gateway_id = p_gateway and l.node_id = o.node and l.model_id = o.model and l.policy = o.policy
       and l.region = o.region
  join public.nodes n on n.id = l.node_id
  left join public.node_scores s on s.node_id = n.id and s.model_id = p_model and s.policy = p_policy
  where l.slots > o.busy + private.moved_into_lease(o.placed, l.node_id) and l.expires_at > now()
    and n.id in (select private.lease_usable_nodes(p_model, array(
                   select (x ->> 'node')::uuid from jsonb_array_elements(p_offered) x)))
    and n.vram_gb >= private.required_vram_gb(p_model, p_min_vram_gb)
    and (p_max_hourly_rate is null or n.hourly_rate <= p_max_hourly_rate)
    and (p_route is null or p_route = any (n.routes))
  order by s.base_score desc nulls last, n.id
  limit 1;
  if v_lease.node_id is null then
    return null;
  end if;
  -- The node first, then the lease, as renewals lock them (private.move_lease_slots()).
  perform from public.nodes n where n.id = v_lease.node_id for no key update;
  update private.slot_leases l
  set slots = l.slots - 1, in_use = least(l.in_use, l.slots - 1), draining = least(l.draining, l.slots - 1)
  where l.gateway_id = p_gateway and l.node_id = v_lease.node_id and l.model_id = v_lease.model_id
    and l.policy = v_lease.policy and l.region = v_lease.region and l.expires_at > now()
    and l.slots > v_lease.busy + private.moved_into_lease(v_lease.placed, l.node_id);
  if not found then  -- changed while the node was locked: nothing lent
    return null;
  end if;
  update public.nodes n
  set inflight = n.inflight - 1,
      status = case when n.status = 'busy' then 'online' else n.status end
  where n.id = v_lease.node_id;
  return v_lease.node_id;
end;
$$;

COMMENT ON FUNCTION private.return_lent_slot(p_gateway uuid, p_model text, p_policy text, p_min_vram_gb real, p_max_hourly_rate numeric, p_route text, p_offered jsonb) IS 'place_jobs(), when every capable node is full: of the slots gateway p_gateway lends from its leases (p_offered, a JSON array of {"node", "model", "policy", "region", "busy", "placed"}: one idle slot of that lease, which the gateway keeps out of use until it has the answer; how many of the lease''s slots it has in use; and its running jobs SQL placed of that lane on that node, those a renewal moved into the lease counted in use too; a lease holding no more than that lends nothing), the best one that could serve the request (its node usable for p_model as leases are, with the VRAM, under the price cap, serving p_route; ranked by the model''s base score under p_policy) goes back from its lease to its node, free for the request to claim. Returns its node, or null when none could serve it.';


CREATE FUNCTION private.moved_into_lease(p_jobs uuid[], p_node uuid) RETURNS integer
    LANGUAGE sql STABLE
    SET search_path TO ''
    AS $$
  -- Moved by a renewal, a job SQL placed runs on a leased attempt on the lease's node.
  select count(*)::integer from public.job_attempts a
  where a.job_id = any (p_jobs) and a.node_id = p_node and a.status = 'running' and a.leased
$$;

COMMENT ON FUNCTION private.moved_into_lease(p_jobs uuid[], p_node uuid) IS 'private.return_lent_slot(): how many of the jobs p_jobs (a gateway''s running jobs SQL placed) a renewal moved into a lease on node p_node: their running attempts there, leased.';

REVOKE ALL ON FUNCTION private.moved_into_lease(p_jobs uuid[], p_node uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION private.moved_into_lease(p_jobs uuid[], p_node uuid) TO service_role;
