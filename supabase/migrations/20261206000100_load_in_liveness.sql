-- A node's load in the batches (issue 41): a real GPU's utilization and free VRAM change nearly
-- every beat, and node_heartbeats() wrote a beat whose load differed from the node's row as a change,
-- through agent_heartbeat() (the node's wide row, its ten triggers, its scores): a real fleet never
-- took the batched path. node_liveness now keeps them beside the time, so a beat that changes only
-- its load writes that narrow row alone (an update in place: still no index on what it writes).
--
-- A node's load is the one its last beat said: node_liveness's where that row's beat is the later (or
-- as late: the sweep copies the batches' time into the row), else the node's row (written by the
-- one-beat paths, agent_heartbeat() for the heartbeat Edge Function and node_heartbeat()). So read the
-- map (node_map), the row feed and owners' topics (node_map_payload(), broadcast_node_change()), and
-- pre-warm's free VRAM (prewarm_for()); the owner's page reads it so too (neuralgrid/db/queries). The
-- matcher reads neither. A beat out of bounds (utilization above 1) is still written as a change, so
-- that agent_heartbeat() refuses it as it did; the checks here keep the table to the same bounds.

alter table public.node_liveness
  add column gpu_utilization real constraint node_liveness_gpu_utilization_check
    check (gpu_utilization between 0 and 1),
  add column free_vram_gb real constraint node_liveness_free_vram_gb_check
    check (free_vram_gb >= 0 and free_vram_gb <> 'NaN');
comment on table public.node_liveness is 'When each node last beat through a gateway''s batch (node_heartbeats()), and the load that beat said (its GPU''s utilization and free VRAM, which change nearly every beat): one narrow row a node, updated in place (heap-only: no index on what a beat writes, pages half free), so that a beat that changes nothing else writes nothing else. A node''s last heartbeat is the later of this and nodes.last_heartbeat_at (written by registration, tunnels and the one-beat paths), and its load is the one of the later of the two rows. Anyone may read it, as those columns of nodes.';
comment on column public.node_liveness.gpu_utilization is 'The GPU utilization (0 to 1) the node''s batched beat said; null: not said. The node''s load where this row''s beat is the later (else nodes.gpu_utilization).';
comment on column public.node_liveness.free_vram_gb is 'The free VRAM in GB the node''s batched beat said; null: not said. The node''s where this row''s beat is the later (else nodes.free_vram_gb).';

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
                    when n.inflight >= n.max_concurrency then 'busy'
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


create or replace function private.prewarm_for(p_node_id uuid, p_loaded_models text[], p_loaded text[], p_refused jsonb) RETURNS text[]
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v record;
  v_pick record;
  v_loaded boolean;
  v_reason text;
begin
  if p_refused is not null and jsonb_typeof(p_refused) <> 'array' then
    raise exception 'refused must be a JSON array of {"model": text, "reason": text}'
      using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_array_length(coalesce(p_refused, '[]')) > 0 then
    if exists (select 1 from jsonb_array_elements(p_refused) e
               where jsonb_typeof(e) <> 'object' or jsonb_typeof(e -> 'model') is distinct from 'string'
                  or jsonb_typeof(e -> 'reason') is distinct from 'string') then
      raise exception 'refused must be a JSON array of {"model": text, "reason": text}'
        using errcode = 'invalid_parameter_value';
    end if;
  end if;

  -- The settings, the node, whether it may be asked now (idle: loading competes with serving for the
  -- GPU; healthy; holding some model it could load) and its open request: one statement, on primary
  -- keys and the one-open-request-per-node index.
  select s.prewarm_enabled, s.prewarm_expiry_s, s.prewarm_refresh_s, s.prewarm_interval_s,
         s.prewarm_refusal_backoff_s, c.refreshed_at, n.region, n.vram_gb,
         -- Its free VRAM as its last beat said it: the batches' (node_liveness) when later.
         case when l.last_heartbeat_at >= coalesce(n.last_heartbeat_at, '-infinity') then l.free_vram_gb
              else n.free_vram_gb end as free_vram_gb,
         n.status = 'online' and n.backend_up and n.inflight = 0 and n.queue_depth = 0
           and (n.cooldown_until is null or n.cooldown_until <= now())
           and exists (select 1 from public.node_models nm where nm.node_id = n.id and nm.state = 'available') as idle,
         r.id as open_id, r.model_id as open_model, r.requested_at as open_at
  into v
  from public.nodes n
  left join public.node_liveness l on l.node_id = n.id
  cross join public.platform_settings s
  cross join private.prewarm_clock c
  left join public.prewarm_requests r on r.node_id = n.id and r.outcome = 'requested'
  where n.id = p_node_id;

  -- The open request (one at a time per node): answered now, loaded (the agent says so, or the
  -- model is among the warm ones it reports, however it got there) or refused with the agent's
  -- reason; else expired once too old; else said again in the reply (a lost reply costs nothing, and
  -- the agent ignores a load it is already doing).
  if v.open_id is not null then
    v_loaded := v.open_model = any (coalesce(p_loaded, '{}')) or v.open_model = any (coalesce(p_loaded_models, '{}'));
    if not v_loaded and jsonb_array_length(coalesce(p_refused, '[]')) > 0 then
      select e ->> 'reason' into v_reason from jsonb_array_elements(p_refused) e
      where e ->> 'model' = v.open_model limit 1;
    end if;
    if v_loaded then
      update public.prewarm_requests r set outcome = 'loaded', answered_at = now() where r.id = v.open_id;
    elsif v_reason is not null then
      update public.prewarm_requests r set outcome = 'refused', reason = v_reason, answered_at = now()
      where r.id = v.open_id;
    elsif v.open_at < now() - make_interval(secs => v.prewarm_expiry_s) then
      update public.prewarm_requests r set outcome = 'expired', answered_at = now() where r.id = v.open_id;
    elsif v.prewarm_enabled then
      return array[v.open_model];
    end if;
  end if;
  if not coalesce(v.prewarm_enabled and v.idle, false) then
    return '{}';
  end if;

  -- Demand is computed at most every prewarm_refresh_s, by the first heartbeat that finds it due;
  -- the others skip the locked clock and use the figures there are.
  if v.refreshed_at < now() - make_interval(secs => v.prewarm_refresh_s) then
    perform 1 from private.prewarm_clock c
    where c.refreshed_at < now() - make_interval(secs => v.prewarm_refresh_s)
    for update skip locked;
    if found then
      perform private.refresh_prewarm_demand();
    end if;
  end if;

  -- A model in demand that this node holds unloaded and has room for, and has not lately refused or
  -- left unanswered (an agent from before pre-warm never answers). The demand row is locked (skipped
  -- if another heartbeat holds it), so two nodes are never asked for it in one interval.
  select d.id, d.model_id, d.region into v_pick
  from public.node_models nm
  join private.prewarm_demand d on d.model_id = nm.model_id and (d.region = v.region or d.region is null)
  -- The VRAM a model needs, as the matcher reads it: the catalog's, else 1 GB.
  left join public.models m on m.id = nm.model_id
  where nm.node_id = p_node_id and nm.state = 'available' and d.wanted
    and v.vram_gb >= coalesce(m.min_vram_gb, 1)
    and (v.free_vram_gb is null or v.free_vram_gb >= coalesce(m.min_vram_gb, 1))
    and (d.last_requested_at is null or d.last_requested_at <= now() - make_interval(secs => v.prewarm_interval_s))
    and not exists (
      select 1 from public.prewarm_requests r
      where r.node_id = p_node_id and r.model_id = nm.model_id and r.outcome in ('refused', 'expired')
        and r.requested_at > now() - make_interval(secs => v.prewarm_refusal_backoff_s))
  order by d.region is null, d.unmet desc, d.requests desc, d.model_id
  limit 1
  for update of d skip locked;
  if not found then
    return '{}';
  end if;

  update private.prewarm_demand d set last_requested_at = now(), unmet = 0 where d.id = v_pick.id;
  insert into public.prewarm_requests (node_id, model_id, region) values (p_node_id, v_pick.model_id, v_pick.region);
  return array[v_pick.model_id];
end;
$$;


create or replace function private.node_map_payload(n public.nodes) RETURNS jsonb
    LANGUAGE sql STABLE
    SET search_path TO ''
    AS $$
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
    'queue_depth', n.queue_depth)
  from (select) one
  left join public.node_liveness l on l.node_id = n.id
