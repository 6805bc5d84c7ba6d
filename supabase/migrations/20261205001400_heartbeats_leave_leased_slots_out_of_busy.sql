-- Leases (issue 42): a heartbeat does not call a node busy for slots its leases hold.
--
-- A node's status follows its load at each heartbeat: busy once inflight reaches its slots. inflight
-- counts the slots gateways lease, in use or not, so a node leased whole read busy after its next
-- beat (the conformance suite saw it: a one-slot llama-server, idle, busy). Busy is for slots held by
-- placed jobs, as move_lease_slots() already keeps it; claims still check inflight, which counts all.

create function private.leased_slots(p_node_id uuid) returns integer
language sql stable
set search_path = ''
as $$
  select coalesce(sum(l.slots), 0)::integer from private.slot_leases l where l.node_id = p_node_id
$$;
comment on function private.leased_slots(uuid) is 'The slots gateways lease on a node (counted in its inflight): what a heartbeat leaves out when it says whether the node is busy.';
revoke execute on function private.leased_slots(uuid) from public, anon, authenticated;
grant execute on function private.leased_slots(uuid) to service_role;

create or replace function public.agent_heartbeat(p_node_id uuid, p_secret_hash bytea, p_status text, p_queue_depth integer, p_gpu_utilization real, p_free_vram_gb real, p_loaded_models text[], p_specs jsonb, p_backend_up boolean, p_backend jsonb) RETURNS text
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
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
        when n.inflight - private.leased_slots(n.id) >= v_slots then 'busy'  -- the platform's word for full (slots lowered, too)
        else 'online'
      end
  where n.id = p_node_id
  returning n.status into v_node.status;
  return v_node.status;
end;
$$;

