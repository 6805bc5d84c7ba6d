-- Tunneled nodes reachable through any gateway.
--
-- An agent behind NAT dials one gateway, but any gateway may place a request on its node. Each
-- gateway now says where the others reach it (private.gateways.internal_url, given at each check-in),
-- and the gateway holding each tunnel is recorded when the tunnel attaches (attach_tunnel()) and
-- forgotten when it closes (detach_tunnel(), unless a newer socket of the node has replaced it) or
-- when that gateway falls silent (the sweep). A gateway without the tunnel asks tunnel_route() which
-- live gateway holds it and forwards the request there.
--
-- A node is not to blame for a tunnel no gateway can reach. The gateway moves such a job on with
-- HTTP status 421 (Misdirected Request: no live gateway holds the tunnel, or the one holding it did
-- not take the request), and move_job() then ends the attempt cancelled, not failed, as abandon_job()
-- and reject_job() end attempts that are not the node's doing: its slot is freed, its successes,
-- failures and cooldown stay as they were, and the job goes on to the next candidate (or fails,
-- uncharged, when none is left). A node's own 421 never reaches failover_job(): the gateway passes a
-- node's 4xx answers (but 429) to the client.

-- Where other gateways reach a gateway --------------------------------------------------------------

alter table private.gateways
  add column internal_url text,
  add constraint "internal_url must be an http or https URL" check (internal_url ~ '^https?://[^\s]+$');
comment on column private.gateways.internal_url is 'Where the other gateways reach this one (NEURALGRID_INTERNAL_URL) to forward requests for the tunnels it holds; null for gateways that forward nothing.';

create function public.gateway_alive(p_gateway_id uuid, p_internal_url text)
returns void
language sql
set search_path = ''
as $$
  insert into private.gateways as g (id, internal_url) values (p_gateway_id, p_internal_url)
  on conflict (id) do update set seen_at = now(), internal_url = excluded.internal_url;
$$;
comment on function public.gateway_alive(uuid, text) is 'A gateway checks in (every couple of seconds) and says where the other gateways reach it: the jobs it placed stay its own, and the tunnels it holds reachable through it, while it does.';
revoke execute on function public.gateway_alive(uuid, text) from public, anon, authenticated;
grant execute on function public.gateway_alive(uuid, text) to service_role;

-- Unpinned search_path (it names built-ins and schema-qualified objects only), so it inlines.
create function private.gateway_is_live(p_seen_at timestamptz)
returns boolean
language sql stable
as $$
  -- The rule sweep_orphaned_jobs() applies: silence counts from the database's own start too.
  select greatest(p_seen_at, pg_postmaster_start_time())
         >= now() - (select make_interval(secs => s.gateway_timeout_s) from public.platform_settings s)
$$;
comment on function private.gateway_is_live(timestamptz) is 'A gateway last seen at p_seen_at is live: it checked in within platform_settings.gateway_timeout_s (counted from the database''s start too, as sweep_orphaned_jobs() counts).';
revoke execute on function private.gateway_is_live(timestamptz) from public, anon, authenticated;
grant execute on function private.gateway_is_live(timestamptz) to service_role;

-- Which gateway holds each tunnel -------------------------------------------------------------------

create table private.tunnel_routes (
  node_id uuid primary key references public.nodes (id) on delete cascade,
  gateway_id uuid not null references private.gateways (id) on delete cascade,
  socket_id uuid not null,
  attached_at timestamptz not null default now()
);
comment on table private.tunnel_routes is 'The gateway holding each tunnel node''s socket (one per node: the newest), so that any gateway can forward requests to it. socket_id names the socket, so that an old socket closing late forgets nothing a newer one holds.';
create index tunnel_routes_by_gateway on private.tunnel_routes (gateway_id);
revoke all on table private.tunnel_routes from public, anon, authenticated;
grant select, insert, update, delete on table private.tunnel_routes to service_role;

create function public.attach_tunnel(p_node_id uuid, p_gateway_id uuid, p_socket_id uuid)
returns text
language plpgsql
set search_path = ''
as $$
declare
  v_status text;
begin
  -- set_tunnel() first: it refuses a node that is not a tunnel node before anything is recorded.
  v_status := public.set_tunnel(p_node_id, true);
  -- The gateway checked in before serving; this covers a row the sweep forgot after a long outage.
  insert into private.gateways (id) values (p_gateway_id) on conflict (id) do nothing;
  insert into private.tunnel_routes as r (node_id, gateway_id, socket_id) values (p_node_id, p_gateway_id, p_socket_id)
  on conflict (node_id) do update
    set gateway_id = excluded.gateway_id, socket_id = excluded.socket_id, attached_at = now();
  return v_status;
end;
$$;
comment on function public.attach_tunnel(uuid, uuid, uuid) is 'A tunnel node''s agent connected socket p_socket_id to gateway p_gateway_id: requests for the node go through that gateway from now on (a newer socket replaces an older one, wherever it was), and the node is online if its server is up (set_tunnel()). Returns the node''s status.';
revoke execute on function public.attach_tunnel(uuid, uuid, uuid) from public, anon, authenticated;
grant execute on function public.attach_tunnel(uuid, uuid, uuid) to service_role;

create function public.detach_tunnel(p_node_id uuid, p_socket_id uuid)
returns text
language plpgsql
set search_path = ''
as $$
begin
  delete from private.tunnel_routes r where r.node_id = p_node_id and r.socket_id = p_socket_id;
  if found then
    return public.set_tunnel(p_node_id, false);
  end if;
  -- A newer socket (on this gateway or another) carries the node now: a late close changes nothing.
  return (select n.status from public.nodes n where n.id = p_node_id);
