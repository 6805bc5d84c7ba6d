-- The sweep takes the silent nodes' rows in id order and skips any another transaction holds. It
-- had updated them in no set order, and deadlocked with record_jobs(), which locks its nodes in id
-- order (a review's stress run of four gateways renewing, writing and placing beside the sweep: 1
-- run of 4). A node skipped goes offline at the next sweep, a second later.

CREATE OR REPLACE FUNCTION public.sweep_stale_nodes() RETURNS TABLE(node_id uuid, name text, last_heartbeat_at timestamp with time zone)
    LANGUAGE sql
    SET search_path TO ''
    AS $$
  -- A node silent for missed_heartbeats_offline intervals goes offline (5 s x 3 = 15 s by default),
  -- counted from its last heartbeat (the later of the row's and the batches', node_liveness) or the
  -- database's start, whichever is later. The last beat is kept in the row as it goes. Rows are
  -- taken in id order, as record_jobs() and the claims take them, and none that another
  -- transaction holds (the next sweep takes it).
  with silent as (
    select m.id, greatest(m.last_heartbeat_at, l.last_heartbeat_at) as beat
    from public.nodes m
    left join public.node_liveness l on l.node_id = m.id
    cross join public.platform_settings s
    where m.status <> 'offline'
      and (greatest(m.last_heartbeat_at, l.last_heartbeat_at) is null
           or greatest(m.last_heartbeat_at, l.last_heartbeat_at, pg_postmaster_start_time())
              < now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline))
  ),
  taken as (
    select n.id from public.nodes n
    where n.id in (select id from silent)
    order by n.id
    for no key update skip locked
  )
  update public.nodes n
  set status = 'offline',
      last_heartbeat_at = t.beat,
      missed_heartbeats = coalesce(floor(extract(epoch from now() - t.beat) / s.heartbeat_interval_s)::integer,
                                   s.missed_heartbeats_offline)
  from silent t, taken k, public.platform_settings s
  where n.id = t.id and k.id = t.id
  returning n.id, n.name, n.last_heartbeat_at
$$;

COMMENT ON FUNCTION public.sweep_stale_nodes() IS 'Marks nodes offline that have been silent for platform_settings.missed_heartbeats_offline heartbeat intervals (their last beat: the later of nodes.last_heartbeat_at and node_liveness, kept in the row as they go; counted from the database''s start too: a restart is no node''s silence) and returns them; run every second by the service, or by pg_cron on Supabase. Takes the rows in id order and skips any another transaction holds (the next sweep takes it).';
