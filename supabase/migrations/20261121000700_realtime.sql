-- Realtime: node status and health changes reach subscribers, on Supabase natively and on the
-- embedded stack through the compatibility layer's realtime.messages.
--
-- Two ways, as Supabase offers them: postgres_changes on public.nodes (the publication; Realtime
-- filters each subscriber's columns and rows by its grants and RLS), and Broadcast from Database
-- (Supabase's recommended way at scale): a trigger sends each change of status or health to the
-- public `node-map` topic with the map's columns only, and the full row to its owner's private topic.

do $$
begin
  if not exists (select from pg_publication_tables
                 where pubname = 'supabase_realtime' and schemaname = 'public' and tablename = 'nodes') then
    alter publication supabase_realtime add table public.nodes;
  end if;
end
$$;

create function public.node_map_payload(n public.nodes) returns jsonb
language sql stable
set search_path = ''
as $$
  -- What anyone may see of a node: the columns granted to anon, never endpoint_url, owner or secret.
  select jsonb_build_object(
    'id', n.id, 'name', n.name, 'gpu_model', n.gpu_model, 'gpu_count', n.gpu_count, 'vram_gb', n.vram_gb,
    'tflops', n.tflops, 'hourly_rate', n.hourly_rate, 'region', n.region, 'latitude', n.latitude,
    'longitude', n.longitude, 'status', n.status, 'max_concurrency', n.max_concurrency,
    'inflight', n.inflight, 'last_heartbeat_at', n.last_heartbeat_at, 'missed_heartbeats', n.missed_heartbeats,
    'successes', n.successes, 'failures', n.failures, 'cooldown_until', n.cooldown_until,
    'gpu_utilization', n.gpu_utilization, 'queue_depth', n.queue_depth)
$$;
comment on function public.node_map_payload(public.nodes) is 'A node as the public map may show it (the columns granted to anon).';
revoke execute on function public.node_map_payload(public.nodes) from public, anon, authenticated;

create function public.broadcast_node_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
declare
  v_node public.nodes := case when tg_op = 'DELETE' then old else new end;
  v_payload jsonb := jsonb_build_object('operation', tg_op, 'node', public.node_map_payload(v_node),
                                        'old_status', case when tg_op = 'UPDATE' then old.status end);
begin
  perform realtime.send(v_payload, 'node_' || lower(tg_op), 'node-map', false);
  if v_node.owner_id is not null then
    perform realtime.send(
      v_payload || jsonb_build_object('node', to_jsonb(v_node) - 'secret_hash'),
      'node_' || lower(tg_op), 'owner:' || v_node.owner_id, true);
  end if;
  return null;
end;
$$;
comment on function public.broadcast_node_change() is 'Trigger: broadcasts a node''s status or health change on node-map (public columns) and on its owner''s private topic (the whole row but the secret).';
revoke execute on function public.broadcast_node_change() from public, anon, authenticated;

create trigger nodes_broadcast_insert_delete
  after insert or delete on public.nodes
  for each row execute function public.broadcast_node_change();
-- Status, health and specs that really changed: not every claim (inflight) or heartbeat, which would
-- flood the topic (claims and heartbeats write status without changing it).
create trigger nodes_broadcast_update
  after update on public.nodes
  for each row
  when ((old.status, old.missed_heartbeats, old.cooldown_until, old.name, old.gpu_model, old.gpu_count,
         old.vram_gb, old.tflops, old.hourly_rate, old.region, old.latitude, old.longitude,
         old.max_concurrency)
        is distinct from (new.status, new.missed_heartbeats, new.cooldown_until, new.name, new.gpu_model,
                          new.gpu_count, new.vram_gb, new.tflops, new.hourly_rate, new.region, new.latitude,
                          new.longitude, new.max_concurrency))
  execute function public.broadcast_node_change();

create function public.broadcast_job_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  if new.owner_id is not null then
    perform realtime.send(
      jsonb_build_object('job', jsonb_build_object(
        'id', new.id, 'model_id', new.model_id, 'status', new.status, 'node_id', new.node_id,
        'attempts', new.attempts, 'prompt_tokens', new.prompt_tokens,
        'completion_tokens', new.completion_tokens, 'cost_usd', new.cost_usd, 'latency_ms', new.latency_ms,
        'error', new.error)),
      'job_' || new.status, 'jobs:' || new.owner_id, true);
  end if;
  return null;
end;
$$;
comment on function public.broadcast_job_change() is 'Trigger: a developer''s job that finishes is broadcast on their private jobs topic.';
revoke execute on function public.broadcast_job_change() from public, anon, authenticated;

create trigger jobs_broadcast_finish
  after update of status on public.jobs
  for each row when (old.status = 'running' and new.status <> 'running')
  execute function public.broadcast_job_change();

-- Private topics: a signed-in user may receive (and send on) only their own. realtime.messages belongs
-- to Supabase Realtime (supabase_realtime_admin): hosted projects let postgres add policies to it
-- (supautils); a Postgres with Supabase's roles and no supautils does not. There the policies are
-- skipped with a warning rather than failing the push: private topics then stay closed to users
-- (Realtime authorizes nothing without a policy) until the table's owner creates them.
do $$
begin
  create policy "Users receive broadcasts on their own private topics" on realtime.messages
    for select to authenticated
    using (realtime.topic() in ('owner:' || (select auth.uid()), 'jobs:' || (select auth.uid())));
  create policy "Users broadcast on their own private topics" on realtime.messages
    for insert to authenticated
    with check (realtime.topic() in ('owner:' || (select auth.uid()), 'jobs:' || (select auth.uid())));
exception when insufficient_privilege then
  raise warning 'NeuralGrid: the private-topic policies on realtime.messages were skipped: % (this database lacks supautils, which lets postgres add them on Supabase). Private topics (owner:<id>, jobs:<id>) stay closed until the owner of realtime.messages runs the two CREATE POLICY statements of 20261121000700_realtime.sql. See docs/deployment.md.', sqlerrm;
end
$$;