$$;


create or replace function private.broadcast_node_change() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_node public.nodes;
  v_payload jsonb;
begin
  -- An update is broadcast when what the map or the owner sees changed (not the in-flight count).
  if tg_op = 'UPDATE' and (old.status, old.missed_heartbeats, old.cooldown_until, old.name, old.gpu_model,
                           old.gpu_count, old.vram_gb, old.tflops, old.hourly_rate, old.region, old.latitude,
                           old.longitude, old.max_concurrency)
      is not distinct from (new.status, new.missed_heartbeats, new.cooldown_until, new.name, new.gpu_model,
                            new.gpu_count, new.vram_gb, new.tflops, new.hourly_rate, new.region, new.latitude,
                            new.longitude, new.max_concurrency) then
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


create or replace view public.node_map with (security_invoker = true) as
select n.id,
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
    -- The node's last heartbeat: the later of its row's and the batches' (node_liveness).
    greatest(n.last_heartbeat_at, max(l.last_heartbeat_at)) as last_heartbeat_at,
    n.successes,
    n.failures,
    n.ewma_latency_ms,
    n.ewma_tokens_per_s,
    n.cooldown_until,
    coalesce(array_agg(m.model_id order by m.model_id) filter (where m.state = 'loaded'), '{}'::text[]) as warm_models,
    coalesce(array_agg(m.model_id order by m.model_id) filter (where m.state = 'available'), '{}'::text[]) as available_models,
    n.missed_heartbeats,
    -- Its load as its last beat said it: the batches' when theirs is the later (one row a node).
    case when max(l.last_heartbeat_at) >= coalesce(n.last_heartbeat_at, '-infinity') then max(l.gpu_utilization)
         else n.gpu_utilization end as gpu_utilization,
    case when max(l.last_heartbeat_at) >= coalesce(n.last_heartbeat_at, '-infinity') then max(l.free_vram_gb)
         else n.free_vram_gb end as free_vram_gb,
    n.queue_depth
from public.nodes n
left join public.node_liveness l on l.node_id = n.id
left join public.node_models m on m.node_id = n.id
group by n.id;

comment on function public.node_heartbeats(jsonb) is 'A gateway''s heartbeats of the last second in one call: a JSON array of beats, each as agent_heartbeat() takes one (node_id; key: the hex SHA-256 of the node''s secret; status, queue_depth, gpu_utilization, free_vram_gb, models, specs, backend_up, backend, available, loaded, refused) and age_ms, how long ago the gateway heard it. A beat that changes nothing but its GPU''s utilization and free VRAM writes only its node''s node_liveness row (the time and that load); one that changes something else is written as agent_heartbeat() writes it, on its own (put off with error_code 55P03 when a claim holds the node). Returns a row per beat: the node''s status and the models it should pre-load now, or the error that refused it (error_code: its SQLSTATE, as agent_heartbeat() would raise it).';
