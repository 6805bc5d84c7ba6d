-- A heartbeat changes a node's status once, and a server restarted with another model is not
-- sent requests for the one it had.
--
-- Found trying the product as a GPU owner, with a real llama-server (reproduced twice each):
-- - While a node's server was down, the node went offline -> online -> offline on every beat (two
--   rows in node_status_changes and two Realtime events each 5 s): agent_heartbeat() called
--   node_heartbeat(), which brings an offline node back, before its own update took it out again.
--   It now does node_heartbeat()'s work itself, and sets the status once.
-- - A server restarted with another model kept the first one's node_models row as 'available', so
--   the matcher sent that model's requests to a server that answered them with the other model.
--   The agent now says a server that serves what it started with can load nothing on demand
--   (available: [], agent/run.py), and the pre-warm overload forgets its other models.

create or replace function public.agent_heartbeat(
  p_node_id uuid,
  p_secret_hash bytea,
  p_status text,
  p_queue_depth integer,
  p_gpu_utilization real,
  p_free_vram_gb real,
  p_loaded_models text[],
  p_specs jsonb,
  p_backend_up boolean,
  p_backend jsonb
) returns text
language plpgsql
set search_path = ''
as $$
declare
  v_node public.nodes;
  v_loaded text[];
begin
  if p_status not in ('online', 'draining', 'offline') then
    raise exception 'an agent reports online, draining or offline, not "%"', p_status
      using errcode = 'invalid_parameter_value';
  end if;
  if p_backend is not null and jsonb_typeof(p_backend) <> 'object' then
    raise exception 'backend must be a JSON object' using errcode = 'invalid_parameter_value';
  end if;
  select * into v_node from public.nodes n where n.id = p_node_id for update;
  if not found then
    raise exception 'no node %', p_node_id using errcode = 'no_data_found';
  end if;
  if v_node.secret_hash is null or v_node.secret_hash <> p_secret_hash then
    raise exception 'this secret does not belong to node %', p_node_id using errcode = 'insufficient_privilege';
  end if;
  -- A dead server reports no warm model: nothing is warm until its agent has warmed it up again.
  -- (node_heartbeat()'s work, but for the status: it set an offline node online, and the update
  -- below set it offline again when its server was down, two changes a beat on the map.)
  v_loaded := case when coalesce(p_backend_up, true) then p_loaded_models else '{}' end;
  if v_loaded is not null then
    insert into public.node_models (node_id, model_id, state)
    select p_node_id, m, 'loaded' from unnest(v_loaded) as m
    on conflict (node_id, model_id) do update set state = 'loaded' where public.node_models.state <> 'loaded';
    update public.node_models nm set state = 'available'
    where nm.node_id = p_node_id and nm.state = 'loaded' and nm.model_id <> all (v_loaded);
  end if;
  update public.nodes n
  set last_heartbeat_at = now(), missed_heartbeats = 0,
      gpu_model = coalesce(p_specs ->> 'gpu_model', n.gpu_model),
      gpu_count = coalesce((p_specs ->> 'gpu_count')::integer, n.gpu_count),
      vram_gb = coalesce((p_specs ->> 'vram_gb')::real, n.vram_gb),
      tflops = coalesce((p_specs ->> 'tflops')::real, n.tflops),
      queue_depth = p_queue_depth, gpu_utilization = p_gpu_utilization, free_vram_gb = p_free_vram_gb,
      backend_up = coalesce(p_backend_up, true),
      backend = coalesce(p_backend, n.backend),
      status = case
        when p_status <> 'online' then p_status  -- draining or offline, as the agent says
        when not coalesce(p_backend_up, true) then 'offline'  -- a live agent in front of a dead server
        -- A tunnel node is reachable only while its tunnel is connected to a gateway.
        when v_node.endpoint_url like 'tunnel:%' and not v_node.tunnel_connected then 'offline'
        when v_node.status = 'busy' then 'busy'  -- the platform's word for full
        else 'online'
      end
  where n.id = p_node_id
  returning n.status into v_node.status;
  return v_node.status;
end;
$$;

comment on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb) is 'A node agent''s heartbeat, authenticated by its secret''s hash: status (online, draining, offline; changed once a beat), load, warm models, specs when they changed, whether its inference server answers and, when it changed, what the agent found of it. Returns the node''s status.';
