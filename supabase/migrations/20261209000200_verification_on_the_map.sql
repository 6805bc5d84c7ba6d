-- The map, the fleet list and an owner's nodes say which nodes failed verification (issue 39).
--
-- A node's verification is one word: the worst state over the models it has under verification
-- (failed, then suspect, unverified, verified), null when it holds no pinned model. It is a column of
-- nodes, written by a trigger on model_checks only when it changes, because the map reads nodes as
-- anon (node_map, map_view(), node_list() run as their caller) and anon may not read model_checks;
-- and because a change to a nodes row is what reaches the map's and the owner's Realtime topics. One
-- short field keeps the map's rows and messages small (issue 41).

alter table public.nodes add column verification text;
comment on column public.nodes.verification is 'The worst verification state over the node''s models under verification (model_checks): failed, suspect, unverified or verified; null when it holds no model with a pinned artifact. Written by a trigger on model_checks (private.note_node_verification()); public, as the map marks failed nodes.';
grant select (verification) on table public.nodes to anon, authenticated;

create function private.node_verification(p_node_id uuid) returns text
  language sql stable set search_path = '' as $$
  select c.state from public.model_checks c
  where c.node_id = p_node_id
  order by array_position(array['failed', 'suspect', 'unverified', 'verified'], c.state)
  limit 1
$$;
comment on function private.node_verification(uuid) is 'The worst state of a node''s models under verification (failed, suspect, unverified, verified), or null when none is: what nodes.verification holds.';
revoke all on function private.node_verification(uuid) from public;
grant execute on function private.node_verification(uuid) to service_role;

create function private.note_node_verification() returns trigger
  language plpgsql security definer set search_path = '' as $$
declare
  v_node uuid := case when tg_op = 'DELETE' then old.node_id else new.node_id end;
  v_state text := private.node_verification(v_node);
begin
  -- Written only when it changes: a nodes row is hot (claims, heartbeats), and each write of it is
  -- broadcast. A node being deleted (the cascade to its checks) has no row left to write.
  update public.nodes n set verification = v_state
  where n.id = v_node and n.verification is distinct from v_state;
  return null;
end;
$$;
comment on function private.note_node_verification() is 'Trigger: a (node, model) put under verification, dropped, or whose state changed sets its node''s verification (private.node_verification()), when that changes. Security definer: request_verification() and the service write model_checks, not nodes.';
revoke all on function private.note_node_verification() from public;
create trigger model_checks_note_node_insert_delete after insert or delete on public.model_checks
  for each row execute function private.note_node_verification();
create trigger model_checks_note_node_state after update of state on public.model_checks
  for each row when (old.state is distinct from new.state) execute function private.note_node_verification();

