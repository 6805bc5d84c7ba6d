-- Leases (issue 42), step 5: the sweep frees what leases and escrows hold once nobody renews them.
--
-- * A lease past its end (its gateway did not renew it within platform_settings.lease_s) gives back
--   its idle slots; the slots in use at its last renewal stay held until its gateway renews lower or
--   is judged dead.
-- * A gateway silent for platform_settings.gateway_timeout_s (private.gateway_is_live(), the rule that
--   ends its jobs) loses all its leases, its slots in use too, its escrows (returned to their keys)
--   and its demand. Its jobs are ended by sweep_orphaned_jobs(), as before; their leased attempts
--   free no slot there (end_attempt()): the lease sweep frees them, once.
-- * Lease rows a renewal holds are skipped (SKIP LOCKED), not waited for: that renewal settles them.
--   Nodes, then keys, are locked in id order.

create function private.sweep_leases()
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_dead uuid[];
  v_gateways uuid[];
  v_nodes uuid[];
  v_models text[];
  v_policies text[];
  v_regions text[];
  v_freed integer[];
begin
  -- The gateways judged dead that still hold something (a row the sweep forgot counts as dead).
  v_dead := array(
    select h.gateway_id
    from (select l.gateway_id from private.slot_leases l
          union select e.gateway_id from private.key_escrows e
          union select d.gateway_id from private.lane_demand d) h
    left join private.gateways g on g.id = h.gateway_id
    where g.id is null or not private.gateway_is_live(g.seen_at));

  -- What each lease gives back: all of a dead gateway's, the idle slots of one past its end.
  select array_agg(l.gateway_id), array_agg(l.node_id), array_agg(l.model_id), array_agg(l.policy),
         array_agg(l.region), array_agg(case when l.gateway_id = any (v_dead) then l.slots else l.slots - l.in_use end)
    into v_gateways, v_nodes, v_models, v_policies, v_regions, v_freed
  from (
    select l.* from private.slot_leases l
    where l.gateway_id = any (v_dead) or (l.expires_at < now() and l.slots > l.in_use)
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
comment on function private.sweep_leases() is 'The sweep''s part in leases: a lease past its end gives back its idle slots (those in use at its last renewal stay held); a gateway silent for platform_settings.gateway_timeout_s loses all its leases (every slot freed), its escrows (returned to their keys'' reserved_usd) and its lane demand. Lease rows a renewal holds are left for it.';
revoke execute on function private.sweep_leases() from public, anon, authenticated;
grant execute on function private.sweep_leases() to service_role;

create or replace function public.sweep(p_max_job_age interval default null)
returns table (kind text, id uuid, name text)
language plpgsql
set search_path = ''
as $$
declare
  v_max_job_age interval := coalesce(
    p_max_job_age, (select make_interval(secs => s.job_deadline_s) from public.platform_settings s));
begin
  return query select 'node_offline'::text, s.node_id, s.name from public.sweep_stale_nodes() s;
  return query select 'node_offline'::text, s.node_id, s.name from private.sweep_dead_tunnels() s;
  return query select 'job_orphaned'::text, s.job_id, null::text from private.sweep_orphaned_jobs() s;
  return query select 'job_abandoned'::text, s.job_id, null::text from public.sweep_stale_jobs(v_max_job_age) s;
  perform private.sweep_leases();
  perform private.refresh_vram_pressure();
  perform private.refresh_fleet_activity();
end;
$$;
comment on function public.sweep(interval) is 'One sweep: silent nodes offline (sweep_stale_nodes()), tunnel nodes whose gateway fell silent offline (sweep_dead_tunnels(); kind node_offline too), the running jobs of silent gateways ended (kind job_orphaned), and jobs running longer than p_max_job_age (default: platform_settings.job_deadline_s) ended (kind job_abandoned); the idle slots of leases past their end, and all that silent gateways leased and escrowed, given back (private.sweep_leases(); no row); then the VRAM pressure and the fleet''s activity measured. Returns a row per node set offline (with its name) and per job ended. Run every second by pg_cron where it is installed, else by the service''s sweeper.';
