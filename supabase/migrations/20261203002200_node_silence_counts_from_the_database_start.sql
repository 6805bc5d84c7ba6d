-- A node's silence counts from the database's own start, as a gateway's does.
--
-- Found by a fault-injection review: after a Postgres restart that took longer than 15 s the first
-- sweep, a tenth of a second after the database came back, set every node offline: their heartbeats
-- could not be written while it was away. (An outage without a restart, a network cut between the
-- gateways and a database that pg_cron still sweeps, is not covered.) The whole fleet flapped on the map, and
-- requests in the next seconds were told no capable node was online. A node now gets its full
-- allowance of missed heartbeats from the database's start as well (private.gateway_is_live()
-- already counts a gateway's silence so).

create or replace function public.sweep_stale_nodes()
returns table (node_id uuid, name text, last_heartbeat_at timestamptz)
language sql
set search_path = ''
as $$
  -- A node silent for missed_heartbeats_offline intervals goes offline (5 s x 3 = 15 s by default),
  -- counted from its last heartbeat or the database's start, whichever is later.
  update public.nodes n
  set status = 'offline',
      missed_heartbeats = coalesce(floor(extract(epoch from now() - n.last_heartbeat_at) / s.heartbeat_interval_s)::integer,
                                   s.missed_heartbeats_offline)
  from public.platform_settings s
  where n.status <> 'offline'
    and (n.last_heartbeat_at is null
         or greatest(n.last_heartbeat_at, pg_postmaster_start_time())
            < now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline))
  returning n.id, n.name, n.last_heartbeat_at
$$;
comment on function public.sweep_stale_nodes() is 'Marks nodes offline that have been silent for platform_settings.missed_heartbeats_offline heartbeat intervals (counted from the database''s start too: a restart is no node''s silence) and returns them; run every second by the service, or by pg_cron on Supabase.';