create or replace function public.node_heartbeats(p_beats jsonb) RETURNS TABLE(node_id uuid, status text, load text[], error text, error_code text)
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_quiet uuid[];         -- beats that change nothing: node_liveness only
  v_quiet_at timestamptz[];
  v_quiet_status text[];
  v_quiet_said text[];    -- the status each agent said (the reply's load needs it)
  v_quiet_utilization real[];  -- the load each said (node_liveness keeps it)
  v_quiet_free real[];
  v_warm uuid[];          -- quiet beats that pre-warm must see
  v_warm_models text[];   -- a JSON array of each one's warm models (as text: arrays of arrays are not)
  v_change integer[];     -- the ordinals of beats that change something, by node
  v_change_at timestamptz[];
  v_refused uuid[];       -- beats refused outright
  v_refusal text[];
  v_refusal_code text[];
  v_beat jsonb;
  v_node uuid;
  v_status text;
  v_load text[];
  v_said text;
  i integer;
  k integer;
begin
  if jsonb_typeof(p_beats) is distinct from 'array' then
    raise exception 'beats must be a JSON array of heartbeats' using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_array_length(p_beats) > 10000 then
    raise exception 'at most 10000 heartbeats a call, not %', jsonb_array_length(p_beats)
      using errcode = 'invalid_parameter_value';
  end if;
  if exists (select from jsonb_array_elements(p_beats) e where jsonb_typeof(e) <> 'object'
                                                             or jsonb_typeof(e -> 'node_id') is distinct from 'string') then
    raise exception 'each heartbeat is a JSON object with its node_id' using errcode = 'invalid_parameter_value';
  end if;
  if (select count(distinct e ->> 'node_id') <> count(*) from jsonb_array_elements(p_beats) e) then
    raise exception 'a node''s heartbeat at most once a call' using errcode = 'invalid_parameter_value';
  end if;

  -- Each beat against its node's row, read once without a lock: refused (no such node, not its
  -- secret), quiet (what agent_heartbeat() would write is what the rows hold) or a change.
  with beat as (
    select b.*, x.ord,
           -- What agent_heartbeat() syncs: a dead server's node has nothing warm.
           case when coalesce(b.backend_up, true) then b.models else '{}'::text[] end as warm
    from jsonb_array_elements(p_beats) with ordinality as x (beat, ord)
    cross join lateral jsonb_to_record(x.beat) as b (
      node_id uuid, key text, age_ms integer, status text, queue_depth integer, gpu_utilization real,
      free_vram_gb real, models text[], specs jsonb, backend_up boolean, backend jsonb, available text[],
      loaded text[], refused jsonb)
  ), judged as materialized (  -- once a beat: the aggregates below each read its verdict
    select b.node_id, b.ord, b.status as said, b.warm, n.status as node_status, b.gpu_utilization,
           b.free_vram_gb,
           case
             when n.id is null then 'gone'
             when n.secret_hash is null or b.key is null or n.secret_hash <> decode(b.key, 'hex') then 'denied'
             -- A node's first beat here writes its row under the node's lock (below): its key is
             -- checked against nodes then, and no check ever waits on a claim's lock.
             when l.node_id is not null and b.specs is null and b.backend is null
                  and coalesce(cardinality(b.loaded), 0) = 0
                  and (b.refused is null or b.refused in ('null', '[]'))
                  and b.status in ('online', 'draining', 'offline')
                  and n.missed_heartbeats = 0
                  and n.queue_depth = b.queue_depth
                  -- Its GPU's utilization and free VRAM change nearly every beat on a real GPU:
                  -- node_liveness keeps them (a load out of bounds is refused as a change, below).
                  and (b.gpu_utilization is null or b.gpu_utilization between 0 and 1)
                  and (b.free_vram_gb is null or (b.free_vram_gb >= 0 and b.free_vram_gb <> 'NaN'))
                  and n.backend_up = coalesce(b.backend_up, true)
                  and n.status = case
                    when b.status <> 'online' then b.status
                    when not coalesce(b.backend_up, true) then 'offline'
                    when n.endpoint_url like 'tunnel:%' and not n.tunnel_connected then 'offline'
                    when n.inflight - private.leased_slots(n.id) >= n.max_concurrency then 'busy'
                    else 'online'
                  end
                  -- Warm models as reported: each loaded, no other loaded.
                  and (b.warm is null or (
                    not exists (select from unnest(b.warm) m
                                where not exists (select from public.node_models nm
                                                  where nm.node_id = n.id and nm.model_id = m and nm.state = 'loaded'))
                    and not exists (select from public.node_models nm
                                    where nm.node_id = n.id and nm.state = 'loaded' and nm.model_id <> all (b.warm))))
                  -- Models the server can load, when said: each held, no other held as available.
                  and (b.available is null or not coalesce(b.backend_up, true) or (
                    not exists (select from unnest(b.available) m
                                where m <> all (coalesce(b.models, '{}'))
                                  and not exists (select from public.node_models nm
                                                  where nm.node_id = n.id and nm.model_id = m))
                    and not exists (select from public.node_models nm
                                    where nm.node_id = n.id and nm.state = 'available'
                                      and nm.model_id <> all (b.available))))
               then 'quiet'
             else 'change'
           end as kind,
           -- The quiet beats pre-warm must see: an open request to answer or repeat, or an idle node
           -- that could load a model while one is wanted or the demand is due (prewarm_for()'s test).
           n.id is not null and (
             exists (select from public.prewarm_requests r where r.node_id = n.id and r.outcome = 'requested')
             or (s.prewarm_enabled and n.status = 'online' and n.backend_up and n.inflight = 0 and n.queue_depth = 0
                 and (n.cooldown_until is null or n.cooldown_until <= now())
                 and exists (select from public.node_models nm where nm.node_id = n.id and nm.state = 'available')
                 and (c.refreshed_at < now() - make_interval(secs => s.prewarm_refresh_s)
                      or exists (select from private.prewarm_demand d where d.wanted)))) as warms,
           -- When the gateway heard it: its age there, counted back from now (the database's clock).
           now() - make_interval(secs => least(greatest(coalesce(b.age_ms, 0), 0), 60000) / 1000.0) as heard_at
    from beat b
    left join public.nodes n on n.id = b.node_id
    left join public.node_liveness l on l.node_id = b.node_id
    cross join public.platform_settings s
    cross join private.prewarm_clock c
  )
  select array_agg(j.node_id order by j.node_id) filter (where j.kind = 'quiet'),
         array_agg(j.heard_at order by j.node_id) filter (where j.kind = 'quiet'),
         array_agg(j.node_status order by j.node_id) filter (where j.kind = 'quiet'),
         array_agg(j.said order by j.node_id) filter (where j.kind = 'quiet'),
         array_agg(j.gpu_utilization order by j.node_id) filter (where j.kind = 'quiet'),
         array_agg(j.free_vram_gb order by j.node_id) filter (where j.kind = 'quiet'),
         array_agg(j.node_id order by j.node_id) filter (where j.kind = 'quiet' and j.warms),
         array_agg(to_jsonb(j.warm)::text order by j.node_id) filter (where j.kind = 'quiet' and j.warms),
         array_agg(j.ord order by j.node_id) filter (where j.kind = 'change'),
         array_agg(j.heard_at order by j.node_id) filter (where j.kind = 'change'),
         array_agg(j.node_id order by j.node_id) filter (where j.kind in ('gone', 'denied')),
         array_agg(case j.kind when 'gone' then format('no node %s', j.node_id)
                               else format('this secret does not belong to node %s', j.node_id) end
                   order by j.node_id)
           filter (where j.kind in ('gone', 'denied')),
         array_agg(case j.kind when 'gone' then 'P0002' else '42501' end order by j.node_id) filter (where j.kind in ('gone', 'denied'))
    into v_quiet, v_quiet_at, v_quiet_status, v_quiet_said, v_quiet_utilization, v_quiet_free, v_warm, v_warm_models, v_change, v_change_at,
         v_refused, v_refusal, v_refusal_code
  from judged j;

  -- Refused outright, as agent_heartbeat() refuses them; nothing of theirs is written.
  return query select u.id, null::text, null::text[], u.why, u.code
               from unnest(v_refused, v_refusal, v_refusal_code) as u (id, why, code);

  -- The quiet beats: one narrow row each (the time and the load), in node order (two gateways'
  -- batches lock rows in the same order), never moved back in time. Each row is there already (a
  -- conflict, so no check of its key against nodes, which would wait for a claim's lock on the node).
  insert into public.node_liveness as l (node_id, last_heartbeat_at, gpu_utilization, free_vram_gb)
  select u.id, u.at, u.utilization, u.free
  from unnest(v_quiet, v_quiet_at, v_quiet_utilization, v_quiet_free) as u (id, at, utilization, free)
  on conflict on constraint node_liveness_pkey do update
    set last_heartbeat_at = excluded.last_heartbeat_at, gpu_utilization = excluded.gpu_utilization,
        free_vram_gb = excluded.free_vram_gb
  where l.last_heartbeat_at < excluded.last_heartbeat_at;
  return query select u.id, u.status, '{}'::text[], null::text, null::text
               from unnest(v_quiet, v_quiet_status) as u (id, status)
               where u.id <> all (coalesce(v_warm, '{}'));
  for i in 1 .. coalesce(cardinality(v_warm), 0) loop
    v_node := v_warm[i];
    select u.status, u.said into v_status, v_said
    from unnest(v_quiet, v_quiet_status, v_quiet_said) as u (id, status, said) where u.id = v_node;
    v_load := private.prewarm_for(v_node, array(select jsonb_array_elements_text(v_warm_models[i]::jsonb)),
                                  '{}', '[]');
    -- Asked only of a node that takes work (as agent_heartbeat() answers).
    return query select v_node, v_status,
                        case when v_status = 'online' and v_said = 'online' then v_load else '{}'::text[] end,
                        null::text, null::text;
  end loop;

  -- The beats that change something, as agent_heartbeat() writes them, in node order.
  for k in 1 .. coalesce(cardinality(v_change), 0) loop
    v_beat := p_beats -> (v_change[k] - 1);
    v_node := (v_beat ->> 'node_id')::uuid;
    begin
      perform from public.nodes n where n.id = v_node for update skip locked;
      if not found then
        -- Held by a claim or another gateway's beat (the node exists: checked above).
        return query select v_node, null::text, null::text[],
                            'the node is busy in another transaction: the heartbeat is put off'::text, '55P03'::text;
        continue;
      end if;
      return query
      select v_node, h.status, h.load, null::text, null::text
      from public.agent_heartbeat(
        v_node, decode(v_beat ->> 'key', 'hex'), v_beat ->> 'status', (v_beat ->> 'queue_depth')::integer,
        (v_beat ->> 'gpu_utilization')::real, (v_beat ->> 'free_vram_gb')::real,
        case when v_beat -> 'models' is null or v_beat -> 'models' = 'null' then null
             else array(select jsonb_array_elements_text(v_beat -> 'models')) end,
        nullif(v_beat -> 'specs', 'null'), coalesce((v_beat ->> 'backend_up')::boolean, true),
        nullif(v_beat -> 'backend', 'null'),
        case when v_beat -> 'available' is null or v_beat -> 'available' = 'null' then null
             else array(select jsonb_array_elements_text(v_beat -> 'available')) end,
        array(select jsonb_array_elements_text(coalesce(nullif(v_beat -> 'loaded', 'null'), '[]'))),
        coalesce(nullif(v_beat -> 'refused', 'null'), '[]')) h;
      insert into public.node_liveness as l (node_id, last_heartbeat_at, gpu_utilization, free_vram_gb)
      values (v_node, v_change_at[k], (v_beat ->> 'gpu_utilization')::real, (v_beat ->> 'free_vram_gb')::real)
      on conflict on constraint node_liveness_pkey do update
        set last_heartbeat_at = excluded.last_heartbeat_at, gpu_utilization = excluded.gpu_utilization,
            free_vram_gb = excluded.free_vram_gb
      where l.last_heartbeat_at < excluded.last_heartbeat_at;
    exception when others then
      return query select v_node, null::text, null::text[], sqlerrm, sqlstate;
    end;
  end loop;
end;
$$;
