-- Heartbeats in batches (issue 41, "100,000 nodes"): 100,000 nodes beating every 5 s are 20,000 beats
-- a second, and one agent_heartbeat() a beat (one statement, one UPDATE of the node's wide, triggered
-- row) cost 4.1 to 4.7 ms of Postgres CPU: 2,000 nodes wanted 400 beats/s and got 270 to 300.
--
-- A gateway now gathers its agents' beats and writes them in one call a second, node_heartbeats():
--
-- * A beat that changes nothing (the node's status, load, warm and loadable models, server and specs
--   as the row already has them: steady state) writes one narrow row, its node's in
--   public.node_liveness (node id and time: a heap-only update that no claim touches, no trigger,
--   no index but the key). The nodes row, its ten triggers and node_models are left alone.
-- * A beat that changes something (and a node's first, which makes its node_liveness row under the
--   node's lock) is written as agent_heartbeat() writes it, one at a time, each in
--   a subtransaction of its own: what it said wrong (a rule of the node's) fails that beat only. A
--   node another transaction holds locked (a claim) is not waited for: its beat is put off to the
--   next call (lock_not_available), so a batch never waits on a claim nor deadlocks with one.
-- * Secrets are checked before anything is written; a beat whose node is gone or whose secret is not
--   its node's is refused by itself, as agent_heartbeat() refuses it. (The gateway checks them too,
--   before it queues a beat, against the hashes it keeps: a trigger tells it when one changes.)
-- * Pre-warm: the quiet beats of nodes with an open pre-load request, or idle and able to load a
--   model while some model is wanted (or the demand is due to be recomputed), ask private.prewarm_for()
--   as agent_heartbeat() does; the others need not.
--
-- A node's last heartbeat is now the later of nodes.last_heartbeat_at (written by registration,
-- tunnels, the one-beat paths: agent_heartbeat() for the heartbeat Edge Function, node_heartbeat()
-- for the demo) and node_liveness.last_heartbeat_at. What reads it reads both: the sweep here, and
-- the matcher, the pre-warm demand, the map and the owners' pages in the next migration. The sweep
-- copies the later one into nodes.last_heartbeat_at as it sets a node offline.

create table public.node_liveness (
  node_id uuid primary key references public.nodes (id) on delete cascade,
  last_heartbeat_at timestamptz not null
) with (fillfactor = 50);
comment on table public.node_liveness is 'When each node last beat through a gateway''s batch (node_heartbeats()): one narrow row a node, updated in place (heap-only: no index on the time, pages half free), so that a beat that changes nothing writes nothing else. A node''s last heartbeat is the later of this and nodes.last_heartbeat_at (written by registration, tunnels and the one-beat paths). Anyone may read it, as nodes.last_heartbeat_at.';
revoke all on table public.node_liveness from anon, authenticated;
grant select on table public.node_liveness to anon, authenticated;
grant all on table public.node_liveness to service_role;
alter table public.node_liveness enable row level security;
create policy "Anyone can see when nodes last beat" on public.node_liveness
  for select to anon, authenticated using (true);

-- A gateway keeps each node's secret hash once read, to refuse a wrong secret at once (before
-- anything is queued): told here when one changes (a node registered again) or goes (deleted).
create function private.notify_node_secret_change() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  perform pg_notify('neuralgrid_node_secrets', old.id::text);
  return null;
end;
$$;
comment on function private.notify_node_secret_change() is 'Trigger: tells LISTENing gateways (channel neuralgrid_node_secrets, the node''s id) that a node''s secret changed or the node is gone, so that they stop taking heartbeats with the secret they kept.';
revoke execute on function private.notify_node_secret_change() from public, anon, authenticated;
create trigger nodes_notify_secret_change after update of secret_hash on public.nodes
  for each row when (old.secret_hash is distinct from new.secret_hash)
  execute function private.notify_node_secret_change();
create trigger nodes_notify_deleted after delete on public.nodes
  for each row execute function private.notify_node_secret_change();

