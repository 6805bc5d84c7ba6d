-- my_nodes() runs as its caller: each owner reads their nodes' endpoints from a table of their own.
--
-- A column grant is per role, not per row, and everyone may read the map's rows of public.nodes, so
-- no grant could let an owner read their own nodes' endpoint_url without everyone's: my_nodes() read
-- it as its owner (a definer the Data API exposed, lint 0029). public.node_endpoints holds each
-- node's endpoint under a policy that shows a row to the node's owner only. nodes.endpoint_url stays
-- the one the platform uses (the matcher reads it on every request); a trigger copies each change.
-- Whether a node's tunnel is connected tells nothing about where it is, so signed-in users may read it.

create table public.node_endpoints (
  node_id uuid primary key references public.nodes (id) on delete cascade,
  endpoint_url text  -- null as in nodes: a node added through the Data API before its agent runs
);
comment on table public.node_endpoints is 'Each node''s endpoint_url (how the platform reaches it), readable by the node''s owner alone; kept equal to nodes.endpoint_url by a trigger.';
revoke all on table public.node_endpoints from anon, authenticated;
grant select on table public.node_endpoints to authenticated;
grant all on table public.node_endpoints to service_role;
alter table public.node_endpoints enable row level security;
create policy "Owners can see their own nodes' endpoints" on public.node_endpoints
  for select to authenticated
  using (exists (select from public.nodes n where n.id = node_id and n.owner_id = (select auth.uid())));

create function private.copy_node_endpoint() returns trigger
language plpgsql
-- Definer: an owner who registers or moves a node may not write node_endpoints themselves.
security definer
set search_path = ''
as $$
begin
  insert into public.node_endpoints as e (node_id, endpoint_url) values (new.id, new.endpoint_url)
  on conflict (node_id) do update set endpoint_url = excluded.endpoint_url
  where e.endpoint_url is distinct from excluded.endpoint_url;
  return null;
end;
$$;
comment on function private.copy_node_endpoint() is 'Trigger: copies a node''s endpoint_url to node_endpoints, where only its owner reads it.';
revoke execute on function private.copy_node_endpoint() from public, anon, authenticated;
create trigger nodes_copy_endpoint after insert or update of endpoint_url on public.nodes
  for each row execute function private.copy_node_endpoint();

insert into public.node_endpoints (node_id, endpoint_url) select n.id, n.endpoint_url from public.nodes n;

grant select (tunnel_connected) on table public.nodes to authenticated;

create or replace function public.my_nodes()
returns table (
  id uuid, name text, status text, endpoint_url text, tunnel_connected boolean, backend_up boolean,
  backend jsonb, routes text[], gpu_model text, gpu_count integer, vram_gb real, tflops real,
  hourly_rate numeric, region text, latitude double precision, longitude double precision,
  max_concurrency integer, inflight integer, queue_depth integer, last_heartbeat_at timestamptz,
  successes bigint, failures bigint, ewma_latency_ms real, ewma_tokens_per_s real,
  cooldown_until timestamptz, warm_models text[], available_models text[], agent_version text,
  created_at timestamptz
)
language sql stable
security invoker
set search_path = ''
as $$
  -- As the caller: the owner filter keeps it to their rows, and the endpoints' policy would too.
  select n.id, n.name, n.status, e.endpoint_url, n.tunnel_connected, n.backend_up, n.backend, n.routes,
         n.gpu_model, n.gpu_count, n.vram_gb, n.tflops, n.hourly_rate, n.region, n.latitude, n.longitude,
         n.max_concurrency, n.inflight, n.queue_depth, n.last_heartbeat_at, n.successes, n.failures,
         n.ewma_latency_ms, n.ewma_tokens_per_s, n.cooldown_until,
         coalesce((select array_agg(m.model_id order by m.model_id) from public.node_models m
                   where m.node_id = n.id and m.state = 'loaded'), '{}'),
         coalesce((select array_agg(m.model_id order by m.model_id) from public.node_models m
                   where m.node_id = n.id and m.state = 'available'), '{}'),
         n.agent_version, n.created_at
  from public.nodes n
  left join public.node_endpoints e on e.node_id = n.id
  where n.owner_id = (select auth.uid())
  order by n.name, n.id
$$;
comment on function public.my_nodes() is 'The signed-in owner''s nodes, each with what the map shows and what only its owner may see: endpoint_url (how the platform reaches it, from node_endpoints), whether its tunnel is connected and its server answers, the server found behind it (backend) and its routes. Runs as its caller. Uptime, earnings and reputation: my_node_stats().';
