-- Rules checked where their columns are written.
--
-- Postgres prepares every CHECK constraint of a table, and the WHEN clause of every trigger that
-- fires, again for each statement that writes it: it reads the expression back from its stored
-- form, simplifies and compiles it, whichever columns the statement set. A claim and a release are
-- each one UPDATE of one `nodes` row, so each paid for the node's 23 rules (its JSON's size, its
-- URL's pattern, its name's length...) and four WHEN clauses, though it writes only its in-flight
-- count, status and health. Measured on a scratch database, one request's SQL (place_job() and
-- complete_jobs(), each committed): 1.76 ms with them, 1.63 ms with the rules off `nodes`,
-- 1.51 ms with the WHEN clauses gone as well.
--
-- So the rules about what a node or key *is* (specs, place, price, address, name, limits) are
-- checked by a BEFORE trigger that fires only when a statement writes one of those columns
-- (`update of`: decided from the statement's SET list, nothing prepared). It raises the error
-- the constraint did: SQLSTATE 23514, the rule's name as the constraint, the same message (without
-- the "Failing row contains" detail). The rules about what the request path writes (in-flight
-- count, status, counters, money held and spent) stay CHECK constraints. Differences: a row that
-- breaks a rule and a NOT NULL at once now fails on the rule (triggers run first), and, like every
-- trigger, these do not run under session_replication_role = replica (a data-only restore).
--
-- The conditions of the triggers a claim fires move into their functions, compiled once per
-- session: each update of a node now calls them and they return at once when nothing they watch
-- changed. A statement that updates many nodes (complete_jobs() releasing a batch, the sweep)
-- pays a call per row where the WHEN clause was prepared once per statement; side by side at 64
-- callers, where releases come in batches, Postgres's CPU per request still fell. The jobs triggers a
-- batch fires keep their WHEN clauses; the one a placement fires per row (mark_cold_start) does not.

-- nodes --------------------------------------------------------------------------------------------

create function private.nodes_check_description() returns trigger
language plpgsql
set search_path = ''
as $$
declare
  v_rule text;  -- the first rule broken, in the order Postgres checks constraints (by name)
begin
  -- The JSON is serialized to be measured: only when it is written.
  if (tg_op = 'INSERT' or new.backend is distinct from old.backend)
     and not (jsonb_typeof(new.backend) = 'object' and octet_length(new.backend::text) <= 4096) then
    v_rule := 'backend must be a JSON object of at most 4 kB';
  elsif not (new.endpoint_url ~ '^(https?://[^\s]+|tunnel:[^\s]*)$') then
    v_rule := 'endpoint_url must be http(s):// or tunnel:';
  elsif not (new.free_vram_gb >= 0) then
    v_rule := 'free_vram_gb must not be negative';
  elsif not (new.gpu_count between 1 and 64) then
    v_rule := 'gpu_count must be between 1 and 64';
  elsif not (length(trim(new.gpu_model)) > 0) then
    v_rule := 'gpu_model must not be empty';
  elsif not (new.gpu_utilization between 0 and 1) then
    v_rule := 'gpu_utilization must be between 0 and 1';
  elsif not (new.hourly_rate >= 0) then
    v_rule := 'hourly_rate must not be negative';
  elsif not ((new.latitude is null) = (new.longitude is null)) then
    v_rule := 'latitude and longitude go together';
  elsif not (new.latitude between -90 and 90) then
    v_rule := 'latitude must be between -90 and 90';
  elsif not (new.longitude between -180 and 180) then
    v_rule := 'longitude must be between -180 and 180';
  elsif not (new.max_concurrency between 1 and 1024) then
    v_rule := 'max_concurrency must be between 1 and 1024';
  elsif not (length(trim(new.name)) between 1 and 100) then
    v_rule := 'node name must be 1 to 100 characters';
  elsif not (new.outside_load >= 0) then
    v_rule := 'outside_load must not be negative';
  elsif not (new.queue_depth >= 0) then
    v_rule := 'queue_depth must not be negative';
  elsif not (length(trim(new.region)) > 0) then
    v_rule := 'region must not be empty';
  elsif not (cardinality(new.routes) >= 1 and new.routes <@ '{chat/completions,completions,embeddings,responses,rerank,score,audio/transcriptions,audio/translations,audio/speech}'::text[]) then
    v_rule := 'routes must be known route names, at least one';
  elsif not (new.secret_hash is null or length(new.secret_hash) = 32) then
    v_rule := 'secret_hash must be a SHA-256 digest';
  elsif not (new.tflops > 0 and new.tflops <= 100000) then
    v_rule := 'tflops must be positive and at most 100000';
  elsif not (new.vram_gb > 0 and new.vram_gb <= 8192) then
    v_rule := 'vram_gb must be positive and at most 8192';
  end if;
  if v_rule is not null then
    raise exception 'new row for relation "%" violates check constraint "%"', tg_table_name, v_rule
      using errcode = 'check_violation', constraint = v_rule, table = tg_table_name, schema = tg_table_schema;
  end if;
  return new;