create function public.node_heartbeats(p_beats jsonb)
returns table (node_id uuid, status text, load text[], error text, error_code text)
language plpgsql
set search_path = ''
as $$
declare
  v_quiet uuid[];         -- beats that change nothing: node_liveness only
  v_quiet_at timestamptz[];
  v_quiet_status text[];
  v_quiet_said text[];    -- the status each agent said (the reply's load needs it)
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
    select b.node_id, b.ord, b.status as said, b.warm, n.status as node_status,
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
                  and n.gpu_utilization is not distinct from b.gpu_utilization
                  and n.free_vram_gb is not distinct from b.free_vram_gb
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
    into v_quiet, v_quiet_at, v_quiet_status, v_quiet_said, v_warm, v_warm_models, v_change, v_change_at,
         v_refused, v_refusal, v_refusal_code
  from judged j;

  -- Refused outright, as agent_heartbeat() refuses them; nothing of theirs is written.
  return query select u.id, null::text, null::text[], u.why, u.code
               from unnest(v_refused, v_refusal, v_refusal_code) as u (id, why, code);

  -- The quiet beats: one narrow row each, in node order (two gateways' batches lock rows in the
  -- same order), never moved back in time. Each row is there already (a conflict, so no check of
  -- its key against nodes, which would wait for a claim's lock on the node).
  insert into public.node_liveness as l (node_id, last_heartbeat_at)
  select u.id, u.at from unnest(v_quiet, v_quiet_at) as u (id, at)
  on conflict on constraint node_liveness_pkey do update set last_heartbeat_at = excluded.last_heartbeat_at
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
      insert into public.node_liveness as l (node_id, last_heartbeat_at) values (v_node, v_change_at[k])
      on conflict on constraint node_liveness_pkey do update set last_heartbeat_at = excluded.last_heartbeat_at
      where l.last_heartbeat_at < excluded.last_heartbeat_at;
    exception when others then
      return query select v_node, null::text, null::text[], sqlerrm, sqlstate;
    end;
  end loop;
end;
$$;
comment on function public.node_heartbeats(p_beats jsonb) is 'A gateway''s heartbeats of the last second in one call: a JSON array of beats, each as agent_heartbeat() takes one (node_id; key: the hex SHA-256 of the node''s secret; status, queue_depth, gpu_utilization, free_vram_gb, models, specs, backend_up, backend, available, loaded, refused) and age_ms, how long ago the gateway heard it. A beat that changes nothing writes only its node''s node_liveness row; one that changes something is written as agent_heartbeat() writes it, on its own (put off with error_code 55P03 when a claim holds the node). Returns a row per beat: the node''s status and the models it should pre-load now, or the error that refused it (error_code: its SQLSTATE, as agent_heartbeat() would raise it).';
revoke all on function public.node_heartbeats(p_beats jsonb) from public, anon, authenticated;
grant execute on function public.node_heartbeats(p_beats jsonb) to service_role;

create or replace function public.sweep_stale_nodes()
returns table (node_id uuid, name text, last_heartbeat_at timestamptz)
language sql
set search_path = ''
as $$
  -- A node silent for missed_heartbeats_offline intervals goes offline (5 s x 3 = 15 s by default),
  -- counted from its last heartbeat (the later of the row's and the batches', node_liveness) or the
  -- database's start, whichever is later. The last beat is kept in the row as it goes.
  update public.nodes n
  set status = 'offline',
      last_heartbeat_at = t.beat,
      missed_heartbeats = coalesce(floor(extract(epoch from now() - t.beat) / s.heartbeat_interval_s)::integer,
                                   s.missed_heartbeats_offline)
  from (select m.id, greatest(m.last_heartbeat_at, l.last_heartbeat_at) as beat
        from public.nodes m
        left join public.node_liveness l on l.node_id = m.id
        where m.status <> 'offline') t,
       public.platform_settings s
  where n.id = t.id
    and (t.beat is null
         or greatest(t.beat, pg_postmaster_start_time())
            < now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline))
  returning n.id, n.name, n.last_heartbeat_at
$$;
comment on function public.sweep_stale_nodes() is 'Marks nodes offline that have been silent for platform_settings.missed_heartbeats_offline heartbeat intervals (their last beat: the later of nodes.last_heartbeat_at and node_liveness, kept in the row as they go; counted from the database''s start too: a restart is no node''s silence) and returns them; run every second by the service, or by pg_cron on Supabase.';
