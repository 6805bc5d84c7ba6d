-- Leases (issue 42): record_jobs() writes a batch's ends through complete_jobs() 64 at a time.
--
-- complete_jobs() costs more a job the more jobs one call ends: measured on the embedded Postgres,
-- 0.12-0.2 ms a job up to 200 jobs a call, 0.44 ms at 400 and 1.25 ms at 800. A gateway writes up to
-- 500 records a call (gateway/journal.py), so record_jobs() now hands complete_jobs() its ends in
-- slices of 64, in job id order. Every lock the slices need (the jobs, their nodes, their keys) is
-- taken before the first, in complete_jobs()'s order, so the slices add no lock-order hazard.

create or replace function public.record_jobs(p_gateway uuid, p_jobs jsonb)
returns table (job_id uuid, cost_usd numeric, recorded text)
language plpgsql
set search_path = ''
as $$
declare
  v_uuid constant text := '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$';
  v_time constant text := '^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)?$';
  v_usd constant text := '^\d{1,8}(\.\d{1,20})?([eE][-+]?\d{1,2})?$';  -- also as Python's str(Decimal) writes it
  v_bad record;
  v_n integer;
  v_ids uuid[];
  v_keys uuid[];
  v_models text[];
  v_policies text[];
  v_regions text[];
  v_streams boolean[];
  v_nodes uuid[];
  v_starts timestamptz[];
  v_holds numeric[];
  v_users text[];
  v_ends jsonb[];
  v_new uuid[];  -- the jobs this call records
  v_ending uuid[];  -- the jobs whose end this call writes
  v_costs jsonb;  -- {job id: cost} of the jobs it ended
  v_end_ids uuid[];  -- the ends to write, by job id, as complete_jobs() takes them
  v_statuses text[];
  v_prompts integer[];
  v_completions integer[];
  v_ttfts real[];
  v_latencies real[];
  v_errors text[];
  v_at integer;