end;
$$;
comment on function public.detach_tunnel(uuid, uuid) is 'Socket p_socket_id of a tunnel node closed: if it was the node''s newest, the route is forgotten and the node is offline at once (set_tunnel()); if a newer socket replaced it, nothing changes. Returns the node''s status.';
revoke execute on function public.detach_tunnel(uuid, uuid) from public, anon, authenticated;
grant execute on function public.detach_tunnel(uuid, uuid) to service_role;

create function public.tunnel_route(p_node_id uuid)
returns table (gateway_id uuid, internal_url text)
language sql stable
set search_path = ''
as $$
  select g.id, g.internal_url
  from private.tunnel_routes r
  join private.gateways g on g.id = r.gateway_id
  where r.node_id = p_node_id and private.gateway_is_live(g.seen_at)
$$;
comment on function public.tunnel_route(uuid) is 'The live gateway holding a tunnel node''s socket and where the other gateways reach it; no row when no live gateway holds it.';
revoke execute on function public.tunnel_route(uuid) from public, anon, authenticated;
grant execute on function public.tunnel_route(uuid) to service_role;

create function private.sweep_dead_tunnels()
returns table (node_id uuid, name text)
language plpgsql
set search_path = ''
as $$
declare
  v_node uuid;
begin
  -- The gateway holding these tunnels is silent: nobody can reach the nodes until their agents
  -- dial a live gateway, which records a new route (a reconnect that came first is not deleted:
  -- its route names the live gateway).
  for v_node in
    delete from private.tunnel_routes r using private.gateways g
    where g.id = r.gateway_id and not private.gateway_is_live(g.seen_at)
    returning r.node_id
  loop
    perform public.set_tunnel(v_node, false);
    return query select n.id, n.name from public.nodes n where n.id = v_node;
  end loop;
end;
$$;
comment on function private.sweep_dead_tunnels() is 'Forgets the tunnels held by gateways silent for platform_settings.gateway_timeout_s and sets their nodes offline (set_tunnel()); returns those nodes.';
revoke execute on function private.sweep_dead_tunnels() from public, anon, authenticated;
grant execute on function private.sweep_dead_tunnels() to service_role;

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
end;
$$;
comment on function public.sweep(interval) is 'One sweep: silent nodes offline (sweep_stale_nodes()), tunnel nodes whose gateway fell silent offline (sweep_dead_tunnels(); kind node_offline too), the running jobs of silent gateways ended (kind job_orphaned), and jobs running longer than p_max_job_age (default: platform_settings.job_deadline_s) ended (kind job_abandoned). Returns a row per node set offline (with its name) and per job ended. Run every second by pg_cron where it is installed, else by the service''s sweeper.';

-- Moving a job on without blaming a node for an unreachable tunnel ------------------------------------

create or replace function private.move_job(
  p_job_id uuid, p_error text, p_http_status integer, p_candidates uuid[], p_fail_if_none boolean
) returns table (node_id uuid, endpoint_url text, node_key bytea, attempt integer)
language plpgsql
set search_path = ''
as $$
declare
  v_running public.job_attempts;
  v_tried uuid[];
  v_next integer;
  v_node public.nodes;
begin
  -- The running attempt, then its node, then (skipping locked rows) the next node: the order
  -- failover_job() has always taken these locks in.
  select * into v_running from public.job_attempts a
  where a.job_id = p_job_id and a.status = 'running'
  for no key update;
  if not found then
    raise exception 'job % has no running attempt', p_job_id using errcode = 'object_not_in_prerequisite_state';
  end if;
  perform from public.nodes n where n.id = v_running.node_id for no key update;
  select array_agg(a.node_id), max(a.attempt) + 1 into v_tried, v_next
  from public.job_attempts a where a.job_id = p_job_id;

  -- No waiting here: this transaction already holds the running node's row, and waiting on another
  -- move's node could deadlock with it.
  select * into v_node from private.claim_node(p_candidates, v_tried, false);
  if v_node.id is null and not p_fail_if_none then
    return;  -- nowhere to go, and told to change nothing
  end if;
  -- 421: no gateway could reach the node's tunnel. The platform's failure, not the node's: the
  -- attempt ends cancelled (slot freed, reputation and cooldown untouched).
  perform private.end_attempt(p_job_id, case when p_http_status = 421 then 'cancelled' else 'failed' end,
                              p_error, p_http_status);
  if v_node.id is null then
    update public.jobs j set status = 'failed', error = p_error, finished_at = now() where j.id = p_job_id;
    perform private.release_reservation(p_job_id, 0);
    return;
  end if;
  insert into public.job_attempts (job_id, attempt, node_id) values (p_job_id, v_next, v_node.id);
  update public.jobs j set node_id = v_node.id, attempts = v_next where j.id = p_job_id;
  return query select v_node.id, v_node.endpoint_url, v_node.secret_hash, v_next;
end;
$$;
comment on function private.move_job(uuid, text, integer, uuid[], boolean) is 'Moves a running job to the first free candidate not yet tried: its running attempt fails (its node cools down) and a new attempt starts there; with p_http_status 421 (no gateway could reach the node''s tunnel) the attempt ends cancelled instead, neutral for the node. When no candidate is free: with p_fail_if_none, the attempt ends and the job fails with the hold released; without, nothing changes. No row means the job did not move.';

comment on function public.failover_job(uuid, text, integer, uuid[]) is 'Before the first byte: records the running attempt''s failure (cooling its node down; neutral with p_http_status 421, when no gateway could reach the node''s tunnel) and claims the next free candidate not yet tried; no row means the job failed.';