end;
$$;
comment on function private.nodes_check_description() is 'Trigger: the rules about what a node is (specs, place, price, address, name, routes, reported load), checked when a statement writes one of those columns; each raises the check_violation its CHECK constraint did.';
revoke execute on function private.nodes_check_description() from public, anon, authenticated, service_role;

-- Named to run after the BEFORE triggers that derive columns (outside_load, routes), as CHECK
-- constraints ran after them; BEFORE triggers run in name order.
create trigger nodes_validate before insert or update of
  backend, endpoint_url, free_vram_gb, gpu_count, gpu_model, gpu_utilization, hourly_rate, latitude,
  longitude, max_concurrency, name, outside_load, queue_depth, region, routes, secret_hash, tflops, vram_gb
  on public.nodes for each row execute function private.nodes_check_description();

alter table public.nodes
  drop constraint "backend must be a JSON object of at most 4 kB",
  drop constraint "endpoint_url must be http(s):// or tunnel:",
  drop constraint "free_vram_gb must not be negative",
  drop constraint "gpu_count must be between 1 and 64",
  drop constraint "gpu_model must not be empty",
  drop constraint "gpu_utilization must be between 0 and 1",
  drop constraint "hourly_rate must not be negative",
  drop constraint "latitude and longitude go together",
  drop constraint "latitude must be between -90 and 90",
  drop constraint "longitude must be between -180 and 180",
  drop constraint "max_concurrency must be between 1 and 1024",
  drop constraint "node name must be 1 to 100 characters",
  drop constraint "outside_load must not be negative",
  drop constraint "queue_depth must not be negative",
  drop constraint "region must not be empty",
  drop constraint "routes must be known route names, at least one",
  drop constraint "secret_hash must be a SHA-256 digest",
  drop constraint "tflops must be positive and at most 100000",
  drop constraint "vram_gb must be positive and at most 8192";

-- The AFTER UPDATE triggers' conditions, in their functions.

create or replace function private.broadcast_node_change()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
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
      v_payload || jsonb_build_object('node', to_jsonb(v_node) - 'secret_hash'),
      'node_' || lower(tg_op), 'owner:' || v_node.owner_id, true);
  end if;
  return null;
end;
$$;

drop trigger nodes_broadcast_update on public.nodes;
create trigger nodes_broadcast_update after update on public.nodes
  for each row execute function private.broadcast_node_change();

create or replace function private.node_scores_after_node_update()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  -- Only when a scored column changed: every claim and release (the in-flight count), new specs.
  if (old.region, old.vram_gb, old.tflops, old.hourly_rate, old.inflight, old.outside_load, old.max_concurrency,
      old.successes, old.failures, old.speed_ratio)
     is not distinct from (new.region, new.vram_gb, new.tflops, new.hourly_rate, new.inflight, new.outside_load,
                           new.max_concurrency, new.successes, new.failures, new.speed_ratio) then
    return null;
  end if;
  -- One cached plan updating this node's rows in place.
  update public.node_scores s set base_score = v.base_score, region = v.region
  from public.node_base_scores v
  where v.node_id = new.id and s.node_id = new.id and s.policy = v.policy and s.model_id = v.model_id
    and (s.base_score, s.region) is distinct from (v.base_score, v.region);
  return null;
