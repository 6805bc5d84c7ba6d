-- GPU nodes, the models each one holds, and the public node map.

create function public.set_updated_at() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  new.updated_at := now();
  return new;
end;
$$;
comment on function public.set_updated_at() is 'Trigger function: stamps updated_at on every update.';
revoke execute on function public.set_updated_at() from public, anon, authenticated;

create table public.nodes (
  id uuid primary key default gen_random_uuid(),
  owner_id uuid references auth.users (id) on delete cascade default auth.uid(),
  name text not null,
  gpu_model text not null,
  gpu_count integer not null default 1,
  vram_gb real not null,
  tflops real not null,
  hourly_rate numeric(10, 4) not null,
  region text not null,
  latitude double precision,
  longitude double precision,
  endpoint_url text,
  status text not null default 'offline',
  max_concurrency integer not null default 4,
  inflight integer not null default 0,
  last_heartbeat_at timestamptz,
  missed_heartbeats integer not null default 0,
  successes bigint not null default 0,
  failures bigint not null default 0,
  consecutive_failures integer not null default 0,
  ewma_latency_ms real,
  ewma_tokens_per_s real,
  speed_ratio real,
  cooldown_until timestamptz,
  secret_hash bytea,
  registered_by_key uuid,
  gpu_utilization real,
  free_vram_gb real,
  queue_depth integer not null default 0,
  agent_version text,
  created_at timestamptz not null default now(),
  updated_at timestamptz not null default now(),
  constraint "node name must be 1 to 100 characters" check (length(trim(name)) between 1 and 100),
  constraint "gpu_model must not be empty" check (length(trim(gpu_model)) > 0),
  constraint "gpu_count must be between 1 and 64" check (gpu_count between 1 and 64),
  constraint "vram_gb must be positive and at most 8192" check (vram_gb > 0 and vram_gb <= 8192),
  constraint "tflops must be positive and at most 100000" check (tflops > 0 and tflops <= 100000),
  constraint "hourly_rate must not be negative" check (hourly_rate >= 0),
  constraint "region must not be empty" check (length(trim(region)) > 0),
  constraint "latitude must be between -90 and 90" check (latitude between -90 and 90),
  constraint "longitude must be between -180 and 180" check (longitude between -180 and 180),
  constraint "latitude and longitude go together" check ((latitude is null) = (longitude is null)),
  constraint "endpoint_url must be http(s):// or tunnel:" check (endpoint_url ~ '^(https?://[^\s]+|tunnel:[^\s]*)$'),
  constraint "status must be online, busy, offline or draining" check (
    status in ('online', 'busy', 'offline', 'draining')
  ),
  constraint "max_concurrency must be between 1 and 1024" check (max_concurrency between 1 and 1024),
  constraint "inflight must be between 0 and max_concurrency" check (inflight between 0 and max_concurrency),
  constraint "reputation counters must not be negative" check (
    successes >= 0 and failures >= 0 and consecutive_failures >= 0 and missed_heartbeats >= 0
  ),
  constraint "secret_hash must be a SHA-256 digest" check (secret_hash is null or length(secret_hash) = 32),
  constraint "gpu_utilization must be between 0 and 1" check (gpu_utilization between 0 and 1),
  constraint "free_vram_gb must not be negative" check (free_vram_gb >= 0),
  constraint "queue_depth must not be negative" check (queue_depth >= 0),
  constraint "speed_ratio must not be negative" check (speed_ratio >= 0),
  constraint "an owner's node names are unique" unique nulls not distinct (owner_id, name)
);
comment on column public.nodes.secret_hash is 'SHA-256 of the node agent''s secret: the agent proves itself with the secret, and the gateway signs what it sends the node with this hash.';
comment on column public.nodes.speed_ratio is 'EWMA of measured decode speed over what the claimed TFLOPS should give (catalog tokens_per_s_per_tflop); a node far below its claim loses reputation.';
comment on table public.nodes is 'GPU nodes: specs, price, location, status, load and reputation. vram_gb and tflops are totals over the node''s GPUs; endpoint_url and owner_id are private to the owner and the service.';

create index nodes_online_idx on public.nodes (id) include (vram_gb, inflight, max_concurrency)
  where status = 'online';

create trigger nodes_set_updated_at before update on public.nodes
  for each row execute function public.set_updated_at();

