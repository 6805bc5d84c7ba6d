-- A node agent's heartbeat that anon may send, authenticated by the node's secret in SQL: the Edge
-- Function `heartbeat` (supabase/functions/heartbeat/) calls it as anon, and a node may call it
-- through the Data API (POST /rest/v1/rpc/agent_heartbeat_with_secret) with the project's
-- publishable key. Either way a direct-mode node stays alive through Supabase alone, with neither a
-- self-hosted gateway nor the service-role key.
--
-- The secret travels in the clear (over TLS, as to the gateway) and is hashed here: what is stored
-- (nodes.secret_hash) is not itself enough to heartbeat, unlike agent_heartbeat()'s p_secret_hash,
-- which only trusted callers (service_role: the gateway) may pass.

create function public.agent_heartbeat_with_secret(
  p_node_id uuid,
  p_secret text,
  p_status text default 'online',
  p_queue_depth integer default 0,
  p_gpu_utilization real default null,
  p_free_vram_gb real default null,
  p_loaded_models text[] default '{}',
  p_specs jsonb default null,
  p_backend_up boolean default true,
  p_backend jsonb default null,
  p_available_models text[] default null,
  p_prewarm_loaded text[] default '{}',
  p_prewarm_refused jsonb default '[]'
) returns table (status text, load text[])
language plpgsql
-- Definer: anon may neither read secret_hash nor write nodes; the secret is the whole proof, and
-- nothing happens before it is checked.
security definer
set search_path = ''
as $$
declare
  v_hash bytea;
begin
  select n.secret_hash into v_hash from public.nodes n where n.id = p_node_id;
  if not found then
    raise exception 'no node %', p_node_id using errcode = 'no_data_found';
  end if;
  if p_secret is null or v_hash is null or v_hash <> sha256(convert_to(p_secret, 'UTF8')) then
    raise exception 'this secret does not belong to node %', p_node_id
      using errcode = 'invalid_authorization_specification';
  end if;
  -- The bounds the gateway checks (neuralgrid/protocol/nodes.py) for callers that come through
  -- the Data API; the rest (status, backend, specs) agent_heartbeat() checks itself.
  if p_status is null or p_queue_depth is null or p_queue_depth not between 0 and 1000000
     or p_gpu_utilization not between 0 and 1 or p_free_vram_gb not between 0 and 100000
     or cardinality(p_loaded_models) > 1000 or cardinality(p_available_models) > 1000
     or cardinality(p_prewarm_loaded) > 16
     or (p_prewarm_refused is not null and jsonb_typeof(p_prewarm_refused) <> 'array')
     or jsonb_array_length(coalesce(p_prewarm_refused, '[]')) > 16 then
    raise exception 'a heartbeat out of bounds (status, queue depth, utilization, free VRAM or list lengths)'
      using errcode = 'invalid_parameter_value';
  end if;
  return query
  select h.status, h.load
  from public.agent_heartbeat(p_node_id, sha256(convert_to(p_secret, 'UTF8')), p_status, p_queue_depth,
                              p_gpu_utilization, p_free_vram_gb, coalesce(p_loaded_models, '{}'), p_specs,
                              coalesce(p_backend_up, true), p_backend, p_available_models,
                              coalesce(p_prewarm_loaded, '{}'), coalesce(p_prewarm_refused, '[]')) h;
end;
$$;
comment on function public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) is 'A node agent''s heartbeat authenticated by the node''s secret itself (hashed and checked here, SQLSTATE 28000 when it is not the node''s), for callers without the service role: the Edge Function heartbeat and the Data API, as anon. Records what agent_heartbeat() records (status, load, warm and available models, specs, server, pre-warm answers) and returns the node''s status and the models it should load now.';
-- anon only (and the service): a node carries no user's JWT, and a signed-in user needs no such
-- path. Its own grant, not the default privileges', so the intent is written here.
revoke execute on function public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) from public, anon, authenticated;
grant execute on function public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) to anon, service_role;
