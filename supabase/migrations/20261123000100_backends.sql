-- What a node's agent found behind it: the inference server's kind and the capabilities it verified,
-- whether that server answers, and whether a tunnel node's tunnel is connected. Status follows from
-- these facts in SQL: a node is online only while its agent beats, its server answers and (for a
-- tunnel node) its tunnel is up. A request that two nodes fail the same way is the request's fault,
-- not the nodes'.

alter table public.nodes
  add column backend jsonb not null default '{}',
  add column backend_up boolean not null default true,
  add column tunnel_connected boolean not null default false,
  add constraint "backend must be a JSON object of at most 4 kB" check (
    jsonb_typeof(backend) = 'object' and octet_length(backend::text) <= 4096
  );
comment on column public.nodes.backend is 'The inference server behind the node as its agent found it: kind, version, parallel (requests it runs at once), usage_in_streams, tokenize, interrupts, and continues, true only when the agent verified that the server goes on with an open assistant message (the gateway resumes chat streams on such nodes alone).';
comment on column public.nodes.backend_up is 'False while the agent reports its inference server dead: the node is offline however alive its agent is.';
comment on column public.nodes.tunnel_connected is 'A tunnel node''s tunnel is connected to a gateway (set by set_tunnel()); it is reachable only then.';
grant select (backend, backend_up) on table public.nodes to anon, authenticated;
-- Tunnel nodes online now have their tunnel up (the heartbeat reads this from here on).
update public.nodes set tunnel_connected = true where endpoint_url like 'tunnel:%' and status <> 'offline';

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
  return query select v_node.node_id, v_node.node_secret;
end;
$$;
comment on function public.register_node(uuid, text, text, integer, real, real, numeric, text, double precision, double precision, text, integer, text[], text, uuid, jsonb) is 'Registers (or re-registers by name) an owner''s node with its specs, warm models and what its agent found of its inference server; returns its id and a new secret, shown once.';
revoke execute on function public.register_node(uuid, text, text, integer, real, real, numeric, text, double precision, double precision, text, integer, text[], text, uuid, jsonb) from public, anon, authenticated;
grant execute on function public.register_node(uuid, text, text, integer, real, real, numeric, text, double precision, double precision, text, integer, text[], text, uuid, jsonb) to service_role;

create function public.agent_heartbeat(
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
  perform public.node_heartbeat(p_node_id, case when coalesce(p_backend_up, true) then p_loaded_models else '{}' end);
  update public.nodes n
  set gpu_model = coalesce(p_specs ->> 'gpu_model', n.gpu_model),
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
comment on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb) is 'A node agent''s heartbeat, authenticated by its secret''s hash: status (online, draining, offline), load, warm models, specs when they changed, whether its inference server answers and, when it changed, what the agent found of it. Returns the node''s status.';
revoke execute on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb) from public, anon, authenticated;
grant execute on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb) to service_role;

-- Agents of the earlier version keep working: their heartbeat says nothing of the server behind them.
create or replace function public.agent_heartbeat(
  p_node_id uuid,
  p_secret_hash bytea,
  p_status text,
  p_queue_depth integer,
  p_gpu_utilization real,
  p_free_vram_gb real,
  p_loaded_models text[],
  p_specs jsonb default null
) returns text
language sql
set search_path = ''
as $$
  select public.agent_heartbeat(p_node_id, p_secret_hash, p_status, p_queue_depth, p_gpu_utilization,
                                p_free_vram_gb, p_loaded_models, p_specs, null::boolean, null::jsonb)
$$;

create function public.set_tunnel(p_node_id uuid, p_connected boolean)
returns text
language plpgsql
set search_path = ''
as $$
declare
  v_status text;
begin
  -- Connected: the node is reachable (and fresh) if its server is up; dropped: unreachable at once.
  update public.nodes n
  set tunnel_connected = p_connected,
      status = case
        when p_connected and n.status = 'offline' and n.backend_up then 'online'
        when not p_connected and n.status <> 'offline' then 'offline'
        else n.status
      end,
      last_heartbeat_at = case when p_connected then now() else n.last_heartbeat_at end,
      missed_heartbeats = case when p_connected then 0 else n.missed_heartbeats end
  where n.id = p_node_id and n.endpoint_url like 'tunnel:%'
  returning n.status into v_status;
  if not found then
    raise exception 'no tunnel node %', p_node_id using errcode = 'no_data_found';
  end if;
  return v_status;
end;
$$;
comment on function public.set_tunnel(uuid, boolean) is 'Records that a tunnel node''s tunnel connected to a gateway (online if its server is up) or dropped (offline at once); returns the node''s status.';
revoke execute on function public.set_tunnel(uuid, boolean) from public, anon, authenticated;
grant execute on function public.set_tunnel(uuid, boolean) to service_role;

create function public.reject_job(p_job_id uuid, p_error text, p_http_status integer default null)
returns void
language plpgsql
set search_path = ''
as $$
begin
  -- Two nodes failed this request the same way: the request is at fault. The running attempt ends
  -- neutral, the earlier attempts that failed the same way are forgiven (their failure and the
  -- cooldown it started undone), and the job ends cancelled, charging nothing.
  perform public.end_attempt(p_job_id, 'cancelled', p_error, p_http_status);
  with forgiven as (
    update public.job_attempts a set status = 'cancelled'
    where a.job_id = p_job_id and a.status = 'failed' and a.error = p_error
    returning a.node_id
  )
  update public.nodes n
  set failures = greatest(n.failures - 1, 0),
      consecutive_failures = greatest(n.consecutive_failures - 1, 0),
      cooldown_until = case when n.consecutive_failures <= 1 then null else n.cooldown_until end
  from forgiven f
  where n.id = f.node_id;
  update public.jobs j set status = 'cancelled', error = p_error, finished_at = now() where j.id = p_job_id;
  perform public.release_reservation(p_job_id, 0);
end;
$$;
comment on function public.reject_job(uuid, text, integer) is 'Ends a job whose request two nodes failed the same way: the request''s fault, so its attempts are neutral for the nodes (earlier failures with the same error forgiven) and nothing is charged.';
revoke execute on function public.reject_job(uuid, text, integer) from public, anon, authenticated;
grant execute on function public.reject_job(uuid, text, integer) to service_role;

create function public.continuing_nodes(p_candidates uuid[])
returns uuid[]
language sql stable
set search_path = ''
as $$
  -- In the candidates' order: only these may go on with a chat stream another node dropped.
  select coalesce(array_agg(c.id order by c.ord), '{}')
  from unnest(p_candidates) with ordinality as c (id, ord)
  join public.nodes n on n.id = c.id
  where coalesce((n.backend ->> 'continues')::boolean, false)
$$;
comment on function public.continuing_nodes(uuid[]) is 'The candidates (in order) whose agent verified that their server continues an open assistant message: the only nodes a dropped chat stream may resume on.';
revoke execute on function public.continuing_nodes(uuid[]) from public, anon, authenticated;
grant execute on function public.continuing_nodes(uuid[]) to service_role;

insert into public.models (id, min_vram_gb, context_length, kind, input_usd_per_mtok, output_usd_per_mtok,
                           cold_start_s, tokens_per_s_per_tflop) values
  ('HuggingFaceTB/SmolLM2-135M-Instruct', 0.5, 8192, 'chat', 0.01, 0.02, 2, 2.0);
