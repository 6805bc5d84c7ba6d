-- A node's slots follow its server, and a heartbeat and node_heartbeat() share one warm-model sync;
-- a key that registers a node is in use.
--
-- Found as an owner with a real llama-server: restarted with another -np, a node kept the slot
-- count it registered with (registration alone set max_concurrency), so the platform sent it half
-- the work it could run, or twice what it runs at once. The agent now finds the server again when
-- it is back and says the requests it runs at once in its heartbeat's specs (max_concurrency).
--
-- A lowered count may be below what the node holds now (4 running, restarted to 2): those requests
-- end as they would, and no new one is claimed until fewer than the new count run. So the rule on
-- inflight is that it is not negative; claim_node() already claims only below max_concurrency.

alter table public.nodes
  drop constraint "inflight must be between 0 and max_concurrency",
  add constraint "inflight must not be negative" check (inflight >= 0);

create function private.sync_warm_models(p_node_id uuid, p_loaded_models text[])
returns void
language sql
set search_path = ''
as $$
  insert into public.node_models (node_id, model_id, state)
  select p_node_id, m, 'loaded' from unnest(p_loaded_models) as m
  on conflict (node_id, model_id) do update set state = 'loaded' where public.node_models.state <> 'loaded';
  update public.node_models nm set state = 'available'
  where nm.node_id = p_node_id and nm.state = 'loaded' and nm.model_id <> all (p_loaded_models);
$$;
comment on function private.sync_warm_models(uuid, text[]) is 'A heartbeat''s warm models: the node''s models in p_loaded_models are loaded, its other loaded ones available (still on disk, a cold start away). Rows change only where their state does.';
revoke execute on function private.sync_warm_models(uuid, text[]) from public, anon, authenticated;
grant execute on function private.sync_warm_models(uuid, text[]) to service_role;

create or replace function public.node_heartbeat(p_node_id uuid, p_loaded_models text[] default null)
returns text
language plpgsql
set search_path = ''
as $$
declare
  v_status text;
begin
  update public.nodes n
  set last_heartbeat_at = now(), missed_heartbeats = 0,
      status = case when n.status = 'offline' then 'online' else n.status end
  where n.id = p_node_id
  returning n.status into v_status;
  if not found then
    raise exception 'no node %', p_node_id using errcode = 'no_data_found';
  end if;
  if p_loaded_models is not null then
    perform private.sync_warm_models(p_node_id, p_loaded_models);
  end if;
  return v_status;
end;
$$;

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
  v_slots integer;
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
  v_loaded := case when coalesce(p_backend_up, true) then p_loaded_models else '{}' end;
  if v_loaded is not null then
    perform private.sync_warm_models(p_node_id, v_loaded);
  end if;
  v_slots := coalesce((p_specs ->> 'max_concurrency')::integer, v_node.max_concurrency);
  update public.nodes n
  set last_heartbeat_at = now(), missed_heartbeats = 0,
      gpu_model = coalesce(p_specs ->> 'gpu_model', n.gpu_model),
      gpu_count = coalesce((p_specs ->> 'gpu_count')::integer, n.gpu_count),
      vram_gb = coalesce((p_specs ->> 'vram_gb')::real, n.vram_gb),
      tflops = coalesce((p_specs ->> 'tflops')::real, n.tflops),
      max_concurrency = v_slots,
      queue_depth = p_queue_depth, gpu_utilization = p_gpu_utilization, free_vram_gb = p_free_vram_gb,
      backend_up = coalesce(p_backend_up, true),
      backend = coalesce(p_backend, n.backend),
      status = case
        when p_status <> 'online' then p_status  -- draining or offline, as the agent says
        when not coalesce(p_backend_up, true) then 'offline'  -- a live agent in front of a dead server
        -- A tunnel node is reachable only while its tunnel is connected to a gateway.
        when v_node.endpoint_url like 'tunnel:%' and not v_node.tunnel_connected then 'offline'
        when n.inflight >= v_slots then 'busy'  -- the platform's word for full (slots lowered, too)
        else 'online'
      end
  where n.id = p_node_id
  returning n.status into v_node.status;
  return v_node.status;
end;
$$;

comment on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb) is 'A node agent''s heartbeat, authenticated by its secret''s hash: status (online, draining, offline; changed once a beat), load, warm models, specs when they changed (its GPUs, and max_concurrency: the requests its server runs at once), whether its inference server answers and, when it changed, what the agent found of it. Returns the node''s status.';

-- Found by an owner's trial: `keys ls` showed the key an owner's nodes registered with as never
-- used. A registration is a use of the key.
create or replace function public.register_node(
  p_owner_id uuid,
  p_name text,
  p_gpu_model text,
  p_gpu_count integer,
  p_vram_gb real,
  p_tflops real,
  p_hourly_rate numeric,
  p_region text,
  p_latitude double precision,
  p_longitude double precision,
  p_endpoint_url text,
  p_max_concurrency integer,
  p_models text[],
  p_agent_version text,
  p_api_key_id uuid,
  p_backend jsonb
) returns table (node_id uuid, node_secret text)
language plpgsql
set search_path = ''
as $$
declare
  v_node record;
begin
  select r.node_id, r.node_secret into v_node
  from public.register_node(p_owner_id, p_name, p_gpu_model, p_gpu_count, p_vram_gb, p_tflops, p_hourly_rate,
                            p_region, p_latitude, p_longitude, p_endpoint_url, p_max_concurrency, p_models,
                            p_agent_version, p_api_key_id) r;
  update public.nodes n set backend = coalesce(p_backend, '{}'), backend_up = true, tunnel_connected = false
  where n.id = v_node.node_id;
  update public.api_keys k set last_used_at = now() where k.id = p_api_key_id;
  return query select v_node.node_id, v_node.node_secret;
end;
$$;