-- The nodes already under verification (the catalog's pinned SmolLM2, served before this migration).
update public.nodes n set verification = private.node_verification(n.id)
where exists (select 1 from public.model_checks c where c.node_id = n.id);

-- The map's node as Realtime sends it: with its verification.
create or replace function private.node_map_payload(n public.nodes) returns jsonb
  language sql stable set search_path = '' as $$
  -- What anyone may see of a node: the columns granted to anon, never endpoint_url, owner or secret.
  -- Its last beat and load: the later of its row's and the batches' (node_liveness).
  select jsonb_build_object(
    'id', n.id, 'name', n.name, 'gpu_model', n.gpu_model, 'gpu_count', n.gpu_count, 'vram_gb', n.vram_gb,
    'tflops', n.tflops, 'hourly_rate', n.hourly_rate, 'region', n.region, 'latitude', n.latitude,
    'longitude', n.longitude, 'status', n.status, 'max_concurrency', n.max_concurrency,
    'inflight', n.inflight, 'last_heartbeat_at', greatest(n.last_heartbeat_at, l.last_heartbeat_at),
    'missed_heartbeats', n.missed_heartbeats,
    'successes', n.successes, 'failures', n.failures, 'cooldown_until', n.cooldown_until,
    'gpu_utilization', case when l.last_heartbeat_at >= coalesce(n.last_heartbeat_at, '-infinity')
                            then l.gpu_utilization else n.gpu_utilization end,
    'free_vram_gb', case when l.last_heartbeat_at >= coalesce(n.last_heartbeat_at, '-infinity')
                         then l.free_vram_gb else n.free_vram_gb end,
    'queue_depth', n.queue_depth, 'verification', n.verification)
  from (select) one
  left join public.node_liveness l on l.node_id = n.id
$$;
comment on function private.node_map_payload(public.nodes) is 'A node as the public map may show it (the columns granted to anon), with its verification (the worst state of its models under verification).';

-- A change of verification is broadcast as the node's other changes are.
create or replace function private.broadcast_node_change() returns trigger
  language plpgsql security definer set search_path = '' as $$
declare
  v_node public.nodes;
  v_payload jsonb;
begin
  -- An update is broadcast when what the map or the owner sees changed (not the in-flight count).
  if tg_op = 'UPDATE' and (old.status, old.missed_heartbeats, old.cooldown_until, old.name, old.gpu_model,
                           old.gpu_count, old.vram_gb, old.tflops, old.hourly_rate, old.region, old.latitude,
                           old.longitude, old.max_concurrency, old.verification)
      is not distinct from (new.status, new.missed_heartbeats, new.cooldown_until, new.name, new.gpu_model,
                            new.gpu_count, new.vram_gb, new.tflops, new.hourly_rate, new.region, new.latitude,
                            new.longitude, new.max_concurrency, new.verification) then
    return null;
  end if;
  v_node := case when tg_op = 'DELETE' then old else new end;
  v_payload := jsonb_build_object('operation', tg_op, 'node', private.node_map_payload(v_node),
                                  'old_status', case when tg_op = 'UPDATE' then old.status end);
  perform realtime.send(v_payload, 'node_' || lower(tg_op), 'node-map', false);
  if v_node.owner_id is not null then
    perform realtime.send(
      -- The whole row but the secret, its last beat and load as the map's (the later of the two).
      v_payload || jsonb_build_object('node', to_jsonb(v_node) - 'secret_hash' || jsonb_build_object(
        'last_heartbeat_at', v_payload #> '{node,last_heartbeat_at}',
        'gpu_utilization', v_payload #> '{node,gpu_utilization}',
        'free_vram_gb', v_payload #> '{node,free_vram_gb}')),
      'node_' || lower(tg_op), 'owner:' || v_node.owner_id, true);
  end if;
  return null;
end;
$$;
comment on function private.broadcast_node_change() is 'Trigger: broadcasts a node''s status, health or verification change on node-map (public columns) and on its owner''s private topic (the whole row but the secret).';

-- The public map's rows (map_view(), node_list(), the table's rows by id): with the verification.
create or replace view public.node_map with (security_invoker = true) as
 SELECT n.id,
    n.name,
    n.gpu_model,
    n.gpu_count,
    n.vram_gb,
    n.tflops,
    n.hourly_rate,
    n.region,
    n.latitude,
    n.longitude,
    n.status,
    n.max_concurrency,
    n.inflight,
    GREATEST(n.last_heartbeat_at, max(l.last_heartbeat_at)) AS last_heartbeat_at,
    n.successes,
    n.failures,
    n.ewma_latency_ms,
    n.ewma_tokens_per_s,
    n.cooldown_until,
    COALESCE(array_agg(m.model_id ORDER BY m.model_id) FILTER (WHERE (m.state = 'loaded'::text)), '{}'::text[]) AS warm_models,
    COALESCE(array_agg(m.model_id ORDER BY m.model_id) FILTER (WHERE (m.state = 'available'::text)), '{}'::text[]) AS available_models,
    n.missed_heartbeats,
        CASE
            WHEN (max(l.last_heartbeat_at) >= COALESCE(n.last_heartbeat_at, '-infinity'::timestamp with time zone)) THEN max(l.gpu_utilization)
            ELSE n.gpu_utilization
        END AS gpu_utilization,
        CASE
            WHEN (max(l.last_heartbeat_at) >= COALESCE(n.last_heartbeat_at, '-infinity'::timestamp with time zone)) THEN max(l.free_vram_gb)
            ELSE n.free_vram_gb
        END AS free_vram_gb,
    n.queue_depth,
    n.verification
   FROM ((public.nodes n
     LEFT JOIN public.node_liveness l ON ((l.node_id = n.id)))
     LEFT JOIN public.node_models m ON ((m.node_id = n.id)))
  GROUP BY n.id;
comment on view public.node_map is 'The public node map: what anyone may see of each node (no endpoint, no owner), with its models, its load and its verification (the worst state of its models under verification: failed, suspect, unverified, verified; null when none is). `select *` works for anon and authenticated.';

-- An owner's nodes through the Data API (`neuralgrid nodes ls` signed in): with the verification.
drop function public.my_nodes();
create function public.my_nodes()
  returns table (id uuid, name text, status text, endpoint_url text, tunnel_connected boolean, backend_up boolean,
                 backend jsonb, routes text[], gpu_model text, gpu_count integer, vram_gb real, tflops real,
                 hourly_rate numeric, region text, latitude double precision, longitude double precision,
                 max_concurrency integer, inflight integer, queue_depth integer,
                 last_heartbeat_at timestamp with time zone, successes bigint, failures bigint,
                 ewma_latency_ms real, ewma_tokens_per_s real, cooldown_until timestamp with time zone,
                 warm_models text[], available_models text[], agent_version text,
                 created_at timestamp with time zone, verification text)
  language sql stable set search_path = '' as $$
  -- As the caller: the owner filter keeps it to their rows, and the endpoints' policy would too. The
  -- last heartbeat: the later of the row's and the batches' (node_liveness).
  select n.id, n.name, n.status, e.endpoint_url, n.tunnel_connected, n.backend_up, n.backend, n.routes,
         n.gpu_model, n.gpu_count, n.vram_gb, n.tflops, n.hourly_rate, n.region, n.latitude, n.longitude,
         n.max_concurrency, n.inflight, n.queue_depth, greatest(n.last_heartbeat_at, l.last_heartbeat_at),
         n.successes, n.failures, n.ewma_latency_ms, n.ewma_tokens_per_s, n.cooldown_until,
         coalesce((select array_agg(m.model_id order by m.model_id) from public.node_models m
                   where m.node_id = n.id and m.state = 'loaded'), '{}'),
         coalesce((select array_agg(m.model_id order by m.model_id) from public.node_models m
                   where m.node_id = n.id and m.state = 'available'), '{}'),
         n.agent_version, n.created_at, n.verification
  from public.nodes n
  left join public.node_endpoints e on e.node_id = n.id
  left join public.node_liveness l on l.node_id = n.id
  where n.owner_id = (select auth.uid())
  order by n.name, n.id
$$;
comment on function public.my_nodes() is 'The signed-in owner''s nodes, each with what the map shows and what only its owner may see: endpoint_url (how the platform reaches it, from node_endpoints), whether its tunnel is connected and its server answers, the server found behind it (backend) and its routes; and its verification (the worst state of its models under verification; each model''s: my_model_checks()). Runs as its caller. Uptime, earnings and reputation: my_node_stats().';
revoke all on function public.my_nodes() from public, anon, authenticated, service_role;
grant execute on function public.my_nodes() to authenticated, service_role;
