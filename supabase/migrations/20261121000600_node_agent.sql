-- Node agents: a per-node secret (hashed), registration, authenticated heartbeats carrying load, and
-- the sweeper on pg_cron where the extension is installed.

create function public.register_node(
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
  p_agent_version text default null,
  p_api_key_id uuid default null
) returns table (node_id uuid, node_secret text)
language plpgsql
set search_path = ''
as $$
declare
  -- 244 random bits, like API keys; shown once, stored as its SHA-256.
  v_secret text := 'ngn-' || encode(uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()), 'hex');
  v_id uuid;
begin
  insert into public.nodes as n (owner_id, name, gpu_model, gpu_count, vram_gb, tflops, hourly_rate, region,
                                 latitude, longitude, endpoint_url, max_concurrency, secret_hash, agent_version,
                                 registered_by_key, status, last_heartbeat_at)
  values (p_owner_id, p_name, p_gpu_model, p_gpu_count, p_vram_gb, p_tflops, p_hourly_rate, p_region,
          p_latitude, p_longitude, p_endpoint_url, p_max_concurrency, sha256(convert_to(v_secret, 'UTF8')),
          p_agent_version, p_api_key_id, case when p_endpoint_url like 'tunnel:%' then 'offline' else 'online' end,
          now())
  -- Registering the same name again (a reinstall) takes the node over with a new secret. A tunnel
  -- node is offline until its tunnel connects.
  on conflict (owner_id, name) do update set
    gpu_model = excluded.gpu_model, gpu_count = excluded.gpu_count, vram_gb = excluded.vram_gb,
    tflops = excluded.tflops, hourly_rate = excluded.hourly_rate, region = excluded.region,
    latitude = excluded.latitude, longitude = excluded.longitude, endpoint_url = excluded.endpoint_url,
    max_concurrency = excluded.max_concurrency, secret_hash = excluded.secret_hash,
    agent_version = excluded.agent_version, status = excluded.status, last_heartbeat_at = now()
  -- Only its owner (or, for owner-less nodes, the key that registered it) may take a node over.
  where n.owner_id is not null or n.registered_by_key is not distinct from excluded.registered_by_key
  returning n.id into v_id;
  if v_id is null then
    raise exception 'a node named "%" is already registered by someone else', p_name using errcode = 'unique_violation';
  end if;
  delete from public.node_models nm where nm.node_id = v_id and nm.model_id <> all (p_models);
  insert into public.node_models (node_id, model_id, state)
  select v_id, m, 'loaded' from unnest(p_models) as m
  on conflict on constraint node_models_pkey do update set state = 'loaded';
  return query select v_id, v_secret;
end;
$$;
comment on function public.register_node(uuid, text, text, integer, real, real, numeric, text, double precision, double precision, text, integer, text[], text, uuid) is 'Registers (or re-registers by name) an owner''s node with its specs and warm models; returns its id and a new secret, shown once.';
revoke execute on function public.register_node(uuid, text, text, integer, real, real, numeric, text, double precision, double precision, text, integer, text[], text, uuid) from public, anon, authenticated;
grant execute on function public.register_node(uuid, text, text, integer, real, real, numeric, text, double precision, double precision, text, integer, text[], text, uuid) to service_role;

create function public.agent_heartbeat(
  p_node_id uuid,
  p_secret_hash bytea,
  p_status text,
  p_queue_depth integer,
  p_gpu_utilization real,
  p_free_vram_gb real,
  p_loaded_models text[],
  p_specs jsonb default null
) returns text
language plpgsql
set search_path = ''
as $$
declare
  v_node public.nodes;
begin
  if p_status not in ('online', 'draining', 'offline') then
    raise exception 'an agent reports online, draining or offline, not "%"', p_status
      using errcode = 'invalid_parameter_value';
  end if;
  select * into v_node from public.nodes n where n.id = p_node_id for update;
  if not found then
    raise exception 'no node %', p_node_id using errcode = 'no_data_found';
  end if;
  if v_node.secret_hash is null or v_node.secret_hash <> p_secret_hash then
    raise exception 'this secret does not belong to node %', p_node_id using errcode = 'insufficient_privilege';
  end if;
  perform public.node_heartbeat(p_node_id, p_loaded_models);
  if p_specs is not null then  -- the machine changed (a GPU added or swapped): re-reported specs
    update public.nodes n
    set gpu_model = coalesce(p_specs ->> 'gpu_model', n.gpu_model),
        gpu_count = coalesce((p_specs ->> 'gpu_count')::integer, n.gpu_count),
        vram_gb = coalesce((p_specs ->> 'vram_gb')::real, n.vram_gb),
        tflops = coalesce((p_specs ->> 'tflops')::real, n.tflops)
    where n.id = p_node_id;
  end if;
  update public.nodes n
  set queue_depth = p_queue_depth, gpu_utilization = p_gpu_utilization, free_vram_gb = p_free_vram_gb,
      status = case
        when p_status <> 'online' then p_status  -- draining or offline, as the agent says
        -- A tunnel node is reachable only while its tunnel is up: the gateway holding the socket
        -- says so, not the heartbeat.
        when v_node.endpoint_url like 'tunnel:%' then v_node.status
        when v_node.status = 'busy' then 'busy'  -- the platform's word for full
        else 'online'
      end
  where n.id = p_node_id
  returning n.status into v_node.status;
  return v_node.status;
end;
$$;
comment on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb) is 'A node agent''s heartbeat, authenticated by its secret''s hash: status (online, draining, offline), load, warm models and, when they changed, specs.';
revoke execute on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb) from public, anon, authenticated;
grant execute on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb) to service_role;

-- pg_cron's schedule of the sweep is made by public.schedule_sweep() (20261129000300_sweep_schedule.sql),
-- for every version of pg_cron, enabled before the push or after it. (This migration scheduled it
-- in seconds, which failed the push on pg_cron < 1.5.)

create function public.sweep_stale_jobs(p_max_age interval default interval '1 hour')
returns table (job_id uuid)
language plpgsql
set search_path = ''
as $$
declare
  v_job uuid;
begin
  -- A job whose completion never came (a gateway crashed, a write was lost) would hold its node's
  -- slot and its key's budget forever: end it as failed, which gives both back.
  for v_job in
    select j.id from public.jobs j
    where j.status = 'running' and j.created_at < now() - p_max_age
    for update skip locked
  loop
    perform public.end_attempt(v_job, 'cancelled', 'abandoned: no completion within ' || p_max_age::text);
    update public.jobs j set status = 'failed', error = 'abandoned: no completion within ' || p_max_age::text,
      finished_at = now() where j.id = v_job;
    perform public.release_reservation(v_job, 0);
    job_id := v_job;
    return next;
  end loop;
end;
$$;
comment on function public.sweep_stale_jobs(interval) is 'Ends jobs still running after p_max_age (their completion was lost), giving back node slots and budget holds.';
revoke execute on function public.sweep_stale_jobs(interval) from public, anon, authenticated;
grant execute on function public.sweep_stale_jobs(interval) to service_role;