end;
$$;

drop trigger nodes_refresh_scores_update on public.nodes;
create trigger nodes_refresh_scores_update after update on public.nodes
  for each row execute function private.node_scores_after_node_update();

create or replace function private.announce_free_slot()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- A slot to give: one was freed, or the node came online or got more slots.
  if new.status = 'online' and new.inflight < new.max_concurrency
     and (new.inflight < old.inflight or old.status <> 'online' or new.max_concurrency > old.max_concurrency) then
    -- One notification per transaction (Postgres folds identical ones): a batch of endings wakes
    -- the waiting gateways once, and each asks the matcher again.
    perform pg_notify('neuralgrid_slots', '');
  end if;
  return null;
end;
$$;

drop trigger nodes_announce_free_slot on public.nodes;
create trigger nodes_announce_free_slot after update on public.nodes
  for each row execute function private.announce_free_slot();

create or replace function private.record_node_status()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  -- On registering, and each time the node goes up (online, busy) or down (offline, draining).
  if tg_op = 'UPDATE' and (old.status in ('online', 'busy')) = (new.status in ('online', 'busy')) then
    return null;
  end if;
  -- Definer: owners insert and update their own nodes through the Data API, and may not write history.
  insert into public.node_status_changes (node_id, status) values (new.id, new.status);
  return null;
end;
$$;

drop trigger nodes_record_status_update on public.nodes;
create trigger nodes_record_status_update after update of status on public.nodes
  for each row execute function private.record_node_status();

-- jobs: a placement inserts one row per statement --------------------------------------------------

create or replace function private.mark_cold_start()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- One primary-key lookup per placed job: what pre-warm needs to tell cold placements from warm.
  if new.node_id is not null then
    new.cold_start := not exists (
      select 1 from public.node_models nm
      where nm.node_id = new.node_id and nm.model_id = new.model_id and nm.state = 'loaded'
    );
  end if;
  return new;
end;
$$;

drop trigger jobs_mark_cold_start on public.jobs;
create trigger jobs_mark_cold_start before insert on public.jobs
  for each row execute function private.mark_cold_start();

-- api_keys: a placement holds money on the key, one row per statement ------------------------------

create function private.api_keys_check_description() returns trigger
language plpgsql
set search_path = ''
as $$
declare
  v_rule text;  -- the first rule broken, in the order Postgres checks constraints (by name)
begin
  if not (new.budget_usd >= 0) then
    v_rule := 'budget_usd must not be negative';
  elsif not (length(trim(new.name)) between 1 and 100) then
    v_rule := 'key name must be 1 to 100 characters';
  elsif not (length(new.key_hash) = 32) then
    v_rule := 'key_hash must be a SHA-256 digest';
  elsif not (new.rpm_limit > 0) then
    v_rule := 'rpm_limit must be positive';
  elsif not (new.tpm_limit > 0) then
    v_rule := 'tpm_limit must be positive';
  end if;
  if v_rule is not null then
    raise exception 'new row for relation "%" violates check constraint "%"', tg_table_name, v_rule
      using errcode = 'check_violation', constraint = v_rule, table = tg_table_name, schema = tg_table_schema;
  end if;
  return new;
end;
$$;
comment on function private.api_keys_check_description() is 'Trigger: the rules about what a key is (name, hash, limits, budget), checked when a statement writes one of those columns; each raises the check_violation its CHECK constraint did.';
revoke execute on function private.api_keys_check_description() from public, anon, authenticated, service_role;

create trigger api_keys_validate before insert or update of budget_usd, name, key_hash, rpm_limit, tpm_limit
  on public.api_keys for each row execute function private.api_keys_check_description();

alter table public.api_keys
  drop constraint "budget_usd must not be negative",
  drop constraint "key name must be 1 to 100 characters",
  drop constraint "key_hash must be a SHA-256 digest",
  drop constraint "rpm_limit must be positive",
  drop constraint "tpm_limit must be positive";
