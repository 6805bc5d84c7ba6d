-- Predictive pre-warm. From recent demand per (model, region), the platform asks idle nodes that can
-- load a model to load it before requests need it, in the reply to their heartbeat.
--
-- * Demand comes from the jobs of the last few minutes (platform_settings.prewarm_window_s): how
--   many, how busy they kept their nodes (Little's law: the slot-seconds they used over the window),
--   and the ones that found no warm node: placed cold (jobs.cold_start, set as the job is placed) or
--   refused. It is computed into a small table (private.prewarm_demand) at most every
--   prewarm_refresh_s, by whichever heartbeat finds it due first, never per heartbeat.
-- * A (model, region) wants another warm node when requests there met no warm node since the last
--   pre-load asked for it, when no warm slot is left there, or when its load reaches
--   prewarm_busy_ratio of the warm slots there.
-- * A heartbeat then costs a few index lookups: the node must be online, idle (nothing in flight, no
--   queue), not cooling down, with the model held as available (it can load it) and the VRAM for it
--   (free VRAM too, where reported). At most one pre-load per (model, region) per prewarm_interval_s,
--   and at most one open request per node.
-- * Every request is recorded (public.prewarm_requests) with its outcome, so that pre-warm is
--   measured: requested, loaded, refused (with the agent's reason) or expired. Owners read their
--   nodes' rows.
-- * The agent also reports the models its server can load on demand (available) and answers the
--   request in its next heartbeat. A new agent_heartbeat() overload takes those and returns the load
--   instruction with the status; the earlier overloads are unchanged.

alter table public.platform_settings
  add column prewarm_enabled boolean not null default true,
  add column prewarm_window_s real not null default 300,
  add column prewarm_refresh_s real not null default 10,
  add column prewarm_interval_s real not null default 60,
  add column prewarm_busy_ratio real not null default 0.75,
  add column prewarm_expiry_s real not null default 300,
  add column prewarm_refusal_backoff_s real not null default 3600,
  add constraint "prewarm durations must be positive" check (
    prewarm_window_s > 0 and prewarm_refresh_s >= 0 and prewarm_interval_s >= 0 and prewarm_expiry_s > 0
    and prewarm_refusal_backoff_s >= 0
  ),
  add constraint "prewarm_busy_ratio must be in (0, 1]" check (prewarm_busy_ratio > 0 and prewarm_busy_ratio <= 1);
comment on column public.platform_settings.prewarm_enabled is 'Whether heartbeats ask idle nodes to pre-load models in demand.';
comment on column public.platform_settings.prewarm_window_s is 'Seconds of recent jobs that demand is computed from.';
comment on column public.platform_settings.prewarm_refresh_s is 'Demand is recomputed at most this often (by the first heartbeat that finds it older).';
comment on column public.platform_settings.prewarm_interval_s is 'At most one new pre-load per (model, region) in this many seconds.';
comment on column public.platform_settings.prewarm_busy_ratio is 'A (model, region) wants another warm node once its load (slots busy on average over the window) reaches this share of its warm slots.';
comment on column public.platform_settings.prewarm_expiry_s is 'A pre-load request the agent has not answered in this many seconds is recorded as expired.';
comment on column public.platform_settings.prewarm_refusal_backoff_s is 'A node that refused to pre-load a model, or did not answer, is not asked for that model again for this many seconds.';

-- Cold placements, recorded as they happen --------------------------------------------------------

alter table public.jobs add column cold_start boolean;
comment on column public.jobs.cold_start is 'Whether the node the job was placed on held the model unloaded (available): a cold start. Null for a job no node took.';

create function private.mark_cold_start() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- One primary-key lookup per placed job: what pre-warm needs to tell cold placements from warm.
  new.cold_start := not exists (
    select 1 from public.node_models nm
    where nm.node_id = new.node_id and nm.model_id = new.model_id and nm.state = 'loaded'
  );
  return new;
end;
$$;
comment on function private.mark_cold_start() is 'Trigger: records on a new placed job whether its node had the model loaded (warm) or only available (cold start).';
revoke execute on function private.mark_cold_start() from public, anon, authenticated, service_role;

create trigger jobs_mark_cold_start before insert on public.jobs
  for each row when (new.node_id is not null) execute function private.mark_cold_start();

-- The requests and their outcomes -----------------------------------------------------------------

create table public.prewarm_requests (
  id bigint generated always as identity primary key,
  node_id uuid not null references public.nodes (id) on delete cascade,
  model_id text not null,
  region text,
  requested_at timestamptz not null default now(),
  outcome text not null default 'requested',
  reason text,
  answered_at timestamptz,
  constraint "outcome must be requested, loaded, refused or expired" check (
    outcome in ('requested', 'loaded', 'refused', 'expired')
  ),
  constraint "a refusal says why, in at most 200 characters" check (
    (outcome = 'refused') = (reason is not null) and length(trim(reason)) between 1 and 200
  ),
  constraint "only an open request has no answer time" check ((outcome = 'requested') = (answered_at is null))
);
comment on table public.prewarm_requests is 'Each time the platform asked a node to pre-load a model (in a heartbeat reply), and what came of it: requested (open), loaded, refused (the agent''s reason: its server cannot load models, say) or expired (no answer within platform_settings.prewarm_expiry_s). region is the demand it answered (null: requests that named no region).';

-- At most one open request per node, whatever the race.
create unique index prewarm_requests_one_open_per_node on public.prewarm_requests (node_id)
  where outcome = 'requested';
create index prewarm_requests_node_model_idx on public.prewarm_requests (node_id, model_id, requested_at desc);
create index prewarm_requests_open_idx on public.prewarm_requests (requested_at) where outcome = 'requested';
create index prewarm_requests_requested_at_idx on public.prewarm_requests (requested_at desc);

revoke all on table public.prewarm_requests from anon, authenticated;
grant select on table public.prewarm_requests to authenticated;
grant all on table public.prewarm_requests to service_role;
alter table public.prewarm_requests enable row level security;
create policy "Owners can see the pre-warm requests of their own nodes" on public.prewarm_requests
  for select to authenticated using (
    exists (select 1 from public.nodes n where n.id = node_id and n.owner_id = (select auth.uid()))
  );

-- Demand, computed at most every prewarm_refresh_s --------------------------------------------------

create table private.prewarm_demand (
  id bigint generated always as identity primary key,
  model_id text not null,
  region text,
  requests integer not null,
  unmet integer not null,
  load real not null,
  warm_slots integer not null,
  wanted boolean not null,
  computed_at timestamptz not null,
  last_requested_at timestamptz,
  constraint "one demand row per model and region" unique nulls not distinct (model_id, region)
);
comment on table private.prewarm_demand is 'Recent demand per (model, region) (region null: requests that named none and no node took): requests in the window, unmet ones (placed cold or refused) since the last pre-load asked for, load (slots busy on average), warm slots there now, and whether another warm node is wanted. Recomputed by refresh_prewarm_demand(); last_requested_at spaces pre-loads out.';
revoke all on table private.prewarm_demand from public, anon, authenticated;
grant select, insert, update, delete on table private.prewarm_demand to service_role;

create table private.prewarm_clock (
  id boolean primary key default true,
  refreshed_at timestamptz not null default 'epoch',
  constraint "prewarm_clock has exactly one row" check (id)
);
comment on table private.prewarm_clock is 'When demand was last computed; the row is also the lock that lets one heartbeat at a time compute it.';
revoke all on table private.prewarm_clock from public, anon, authenticated;
grant select, update on table private.prewarm_clock to service_role;
insert into private.prewarm_clock default values;

create function private.refresh_prewarm_demand()
returns void
language plpgsql
set search_path = ''
as $$
declare
  s public.platform_settings;
  v_window interval;
begin
  select * into s from public.platform_settings;
  v_window := make_interval(secs => s.prewarm_window_s);
  -- Requests no agent answered in time (it went away, or predates pre-warm). Rows a heartbeat holds
  -- are left to it: that heartbeat expires its own.
  update public.prewarm_requests r set outcome = 'expired', answered_at = now()
  where r.id in (
    select o.id from public.prewarm_requests o
    where o.outcome = 'requested' and o.requested_at < now() - make_interval(secs => s.prewarm_expiry_s)
    for update skip locked
  );

  -- One pass over the window's jobs (jobs_created_at_idx). A job's region is the caller's, else the
  -- region of the node that took it.
  with recent as (
    select j.model_id, coalesce(j.region, n.region) as region, j.created_at,
           (j.attempts = 0 and j.status = 'failed') or coalesce(j.cold_start, false) as unmet,
           case when j.attempts > 0 then
             least(coalesce(j.latency_ms / 1000.0, extract(epoch from now() - j.created_at)::float8), s.prewarm_window_s)
           end as busy_s
    from public.jobs j
    left join public.nodes n on n.id = j.node_id
    where j.created_at >= now() - v_window
  ), demand as (
    select r.model_id, r.region, count(*)::integer as requests,
           -- Unmet since the last pre-load asked for here: what that one has not answered yet.
           (count(*) filter (where r.unmet and r.created_at > coalesce(p.last_requested_at, '-infinity')))::integer as unmet,
           (coalesce(sum(r.busy_s), 0) / s.prewarm_window_s)::real as load
    from recent r
    -- Joined on a key that can be hashed (a node's region is never empty).
    left join private.prewarm_demand p on p.model_id = r.model_id and coalesce(p.region, '') = coalesce(r.region, '')
    group by r.model_id, r.region
  ), warm as materialized (
    -- Warm capacity now, only for the models in demand (node_models_model_idx); computed once.
    select nm.model_id, n.region, sum(n.max_concurrency)::integer as slots
    from public.node_models nm
    join public.nodes n on n.id = nm.node_id
    where nm.model_id in (select d.model_id from demand d) and nm.state = 'loaded'
      and n.status in ('online', 'busy') and n.backend_up
      and n.last_heartbeat_at >= now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
      and (n.cooldown_until is null or n.cooldown_until <= now())
    group by nm.model_id, n.region
  ), sized as (
    select d.*, coalesce((select sum(w.slots) from warm w
                          where w.model_id = d.model_id and (d.region is null or w.region = d.region)), 0)::integer as warm_slots
    from demand d
  )
  insert into private.prewarm_demand as p (model_id, region, requests, unmet, load, warm_slots, wanted, computed_at)
  select z.model_id, z.region, z.requests, z.unmet, z.load, z.warm_slots,
         z.unmet > 0 or z.warm_slots = 0 or z.load >= s.prewarm_busy_ratio * z.warm_slots, now()
  from sized z
  on conflict (model_id, region) do update
  set requests = excluded.requests, unmet = excluded.unmet, load = excluded.load,
      warm_slots = excluded.warm_slots, wanted = excluded.wanted, computed_at = excluded.computed_at;

  -- Demand that left the window.
  delete from private.prewarm_demand p where p.computed_at <> now();
  update private.prewarm_clock set refreshed_at = now();
end;
$$;
comment on function private.refresh_prewarm_demand() is 'Recomputes private.prewarm_demand from the jobs of the last platform_settings.prewarm_window_s and the warm capacity now, and expires pre-load requests left unanswered past prewarm_expiry_s. One pass over the window''s jobs; run at most every prewarm_refresh_s.';
revoke execute on function private.refresh_prewarm_demand() from public, anon, authenticated;
grant execute on function private.refresh_prewarm_demand() to service_role;

-- What one heartbeat asks of its node -------------------------------------------------------------

create function private.prewarm_for(
  p_node_id uuid, p_loaded_models text[], p_loaded text[], p_refused jsonb
) returns text[]
language plpgsql
set search_path = ''
as $$
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
         s.prewarm_refusal_backoff_s, c.refreshed_at, n.region, n.vram_gb, n.free_vram_gb,
         n.status = 'online' and n.backend_up and n.inflight = 0 and n.queue_depth = 0
           and (n.cooldown_until is null or n.cooldown_until <= now())
           and exists (select 1 from public.node_models nm where nm.node_id = n.id and nm.state = 'available') as idle,
         r.id as open_id, r.model_id as open_model, r.requested_at as open_at
  into v
  from public.nodes n
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
comment on function private.prewarm_for(uuid, text[], text[], jsonb) is 'Called once per heartbeat: records the agent''s answer to the node''s open pre-load request (loaded: in p_loaded or among its warm models p_loaded_models; refused: p_refused, [{model, reason}]; expired when too old), then returns the models (none or one) the node should pre-load now: its open request again, else a model in demand (private.prewarm_demand, recomputed here when due) that the idle node holds as available and has the VRAM for, at most one per (model, region) per prewarm_interval_s, each new request recorded in prewarm_requests.';
revoke execute on function private.prewarm_for(uuid, text[], text[], jsonb) from public, anon, authenticated;
grant execute on function private.prewarm_for(uuid, text[], text[], jsonb) to service_role;

-- The heartbeat that carries it -------------------------------------------------------------------

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
  p_backend jsonb,
  p_available_models text[],
  p_prewarm_loaded text[],
  p_prewarm_refused jsonb
) returns table (status text, load text[])
language plpgsql
set search_path = ''
as $$
declare
  v_status text;
  v_load text[];
  v_up boolean := coalesce(p_backend_up, true);
begin
  -- Authenticates, and records status, load, warm models, specs and server (the earlier overload).
  v_status := public.agent_heartbeat(p_node_id, p_secret_hash, p_status, p_queue_depth, p_gpu_utilization,
                                     p_free_vram_gb, p_loaded_models, p_specs, p_backend_up, p_backend);
  -- The models the server can load on demand, when the agent says (null: it does not know): held as
  -- available (a cold start) unless loaded; the ones it can no longer load are forgotten.
  if p_available_models is not null and v_up then
    if exists (select 1 from unnest(p_available_models) m
               where m <> all (coalesce(p_loaded_models, '{}'))
                 and not exists (select 1 from public.node_models nm where nm.node_id = p_node_id and nm.model_id = m)) then
      insert into public.node_models (node_id, model_id, state)
      select p_node_id, m, 'available' from unnest(p_available_models) m
      where m <> all (coalesce(p_loaded_models, '{}'))
      on conflict (node_id, model_id) do nothing;
    end if;
    delete from public.node_models nm
    where nm.node_id = p_node_id and nm.state = 'available' and nm.model_id <> all (p_available_models);
  end if;
  v_load := private.prewarm_for(p_node_id, case when v_up then p_loaded_models end, p_prewarm_loaded,
                                p_prewarm_refused);
  -- Asked only of a node that takes work (prewarm_for() checks it is idle too).
  return query select v_status, case when v_status = 'online' and p_status = 'online' then v_load else '{}' end;
end;
$$;
comment on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) is 'A node agent''s heartbeat with pre-warm: what the earlier overload records, plus the models its server can load on demand (p_available_models; null: not said) and its answers to a pre-load request (p_prewarm_loaded, p_prewarm_refused as [{model, reason}]). Returns the node''s status and the models it should load now (load: none or one).';
revoke execute on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) from public, anon, authenticated;
grant execute on function public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) to service_role;
