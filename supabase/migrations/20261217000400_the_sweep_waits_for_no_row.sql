-- The sweep takes no row another transaction holds. It runs its steps in one transaction, and had
-- waited for rows while holding others: ending a dead gateway's job locks its key, and freeing that
-- gateway's leases then waited for their nodes, which a live gateway's record_jobs() held while it
-- waited for that key (it locks nodes, then keys): a deadlock (a review's stress run: 16 in 150
-- rounds of a gateway killed beside three writing). The job sweeps lock each job's nodes and key
-- (private.sweepable_jobs()), the lease sweep its nodes, keys, escrows and demand, the tunnel sweep
-- its nodes and routes, the forgetting of gateways gone a day their rows, all skipping what another
-- transaction holds; the next sweep, a second later, takes what one left. (20261217000200 did this
-- for sweep_stale_nodes().) A job whose node was deleted since (no row to lock) is ended as before.
-- Also: a tunnel node its owner moved to a direct endpoint only loses its stale route, in the tunnel
-- sweep and in detach_tunnel(): set_tunnel() refused it, and the sweep failed whole every second.

CREATE FUNCTION private.sweepable_jobs(p_jobs uuid[]) RETURNS uuid[]
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_nodes uuid[];
  v_keys uuid[];
begin
  -- The nodes of their running attempts, then their keys, each by id as claims and record_jobs()
  -- take them, none another transaction holds: a sweep that waited for one while holding what the
  -- holder waits for (a key of a job it ended before, say) would deadlock with it.
  v_nodes := array(select n.id from public.nodes n
                   where n.id in (select a.node_id from public.job_attempts a
                                  where a.job_id = any (p_jobs) and a.status = 'running')
                   order by n.id for no key update skip locked);
  v_keys := array(select k.id from public.api_keys k
                  where k.id in (select j.api_key_id from public.jobs j where j.id = any (p_jobs))
                  order by k.id for no key update skip locked);
  return array(
    select j.id from public.jobs j
    where j.id = any (p_jobs)
      and (j.api_key_id is null or j.api_key_id = any (v_keys))
      and not exists (select from public.job_attempts a  -- (a node deleted since: no row to lock)
                      where a.job_id = j.id and a.status = 'running' and a.node_id is not null
                        and a.node_id <> all (v_nodes))
    order by j.id);
end;
$$;

COMMENT ON FUNCTION private.sweepable_jobs(p_jobs uuid[]) IS 'Of running jobs the sweep holds (p_jobs), those it may end now: it locks the nodes of their running attempts, then their keys (each by id, as claims and record_jobs() take them), skipping rows another transaction holds, and returns the jobs whose node and key it holds. A job left out is ended by the next sweep.';

REVOKE ALL ON FUNCTION private.sweepable_jobs(p_jobs uuid[]) FROM PUBLIC;
GRANT ALL ON FUNCTION private.sweepable_jobs(p_jobs uuid[]) TO service_role;

CREATE OR REPLACE FUNCTION private.sweep_dead_tunnels() RETURNS TABLE(node_id uuid, name text)
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_node uuid;
begin
  -- The gateway holding these tunnels is silent: nobody can reach the nodes until their agents
  -- dial a live gateway, which records a new route (a reconnect that came first is not deleted:
  -- its route names the live gateway).
  -- Nodes, then their routes, each by id, none another transaction holds (the next sweep takes it).
  for v_node in
    delete from private.tunnel_routes r
    where r.node_id in (
      select n.id from public.nodes n
      where n.id in (select x.node_id from private.tunnel_routes x join private.gateways g on g.id = x.gateway_id
                     where not private.gateway_is_live(g.seen_at))
      order by n.id
      for no key update skip locked)
      and r.node_id in (
        select x.node_id from private.tunnel_routes x join private.gateways g on g.id = x.gateway_id
        where not private.gateway_is_live(g.seen_at)
        order by x.node_id
        for update of x skip locked)
    returning r.node_id
  loop
    -- A node its owner moved off its tunnel since (a direct endpoint) only loses the stale route:
    -- set_tunnel() would refuse it, and with it every sweep from then on.
    continue when not exists (select from public.nodes n where n.id = v_node and n.endpoint_url like 'tunnel:%');
    perform public.set_tunnel(v_node, false);
    return query select n.id, n.name from public.nodes n where n.id = v_node;
  end loop;
end;
$$;

COMMENT ON FUNCTION private.sweep_dead_tunnels() IS 'Forgets the tunnels held by gateways silent for platform_settings.gateway_timeout_s and sets their nodes offline (set_tunnel()); returns those nodes. Takes no node or route another transaction holds (the next sweep takes it).';

CREATE OR REPLACE FUNCTION private.sweep_orphaned_jobs() RETURNS TABLE(job_id uuid)
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_job uuid;
  v_timeout interval := (select make_interval(secs => s.gateway_timeout_s) from public.platform_settings s);