-- Column-level grants: everyone sees the map columns; only the service sees endpoint_url. Owners
-- write the specs of their own nodes, never status, load or reputation (the platform owns those).
revoke all on table public.nodes from anon, authenticated;
grant select (id, name, gpu_model, gpu_count, vram_gb, tflops, hourly_rate, region, latitude, longitude,
  status, max_concurrency, inflight, last_heartbeat_at, missed_heartbeats, successes, failures,
  consecutive_failures, ewma_latency_ms, ewma_tokens_per_s, speed_ratio, cooldown_until, gpu_utilization,
  free_vram_gb,
  queue_depth, agent_version, created_at, updated_at)
  on table public.nodes to anon, authenticated;
grant select (owner_id) on table public.nodes to authenticated;
grant insert (name, gpu_model, gpu_count, vram_gb, tflops, hourly_rate, region, latitude, longitude,
  endpoint_url, max_concurrency) on table public.nodes to authenticated;
grant update (name, gpu_model, gpu_count, vram_gb, tflops, hourly_rate, region, latitude, longitude,
  endpoint_url, max_concurrency) on table public.nodes to authenticated;
grant delete on table public.nodes to authenticated;
grant all on table public.nodes to service_role;
alter table public.nodes enable row level security;

create policy "Anyone can see the nodes on the map" on public.nodes
  for select to anon, authenticated using (true);
create policy "Owners can add nodes they own" on public.nodes
  for insert to authenticated with check (owner_id = (select auth.uid()));
create policy "Owners can update their own nodes" on public.nodes
  for update to authenticated using (owner_id = (select auth.uid()))
  with check (owner_id = (select auth.uid()));
create policy "Owners can delete their own nodes" on public.nodes
  for delete to authenticated using (owner_id = (select auth.uid()));

create table public.node_models (
  node_id uuid not null references public.nodes (id) on delete cascade,
  model_id text not null,
  state text not null default 'loaded',
  updated_at timestamptz not null default now(),
  primary key (node_id, model_id),
  constraint "model_id must not be empty" check (length(trim(model_id)) > 0),
  constraint "state must be loaded or available" check (state in ('loaded', 'available'))
);
comment on table public.node_models is 'Models per node: loaded (warm, serves at once) or available (can load, a cold start of 10-30 s).';

create index node_models_model_idx on public.node_models (model_id, node_id) include (state);

create trigger node_models_set_updated_at before update on public.node_models
  for each row execute function public.set_updated_at();

revoke all on table public.node_models from anon, authenticated;
grant select on table public.node_models to anon, authenticated;
grant insert, update, delete on table public.node_models to authenticated;
grant all on table public.node_models to service_role;
alter table public.node_models enable row level security;

create policy "Anyone can see which models nodes hold" on public.node_models
  for select to anon, authenticated using (true);
create policy "Owners can list models on their own nodes" on public.node_models
  for insert to authenticated with check (
    exists (select 1 from public.nodes n where n.id = node_id and n.owner_id = (select auth.uid()))
  );
create policy "Owners can change models on their own nodes" on public.node_models
  for update to authenticated using (
    exists (select 1 from public.nodes n where n.id = node_id and n.owner_id = (select auth.uid()))
  );
create policy "Owners can remove models from their own nodes" on public.node_models
  for delete to authenticated using (
    exists (select 1 from public.nodes n where n.id = node_id and n.owner_id = (select auth.uid()))
  );

create view public.node_map with (security_invoker = true) as
select
  n.id, n.name, n.gpu_model, n.gpu_count, n.vram_gb, n.tflops, n.hourly_rate, n.region,
  n.latitude, n.longitude, n.status, n.max_concurrency, n.inflight, n.last_heartbeat_at,
  n.successes, n.failures, n.ewma_latency_ms, n.ewma_tokens_per_s, n.cooldown_until,
  coalesce(array_agg(m.model_id order by m.model_id) filter (where m.state = 'loaded'), '{}') as warm_models,
  coalesce(array_agg(m.model_id order by m.model_id) filter (where m.state = 'available'), '{}') as available_models
from public.nodes n
left join public.node_models m on m.node_id = n.id
group by n.id;
comment on view public.node_map is 'The public node map: what anyone may see of each node (no endpoint, no owner), with its models.';

revoke all on table public.node_map from anon, authenticated;
grant select on table public.node_map to anon, authenticated, service_role;