begin
  if p_gateway is null then
    raise exception 'record_jobs needs the gateway''s id' using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_typeof(p_jobs) is distinct from 'array' then
    raise exception 'record_jobs takes a JSON array of job records' using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_array_length(p_jobs) > 1000 then
    raise exception 'record_jobs takes at most 1000 records, not %', jsonb_array_length(p_jobs)
      using errcode = 'invalid_parameter_value';
  end if;

  -- Each record's first fault, if any: the call is refused naming the first record at fault.
  select x.n, x.e ->> 'id' as id, x.fault into v_bad
  from (
    select j.n, j.e, case
      when jsonb_typeof(j.e) is distinct from 'object' then 'a job record is a JSON object'
      when jsonb_typeof(j.e -> 'id') is distinct from 'string' or length(j.e ->> 'id') <> 36 or j.e ->> 'id' !~ v_uuid
        then '"id" must be the job''s id (a UUID)'
      when coalesce(jsonb_typeof(j.e -> 'key'), 'null') not in ('null', 'string')
           or length(j.e ->> 'key') <> 36 or j.e ->> 'key' !~ v_uuid
        then '"key" must be an API key''s id (a UUID) or null'
      when jsonb_typeof(j.e -> 'model') is distinct from 'string' then '"model" must be a string'
      when jsonb_typeof(j.e -> 'policy') is distinct from 'string' then '"policy" must be a string'
      when coalesce(jsonb_typeof(j.e -> 'region'), 'null') not in ('null', 'string') then '"region" must be a string or null'
      when coalesce(jsonb_typeof(j.e -> 'stream'), 'null') not in ('null', 'boolean') then '"stream" must be true or false'
      when jsonb_typeof(j.e -> 'node') is distinct from 'string' or length(j.e ->> 'node') <> 36 or j.e ->> 'node' !~ v_uuid
        then '"node" must be the node''s id (a UUID)'
      when jsonb_typeof(j.e -> 'started_at') is distinct from 'string' or j.e ->> 'started_at' !~ v_time
        then '"started_at" must be a time (ISO 8601)'
      when coalesce(jsonb_typeof(j.e -> 'hold_usd'), 'null') not in ('number', 'string') or j.e ->> 'hold_usd' !~ v_usd
        then '"hold_usd" must be an amount in USD, 0 or more'
      when coalesce(jsonb_typeof(j.e -> 'end_user'), 'null') not in ('null', 'string') or length(j.e ->> 'end_user') > 256
        then '"end_user" must be a string of at most 256 characters, or null'
      when coalesce(jsonb_typeof(j.e -> 'end'), 'null') not in ('null', 'object') then '"end" must be an object or null'
      when jsonb_typeof(j.e -> 'end') = 'object' then case
        when coalesce(j.e -> 'end' ->> 'status', '') not in ('succeeded', 'failed', 'cancelled')
          then 'its end''s "status" must be succeeded, failed or cancelled'
        when coalesce(jsonb_typeof(j.e -> 'end' -> 'prompt_tokens'), 'number') <> 'number'
             or coalesce(jsonb_typeof(j.e -> 'end' -> 'completion_tokens'), 'number') <> 'number'
             or coalesce(j.e -> 'end' ->> 'prompt_tokens', '0') !~ '^\d{1,9}$'
             or coalesce(j.e -> 'end' ->> 'completion_tokens', '0') !~ '^\d{1,9}$'
          then 'its end''s token counts must be whole numbers, 0 or more'
        when coalesce(jsonb_typeof(j.e -> 'end' -> 'ttft_ms'), 'null') not in ('null', 'number')
             or coalesce(jsonb_typeof(j.e -> 'end' -> 'latency_ms'), 'null') not in ('null', 'number')
          then 'its end''s "ttft_ms" and "latency_ms" must be numbers or null'
        when coalesce(jsonb_typeof(j.e -> 'end' -> 'error'), 'null') not in ('null', 'string')
          then 'its end''s "error" must be a string or null'
        end
      end as fault
    from jsonb_array_elements(p_jobs) with ordinality as j (e, n)
  ) x
  where x.fault is not null
  order by x.n
  limit 1;
  if found then
    raise exception 'job record % (%): %', v_bad.n, coalesce(v_bad.id, '?'), v_bad.fault
      using errcode = 'invalid_parameter_value';
  end if;

  begin
    select array_agg((j.e ->> 'id')::uuid order by j.n), array_agg((j.e ->> 'key')::uuid order by j.n),
           array_agg(j.e ->> 'model' order by j.n), array_agg(j.e ->> 'policy' order by j.n),
           array_agg(j.e ->> 'region' order by j.n), array_agg(coalesce((j.e ->> 'stream')::boolean, false) order by j.n),
           array_agg((j.e ->> 'node')::uuid order by j.n), array_agg((j.e ->> 'started_at')::timestamptz order by j.n),
           array_agg((j.e ->> 'hold_usd')::numeric order by j.n), array_agg(j.e ->> 'end_user' order by j.n),
           array_agg(nullif(j.e -> 'end', 'null') order by j.n)
      into v_ids, v_keys, v_models, v_policies, v_regions, v_streams, v_nodes, v_starts, v_holds, v_users, v_ends
    from jsonb_array_elements(p_jobs) with ordinality as j (e, n);
  exception when data_exception then
    raise exception 'a job record could not be read: %', sqlerrm using errcode = 'invalid_parameter_value';
  end;
  if v_ids is null then
    return;
  end if;
  select min(u.n) filter (where u.n > f.first) into v_n
  from unnest(v_ids) with ordinality as u (id, n)
  join (select w.id, min(w.n) as first from unnest(v_ids) with ordinality as w (id, n) group by w.id) f on f.id = u.id;
  if v_n is not null then
    raise exception 'job record % (%): the job appears twice in the batch', v_n, v_ids[v_n]
      using errcode = 'invalid_parameter_value';
  end if;

  -- Locks as complete_jobs() takes them: the jobs named that exist, by id.
  perform from public.jobs j where j.id = any (v_ids) order by j.id for no key update;
  -- What a new job names must exist, and its lane be one a placement could have asked for.
  select u.n, u.id, case
      when not exists (select from public.nodes n where n.id = u.node) then format('no node with id %s', u.node)
      when u.key is not null and not exists (select from public.api_keys k where k.id = u.key)
        then format('no API key with id %s', u.key)
    end as fault,
    case
      when not exists (select from public.models m where m.id = u.model)
           and not exists (select from public.node_models nm where nm.model_id = u.model)
        then format('unknown model "%s": not in the catalog and held by no node', u.model)
      when u.policy <> 'seed' and not exists (select from public.matching_policies w where w.name = u.policy)
        then format('unknown matching policy "%s"', u.policy)
    end as bad_lane
    into v_bad
  from unnest(v_ids, v_nodes, v_keys, v_models, v_policies) with ordinality as u (id, node, key, model, policy, n)
  where not exists (select from public.jobs j where j.id = u.id)
    and (not exists (select from public.nodes n where n.id = u.node)
         or (u.key is not null and not exists (select from public.api_keys k where k.id = u.key))
         or (not exists (select from public.models m where m.id = u.model)
             and not exists (select from public.node_models nm where nm.model_id = u.model))
         or (u.policy <> 'seed' and not exists (select from public.matching_policies w where w.name = u.policy)))
  order by u.n
  limit 1;
  if found and v_bad.fault is not null then
    raise exception 'job record % (%): %', v_bad.n, v_bad.id, v_bad.fault using errcode = 'foreign_key_violation';
  elsif found then
    raise exception 'job record % (%): %', v_bad.n, v_bad.id, v_bad.bad_lane using errcode = 'invalid_parameter_value';
  end if;

  -- The new jobs, as place() records a placed one, each with its leased first attempt.
  with input as (
    select u.*, k.budget_usd is not null as budgeted, k.owner_id
    from unnest(v_ids, v_keys, v_models, v_policies, v_regions, v_streams, v_nodes, v_starts, v_holds, v_users)
      with ordinality as u (id, key, model, policy, region, stream, node, started_at, hold, end_user, n)
    left join public.api_keys k on k.id = u.key
    where not exists (select from public.jobs j where j.id = u.id)
  ),
  recorded as (
    insert into public.jobs as j (id, api_key_id, owner_id, model_id, policy, status, node_id, attempts, stream,
                                  region, min_vram_gb, reserved_usd, created_at, gateway_id, end_user)
    select i.id, i.key, i.owner_id, i.model, i.policy, 'running', i.node, 1, i.stream, i.region,
           private.required_vram_gb(i.model), case when i.budgeted then i.hold else 0 end, i.started_at, p_gateway,
           i.end_user
    from input i
    order by i.n
    on conflict on constraint jobs_pkey do nothing
    returning j.id, j.node_id, j.created_at
  ),
  attempts as (
    insert into public.job_attempts (job_id, attempt, node_id, leased, started_at)
    select r.id, 1, r.node_id, true, r.created_at from recorded r
  )
  select array_agg(r.id order by r.id) into v_new from recorded r;

  -- Its end's nodes and keys, in complete_jobs()'s order: nodes by id, then keys by id.
  v_ending := array(
    select u.id from unnest(v_ids, v_ends) as u (id, e)
    join public.jobs j on j.id = u.id
    where u.e is not null and j.status = 'running');
  perform from public.nodes n
  where n.id in (select a.node_id from public.job_attempts a where a.job_id = any (v_ending) and a.status = 'running')
  order by n.id for no key update;
  perform from public.api_keys k
  where k.id in (select j.api_key_id from public.jobs j where j.id = any (v_new || v_ending))
  order by k.id for no key update;

  -- The new jobs' holds leave the gateway's escrows for their keys (what an escrow lacks is held on
  -- the key anew).
  with held as (
    select j.api_key_id, sum(j.reserved_usd) as usd
    from public.jobs j
    where j.id = any (v_new) and j.reserved_usd > 0
    group by j.api_key_id
  ),
  escrowed as (
    select h.api_key_id, h.usd, least(h.usd, coalesce(e.usd, 0)) as taken
    from held h
    left join private.key_escrows e on e.gateway_id = p_gateway and e.api_key_id = h.api_key_id
  ),
  escrows_moved as (
    update private.key_escrows e set usd = e.usd - x.taken
    from escrowed x
    where e.gateway_id = p_gateway and e.api_key_id = x.api_key_id and x.taken > 0
  )
  update public.api_keys k set reserved_usd = k.reserved_usd + x.usd - x.taken
  from escrowed x
  where k.id = x.api_key_id and x.usd > x.taken;

  -- The ends, written as every ending is, a slice at a time (complete_jobs() grows faster than its
  -- batch past about a hundred jobs; the locks are all held already).
  select array_agg(u.id order by u.id), array_agg(u.e ->> 'status' order by u.id),
         array_agg(coalesce((u.e ->> 'prompt_tokens')::integer, 0) order by u.id),
         array_agg(coalesce((u.e ->> 'completion_tokens')::integer, 0) order by u.id),
         array_agg((u.e ->> 'ttft_ms')::real order by u.id), array_agg((u.e ->> 'latency_ms')::real order by u.id),
         array_agg(u.e ->> 'error' order by u.id)
    into v_end_ids, v_statuses, v_prompts, v_completions, v_ttfts, v_latencies, v_errors
  from unnest(v_ids, v_ends) as u (id, e)
  where u.id = any (v_ending);
  v_costs := '{}';
  for v_at in 1 .. coalesce(cardinality(v_end_ids), 0) by 64 loop
    select v_costs || coalesce(jsonb_object_agg(c.job_id, c.cost_usd), '{}') into v_costs
    from public.complete_jobs(v_end_ids[v_at:v_at + 63], v_statuses[v_at:v_at + 63], v_prompts[v_at:v_at + 63],
                              v_completions[v_at:v_at + 63], v_ttfts[v_at:v_at + 63], v_latencies[v_at:v_at + 63],
                              v_errors[v_at:v_at + 63]) c;
  end loop;

  return query
  select u.id,
         case when v_costs ? u.id::text then (v_costs ->> u.id::text)::numeric
              when j.status <> 'running' then j.cost_usd end,
         case when u.id = any (v_new) and v_costs ? u.id::text then 'started+ended'
              when u.id = any (v_new) then 'started'
              when v_costs ? u.id::text then 'ended'
              else 'already' end
  from unnest(v_ids) with ordinality as u (id, n)
  join public.jobs j on j.id = u.id
  order by u.n;
end;
$$;
comment on function public.record_jobs(uuid, jsonb) is 'A gateway''s leased jobs, written behind, idempotently. p_jobs: a JSON array (at most 1000) of records, {"id": the job''s id (made at the gateway), "key": API key id or null, "model", "policy", "region": text or null, "stream": bool, "node": node id, "started_at": ISO 8601 time, "hold_usd": the budget hold, "end_user": text or null, "end": null or {"status": succeeded|failed|cancelled, "prompt_tokens", "completion_tokens", "ttft_ms", "latency_ms", "error"}}. A job not yet recorded is recorded running on its node as p_gateway''s, its first attempt leased, its hold moved from the gateway''s escrow for the key (private.key_escrows) to the job; an end is written by complete_jobs() (price, charge, earnings, reputation, moving averages; no slot freed for a leased attempt) unless the job has ended already. Returns a row per record, in order: the job''s cost once ended, and what was done (started, ended, started+ended, already). A batch with a record at fault changes nothing: invalid_parameter_value (foreign_key_violation for a node or key that does not exist) naming the record.';