begin
  for v_job in
    select unnest(private.sweepable_jobs(array(
      select j.id from public.jobs j join private.gateways g on g.id = j.gateway_id
      where j.id = any (array(select a.job_id from public.job_attempts a where a.status = 'running'))
        and j.status = 'running' and greatest(g.seen_at, pg_postmaster_start_time()) < now() - v_timeout
      order by j.id
      for update of j skip locked)))
  loop
    perform private.abandon_job(v_job, 'abandoned: its gateway stopped');
    job_id := v_job;
    return next;
  end loop;
  -- Gateways gone a day, with nothing left running, are forgotten (but for a row another
  -- transaction holds: the next sweep's).
  delete from private.gateways g
  where g.id in (select x.id from private.gateways x where x.seen_at < now() - interval '1 day'
                 order by x.id for update skip locked)
    and not exists (select from public.jobs j
                    where j.id = any (array(select a.job_id from public.job_attempts a where a.status = 'running'))
                      and j.gateway_id = g.id and j.status = 'running');
end;
$$;

COMMENT ON FUNCTION private.sweep_orphaned_jobs() IS 'Ends the running jobs of gateways silent for platform_settings.gateway_timeout_s (and since the database started), and forgets gateways gone a day. Ends none whose rows another transaction holds (private.sweepable_jobs(): the next sweep ends it).';

CREATE OR REPLACE FUNCTION public.sweep_stale_jobs(p_max_age interval DEFAULT '01:00:00'::interval) RETURNS TABLE(job_id uuid)
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_job uuid;
begin
  for v_job in
    select unnest(private.sweepable_jobs(array(
      select j.id from public.jobs j
      where j.id = any (array(select a.job_id from public.job_attempts a where a.status = 'running'))
        and j.status = 'running' and j.created_at < now() - p_max_age
      order by j.id
      for update of j skip locked)))
  loop
    perform private.abandon_job(v_job, 'abandoned: no completion within ' || p_max_age::text);
    job_id := v_job;
    return next;
  end loop;
end;
$$;

COMMENT ON FUNCTION public.sweep_stale_jobs(p_max_age interval) IS 'Ends jobs still running after p_max_age (their completion was lost), giving back node slots and budget holds. Ends none whose rows another transaction holds (private.sweepable_jobs(): the next sweep ends it).';

CREATE OR REPLACE FUNCTION private.sweep_leases() RETURNS void
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
  v_held uuid[];  -- rows of nodes, then of keys, this sweep could lock
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
  -- Of them, those on nodes no other transaction holds (the next sweep takes the others).
  v_held := array(select n.id from public.nodes n where n.id = any (v_nodes) order by n.id
                  for no key update skip locked);
  select array_agg(u.gateway), array_agg(u.node), array_agg(u.model), array_agg(u.policy), array_agg(u.region),
         array_agg(u.freed)
    into v_gateways, v_nodes, v_models, v_policies, v_regions, v_freed
  from unnest(v_gateways, v_nodes, v_models, v_policies, v_regions, v_freed)
    as u (gateway, node, model, policy, region, freed)
  where u.node = any (v_held);
  if v_nodes is not null then
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
    set slots = l.slots - g.freed, in_use = least(l.in_use, l.slots - g.freed),
        draining = least(l.draining, l.slots - g.freed)
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
    -- A dead gateway's escrows go back to their keys (keys by id, then the escrows), of the keys
    -- no other transaction holds.
    v_held := array(select k.id from public.api_keys k
                    where k.id in (select e.api_key_id from private.key_escrows e where e.gateway_id = any (v_dead))
                    order by k.id for no key update skip locked);
    with returned as (
      delete from private.key_escrows e
      where e.gateway_id = any (v_dead) and e.api_key_id = any (v_held)
        and (e.gateway_id, e.api_key_id) in (select x.gateway_id, x.api_key_id from private.key_escrows x
                                             where x.gateway_id = any (v_dead) and x.api_key_id = any (v_held)
                                             for update skip locked)
      returning e.api_key_id, e.usd
    )
    update public.api_keys k set reserved_usd = greatest(k.reserved_usd - r.usd, 0)
    from (select x.api_key_id, sum(x.usd) as usd from returned x group by x.api_key_id) r
    where k.id = r.api_key_id;
    delete from private.lane_demand d
    where (d.gateway_id, d.model_id, d.policy, d.region) in (
      select x.gateway_id, x.model_id, x.policy, x.region from private.lane_demand x
      where x.gateway_id = any (v_dead) for update skip locked);
  end if;
end;
$$;

COMMENT ON FUNCTION private.sweep_leases() IS 'The sweep''s part in leases: a lease past its end by more than platform_settings.gateway_timeout_s gives back its idle slots (those in use at its last renewal stay held; requests dispatched since may still run on the others until then); a gateway silent for gateway_timeout_s loses all its leases (every slot freed), its escrows (returned to their keys'' reserved_usd) and its lane demand. It takes no lease, node, key, escrow or demand row another transaction holds (a renewal''s, a claim''s, a gateway''s write): the next sweep takes what it left.';

CREATE OR REPLACE FUNCTION public.detach_tunnel(p_node_id uuid, p_socket_id uuid) RETURNS text
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
begin
  delete from private.tunnel_routes r where r.node_id = p_node_id and r.socket_id = p_socket_id;
  -- A node its owner moved off its tunnel since (a direct endpoint) only loses the stale route:
  -- set_tunnel() would refuse it, and keep the route.
  if found and exists (select from public.nodes n where n.id = p_node_id and n.endpoint_url like 'tunnel:%') then
    return public.set_tunnel(p_node_id, false);
  end if;
  -- A newer socket (on this gateway or another) carries the node now: a late close changes nothing.
  return (select n.status from public.nodes n where n.id = p_node_id);
end;
$$;

COMMENT ON FUNCTION public.detach_tunnel(p_node_id uuid, p_socket_id uuid) IS 'Socket p_socket_id of a tunnel node closed: if it was the node''s newest, the route is forgotten and the node is offline at once (set_tunnel()); if a newer socket replaced it, nothing changes. Returns the node''s status.';
