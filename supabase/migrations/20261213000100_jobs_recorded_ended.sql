-- A leased job that has ended by the time its gateway writes it is written once, as it ended (issue
-- 42). record_jobs() recorded it running, its first attempt running, and then ended both through
-- complete_jobs(): two inserts and two updates of the same fresh rows in one transaction, the
-- updates' foreign keys checked again (a row inserted by the same transaction is always re-checked).
-- Now complete_jobs()'s one statement, moved into private.end_jobs(), also takes such jobs' starts
-- and inserts the job and its attempt ended, priced and charged by the same expressions, so that the
-- price, the charge, the node's averages and the earning stay computed in one place; complete_jobs()
-- keeps its arguments and its checks, and end_jobs() trusts its callers'.
-- Measured side by side (`neuralgrid bench sql --compare`, 2026-12-04, three runs): a job written
-- start and end together cost Postgres 0.78x to 0.88x the CPU it did in groups of 14, 0.91x to
-- 1.03x alone; a start and a later end 1.02x to 1.10x; a placement and its end 0.98x to 1.04x (an
-- empty change measured 0.93x to 1.08x). In the gateway at 16 callers, with starts held back 0.1 s
-- (gateway/journal.py), Postgres CPU a leased request fell from 0.41 to 0.46 ms to 0.28 to 0.35.

-- The earnings rule, in one place: the trigger on jobs' updates and end_jobs()'s inserts call it.
create function private.write_earnings(p_job_ids uuid[])
returns void
language plpgsql
set search_path = ''
as $$
begin
  insert into public.earnings (job_id, node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd,
                               earned_at, settles_at, forfeited_at)
  select e.id, e.node_id, n.owner_id, e.model_id, e.cost_usd, s.platform_fee_rate, f.fee,
         e.cost_usd - f.fee, e.finished_at,
         e.finished_at + make_interval(secs => s.earnings_hold_s),
         case when exists (select 1 from public.model_checks c
                           where c.node_id = e.node_id and c.model_id = e.model_id and c.state = 'failed')
              then now() end
  from public.jobs e
  cross join public.platform_settings s
  cross join lateral (select round(e.cost_usd * s.platform_fee_rate, 8) as fee) f
  left join public.nodes n on n.id = e.node_id
  where e.id = any (p_job_ids) and e.api_key_id is not null
    and (e.status = 'succeeded' or (e.status = 'cancelled' and e.cost_usd > 0))
  order by e.id
  on conflict (job_id) do nothing;
end;
$$;

comment on function private.write_earnings(uuid[]) is
  'Writes the earnings ledger rows of the ended jobs named that were paid for (succeeded, or cancelled by their client after the node had worked): gross = the charge, the platform''s fee at platform_settings.platform_fee_rate, the owner''s net, held until earnings_hold_s after the end (forfeited at once when its (node, model) has failed verification); at most once per job.';

revoke all on function private.write_earnings(uuid[]) from public, anon, authenticated, service_role;
grant execute on function private.write_earnings(uuid[]) to service_role;

create or replace function private.record_earning()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- The statement's jobs that left 'running'. A second ending of the same job (it cannot happen
  -- through complete_jobs(), which ends running jobs only) writes nothing.
  perform private.write_earnings(array(
    select e.id from ended_now e join ended_before b on b.id = e.id where b.status = 'running'));
  return null;
end;
$$;

comment on function private.record_earning() is
  'Trigger, once per statement that updates jobs: the earnings (private.write_earnings()) of the jobs it ended.';

-- A job inserted ended (end_jobs()) is broadcast as one that ends is.
create trigger jobs_broadcast_recorded_ended
after insert on public.jobs
for each row when (new.status <> 'running')
execute function private.broadcast_job_change();

create function private.end_jobs(p_job_ids uuid[], p_statuses text[], p_prompt_tokens integer[],
                                 p_completion_tokens integer[], p_ttft_ms real[], p_latency_ms real[],
                                 p_errors text[], p_gateway uuid default null, p_new jsonb default null)
returns table (job_id uuid, cost_usd numeric, latency_ms real)
language plpgsql
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
as $$
declare
  v_running uuid[];
  v_fresh uuid[];  -- the jobs of p_new: not in the ledger yet
  v_keys uuid[];  -- the keys of the jobs it ends, each once
begin
  -- Locks in the order claims and completions take them (jobs, then nodes, then keys; each by id)
  -- so that batches and claims cannot deadlock one another. The sweepers lock in another order; a
  -- deadlock with one is detected by Postgres, and the gateway then writes the batch job by job.
  -- A job already ended (by the sweeper) is left out.
  -- "No key update", the lock an UPDATE takes: new jobs may still reference these nodes and keys.
  select array_agg(r.id order by r.id), array_agg(distinct r.api_key_id) filter (where r.api_key_id is not null)
    into v_running, v_keys
  from (
    select j.id, j.api_key_id from public.jobs j where j.id = any (p_job_ids) and j.status = 'running'
    order by j.id for no key update
  ) r;
  if p_new is not null then
    select array_agg((n.e ->> 'id')::uuid), v_keys || array_agg((n.e ->> 'key')::uuid) filter (where n.e ->> 'key' is not null)
      into v_fresh, v_keys
    from jsonb_array_elements(p_new) n (e);
  end if;
  if v_running is null and v_fresh is null then
    return;
  end if;
  perform from public.nodes n
  where n.id in (select a.node_id from public.job_attempts a where a.job_id = any (v_running) and a.status = 'running'
                 union select (x.e ->> 'node')::uuid from jsonb_array_elements(p_new) x (e))
  order by n.id for no key update;
  perform from public.api_keys k where k.id = any (v_keys) order by k.id for no key update;

  return query
  with input as (
    select * from unnest(p_job_ids, p_statuses, p_prompt_tokens, p_completion_tokens, p_ttft_ms,
                         p_latency_ms, p_errors)
      with ordinality as i (job_id, status, prompt_tokens, completion_tokens, ttft_ms, latency_ms, error, ord)
    where i.job_id = any (v_running) or i.job_id = any (v_fresh)
  ),
  fresh as (
    -- Jobs whose start and end are written together (record_jobs()): the start, as it recorded one.
    select f.id, f.key, f.model, f.policy, f.region, coalesce(f.stream, false) as stream, f.node, f.started_at,
           f.end_user, k.owner_id, case when k.budget_usd is not null then round(f.hold_usd, 8) else 0 end as reserved_usd
    from jsonb_to_recordset(p_new) as f (id uuid, key uuid, model text, policy text, region text, stream boolean,
                                          node uuid, started_at timestamptz, hold_usd numeric, end_user text)
    left join public.api_keys k on k.id = f.key
  ),
  ended as (
    update public.job_attempts a
    set status = i.status, error = i.error, ttft_ms = i.ttft_ms,
        latency_ms = coalesce(i.latency_ms, 1000 * extract(epoch from clock_timestamp() - a.started_at)),
        ended_at = clock_timestamp()
    from input i
    where a.job_id = any (v_running) and a.job_id = i.job_id and a.status = 'running'
    returning a.job_id, a.node_id, a.leased, a.latency_ms, i.status, i.prompt_tokens, i.completion_tokens,
              i.ttft_ms, i.error, i.ord
  ),
  fresh_attempts as (
    -- Their first attempt, on a leased slot, inserted ended.
    insert into public.job_attempts as a (job_id, attempt, node_id, leased, started_at, status, error, ttft_ms,
                                          latency_ms, ended_at)
    select f.id, 1, f.node, true, f.started_at, i.status, i.error, i.ttft_ms,
           coalesce(i.latency_ms, 1000 * extract(epoch from clock_timestamp() - f.started_at)), clock_timestamp()
    from fresh f join input i on i.job_id = f.id
    returning a.job_id, a.node_id, a.leased, a.latency_ms
  ),
  endings as (
    -- Each ending with its job's key, hold, model and kind: from the ledger, or from the record.
    select e.*, j.api_key_id, j.reserved_usd, j.model_id, j.stream
    from ended e join public.jobs j on j.id = e.job_id
    union all
    select x.job_id, x.node_id, x.leased, x.latency_ms, i.status, i.prompt_tokens, i.completion_tokens,
           i.ttft_ms, i.error, i.ord, f.key, f.reserved_usd, f.model, f.stream
    from fresh_attempts x join input i on i.job_id = x.job_id join fresh f on f.id = x.job_id
  ),
  costed as (
    select e.*,
           -- The catalog's per-token price, else a slot of the node's time: for an answer (a speech
           -- has no tokens), a job that used some, or one its client left; not for one the node
           -- failed before any token, nor for its own refusal (the gateway's words for it:
           -- pipeline/send.py ClientError, pipeline/__init__.py).
           round(coalesce(case
             when m.input_usd_per_mtok is not null then
               (e.prompt_tokens * m.input_usd_per_mtok + e.completion_tokens * coalesce(m.output_usd_per_mtok, 0)) / 1e6
             when e.status = 'succeeded' or e.prompt_tokens + e.completion_tokens > 0
                  or (e.status = 'cancelled' and coalesce(e.error, '') not like 'HTTP 4__ from the node:%') then
               -- A slot's price: the node's now, or its floor while a rise is recent (see above).
               (least(n.hourly_rate / n.max_concurrency,
                      case when n.price_floor_until > now() then n.slot_price_floor end)
                * (e.latency_ms / 3.6e6))::numeric
           end, 0), 8) as full_cost,
           t.tps,
           t.tps / (n.tflops * m.tokens_per_s_per_tflop) as ratio,
           max(e.ord) filter (where e.status = 'succeeded') over (partition by e.node_id) as last_success
    from endings e
    left join public.models m on m.id = e.model_id
    left join public.nodes n on n.id = e.node_id
    cross join lateral (
      -- Decode speed, from streams only: a whole answer's first byte comes with its last token.
      select case when e.stream and e.completion_tokens > 0 and e.latency_ms > coalesce(e.ttft_ms, 0)
                  then e.completion_tokens / ((e.latency_ms - coalesce(e.ttft_ms, 0)) / 1000.0) end as tps
    ) t
  ),
  running_total as (
    -- What the key's budget has room for once these jobs' holds are let go (the other running jobs'
    -- holds stay), and the batch's charges to the key so far.
    select c.*,
           k.budget_usd - k.spent_usd
             - greatest(k.reserved_usd - sum(c.reserved_usd) over (partition by c.api_key_id), 0) as room,
           sum(c.full_cost) over (partition by c.api_key_id order by c.ord) as upto
    from costed c
    left join public.api_keys k on k.id = c.api_key_id
  ),
  priced as (
    -- A charge never takes a key past its budget: a hold is an estimate (a prompt of digits or code
    -- runs near a token a byte, against the four it assumes), so the one ending that would cross
    -- the budget is charged what is left of it.
    select r.*,
           case when r.room is null then r.full_cost
                else greatest(least(r.upto, r.room), 0) - greatest(least(r.upto - r.full_cost, r.room), 0)
           end as cost
    from running_total r
  ),
  jobs_done as (
    update public.jobs j
    set status = p.status, prompt_tokens = p.prompt_tokens, completion_tokens = p.completion_tokens,
        cost_usd = p.cost, ttft_ms = p.ttft_ms, latency_ms = p.latency_ms, error = p.error, finished_at = now()
    from ended e join priced p on p.job_id = e.job_id
    where j.id = e.job_id
  ),
  jobs_fresh as (
    insert into public.jobs (id, api_key_id, owner_id, model_id, policy, status, node_id, attempts, stream, region,
                             min_vram_gb, reserved_usd, created_at, gateway_id, end_user, prompt_tokens,
                             completion_tokens, cost_usd, ttft_ms, latency_ms, error, finished_at)
    select f.id, f.key, f.owner_id, f.model, f.policy, p.status, f.node, 1, f.stream, f.region,
           private.required_vram_gb(f.model), f.reserved_usd, f.started_at, p_gateway, f.end_user,
           p.prompt_tokens, p.completion_tokens, p.cost, p.ttft_ms, p.latency_ms, p.error, now()
    from priced p join fresh f on f.id = p.job_id
  ),
  per_node as (
    select p.node_id,
           -- An attempt on a leased slot frees nothing: the lease holds the slot (renew_leases()).
           count(*) filter (where not p.leased) as freed,
           count(*) filter (where p.status = 'succeeded') as succeeded,
           count(*) filter (where p.status = 'failed') as failed,
           count(*) filter (where p.status = 'failed' and p.ord > coalesce(p.last_success, 0)) as failed_since_success,
           bool_or(p.last_success is not null) as any_success,
           (array_agg(p.status order by p.ord desc) filter (where p.status <> 'cancelled'))[1] as last_outcome,
           array_agg(p.latency_ms::float8 order by p.ord) filter (where p.status = 'succeeded') as latencies,
           array_agg(p.tps order by p.ord) filter (where p.status = 'succeeded') as speeds,
           array_agg(p.ratio order by p.ord) filter (where p.status = 'succeeded') as ratios
    from priced p
    where p.node_id is not null
    group by p.node_id
  ),
  nodes_done as (
    -- release_node() and the EWMA updates (latency, speed, speed ratio), once per node per batch.
    update public.nodes n
    set inflight = greatest(n.inflight - c.freed, 0),
        status = case when n.status = 'busy' and c.freed > 0 then 'online' else n.status end,
        successes = n.successes + c.succeeded,
        failures = n.failures + c.failed,
        consecutive_failures = case when c.any_success then c.failed_since_success
                                    else n.consecutive_failures + c.failed end,
        cooldown_until = case c.last_outcome
          when 'succeeded' then null
          when 'failed' then private.cooldown_until(
            case when c.any_success then c.failed_since_success else n.consecutive_failures + c.failed end,
            s.cooldown_base_s, s.cooldown_max_s)
          else n.cooldown_until end,
        ewma_latency_ms = private.ewma_fold(n.ewma_latency_ms, c.latencies),
        ewma_tokens_per_s = private.ewma_fold(n.ewma_tokens_per_s, c.speeds),
        speed_ratio = private.ewma_fold(n.speed_ratio, c.ratios)
    from per_node c, public.platform_settings s
    where n.id = c.node_id
  ),
  keys_done as (
    -- release_reservation(), once per key.
    update public.api_keys k
    set reserved_usd = greatest(k.reserved_usd - t.held, 0), spent_usd = k.spent_usd + t.cost, last_used_at = now()
    -- Each charge rounded to the column's 8 decimals (costed), as one ending after another leaves it.
    from (select p.api_key_id, sum(p.reserved_usd) as held, sum(p.cost) as cost
          from priced p where p.api_key_id is not null group by p.api_key_id) t
    where k.id = t.api_key_id
  )
  select p.job_id, p.cost, p.latency_ms from priced p order by p.ord;

  -- The fresh jobs' earnings, as the trigger on jobs' updates writes the others' (a statement
  -- trigger on inserts would cost every placement its transition table).
  if v_fresh is not null then
    perform private.write_earnings(v_fresh);
  end if;
end;
$$;

comment on function private.end_jobs(uuid[], text[], integer[], integer[], real[], real[], text[], uuid, jsonb) is
  'Ends a batch of jobs (parallel arrays, one entry per job) as ending them one by one, in order, would: usage, cost charged to keys, node reputation and EWMA speed, slots released (not those of attempts on leased slots, which their leases hold). The running jobs named are ended; so are the jobs of p_new (record_jobs()''s records, already checked, not yet in the ledger), recorded as p_gateway''s, ended, with their first attempt leased. Returns the jobs it ended. The one place a job''s price and its node''s moving averages are computed; callers check their input (complete_jobs(), record_jobs()).';

revoke all on function private.end_jobs(uuid[], text[], integer[], integer[], real[], real[], text[], uuid, jsonb)
  from public, anon, authenticated, service_role;
grant execute on function private.end_jobs(uuid[], text[], integer[], integer[], real[], real[], text[], uuid, jsonb)
  to service_role;

create or replace function public.complete_jobs(p_job_ids uuid[], p_statuses text[], p_prompt_tokens integer[],
                                                p_completion_tokens integer[], p_ttft_ms real[], p_latency_ms real[],
                                                p_errors text[])
returns table (job_id uuid, cost_usd numeric, latency_ms real)
language plpgsql
set search_path = ''
as $$
declare
  v_count integer := coalesce(cardinality(p_job_ids), 0);
begin
  if v_count <> any (array[coalesce(cardinality(p_statuses), 0), coalesce(cardinality(p_prompt_tokens), 0),
                           coalesce(cardinality(p_completion_tokens), 0), coalesce(cardinality(p_ttft_ms), 0),
                           coalesce(cardinality(p_latency_ms), 0), coalesce(cardinality(p_errors), 0)]) then
    raise exception 'complete_jobs takes arrays of one length' using errcode = 'invalid_parameter_value';
  end if;
  if exists (select from unnest(p_statuses) s where s is null or s not in ('succeeded', 'failed', 'cancelled')) then
    raise exception 'a job ends succeeded, failed or cancelled' using errcode = 'invalid_parameter_value';
  end if;
  if exists (select from unnest(p_prompt_tokens, p_completion_tokens) t (p, c)
             where p is null or c is null or p < 0 or c < 0) then
    raise exception 'token counts must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if (select count(distinct j) from unnest(p_job_ids) j) <> v_count or array_position(p_job_ids, null) is not null then
    raise exception 'each job appears once in a batch' using errcode = 'invalid_parameter_value';
  end if;
  return query
  select e.job_id, e.cost_usd, e.latency_ms
  from private.end_jobs(p_job_ids, p_statuses, p_prompt_tokens, p_completion_tokens, p_ttft_ms, p_latency_ms,
                        p_errors) e;
end;
$$;

comment on function public.complete_jobs(uuid[], text[], integer[], integer[], real[], real[], text[]) is
  'Ends a batch of running jobs (parallel arrays, one entry per job) as ending them one by one, in order, would: usage, cost charged to keys, node reputation and EWMA speed, slots released (not those of attempts on leased slots, which their leases hold). Returns the jobs it ended; jobs no longer running are left out. Checks its input and calls private.end_jobs(), the one place a job''s price and its node''s moving averages are computed.';

create or replace function public.record_jobs(p_gateway uuid, p_jobs jsonb)
returns table (job_id uuid, cost_usd numeric, recorded text)
language plpgsql
set search_path = ''
set plan_cache_mode = 'force_generic_plan'
as $_$
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
  v_fresh uuid[];  -- those of them it records ended (start and end together)
  v_stale uuid[];  -- jobs it found new that a call beside it recorded first
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

  -- The new jobs: those still running recorded as place() records a placed one, each with its
  -- leased first attempt; those that have ended are written ended, by end_jobs() below.
  v_fresh := array(select u.id from unnest(v_ids, v_ends) u (id, e)
                   where u.e is not null and not exists (select from public.jobs j where j.id = u.id)
                   order by u.id);
  with input as (
    select u.*, k.budget_usd is not null as budgeted, k.owner_id
    from unnest(v_ids, v_keys, v_models, v_policies, v_regions, v_streams, v_nodes, v_starts, v_holds, v_users, v_ends)
      with ordinality as u (id, key, model, policy, region, stream, node, started_at, hold, end_user, e, n)
    left join public.api_keys k on k.id = u.key
    where u.e is null and not exists (select from public.jobs j where j.id = u.id)
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
  select coalesce(array_agg(r.id), '{}') || v_fresh into v_new from recorded r;

  -- The nodes and keys of what it ends, in complete_jobs()'s order: nodes by id, then keys by id.
  v_ending := array(
    select u.id from unnest(v_ids, v_ends) as u (id, e)
    join public.jobs j on j.id = u.id
    where u.e is not null and j.status = 'running');
  perform from public.nodes n
  where n.id in (select a.node_id from public.job_attempts a where a.job_id = any (v_ending) and a.status = 'running'
                 union select u.node from unnest(v_ids, v_nodes) u (id, node) where u.id = any (v_fresh))
  order by n.id for no key update;
  perform from public.api_keys k
  where k.id in (select j.api_key_id from public.jobs j where j.id = any (v_new || v_ending)
                 union select u.key from unnest(v_ids, v_keys) u (id, key) where u.id = any (v_fresh))
  order by k.id for no key update;
  -- A call beside this one may have recorded one of the jobs it found new (a retried batch, a spool
  -- written twice): it held their nodes until it committed, so the ledger now says which are.
  if v_fresh <> '{}' then
    v_stale := array(select f from unnest(v_fresh) f where exists (select from public.jobs j where j.id = f));
    if v_stale <> '{}' then
      v_fresh := array(select f from unnest(v_fresh) f where not f = any (v_stale));
      v_new := array(select f from unnest(v_new) f where not f = any (v_stale));
      v_ending := v_ending || array(select j.id from public.jobs j where j.id = any (v_stale) and j.status = 'running');
    end if;
  end if;

  -- The new jobs' holds leave the gateway's escrows for their keys (what an escrow lacks is held on
  -- the key anew).
  with held as (
    select u.key as api_key_id, sum(round(u.hold, 8)) as usd
    from unnest(v_ids, v_keys, v_holds) u (id, key, hold)
    join public.api_keys k on k.id = u.key and k.budget_usd is not null
    where u.id = any (v_new) and u.hold > 0
    group by u.key
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

  -- The ends, written as every ending is, a slice at a time (the statement grows faster than its
  -- batch past about a hundred jobs; the locks are all held already).
  select array_agg(u.id order by u.id), array_agg(u.e ->> 'status' order by u.id),
         array_agg(coalesce((u.e ->> 'prompt_tokens')::integer, 0) order by u.id),
         array_agg(coalesce((u.e ->> 'completion_tokens')::integer, 0) order by u.id),
         array_agg((u.e ->> 'ttft_ms')::real order by u.id), array_agg((u.e ->> 'latency_ms')::real order by u.id),
         array_agg(u.e ->> 'error' order by u.id)
    into v_end_ids, v_statuses, v_prompts, v_completions, v_ttfts, v_latencies, v_errors
  from unnest(v_ids, v_ends) as u (id, e)
  where u.id = any (v_ending) or u.id = any (v_fresh);
  v_costs := '{}';
  for v_at in 1 .. coalesce(cardinality(v_end_ids), 0) by 64 loop
    select v_costs || coalesce(jsonb_object_agg(c.job_id, c.cost_usd), '{}') into v_costs
    from private.end_jobs(v_end_ids[v_at:v_at + 63], v_statuses[v_at:v_at + 63], v_prompts[v_at:v_at + 63],
                          v_completions[v_at:v_at + 63], v_ttfts[v_at:v_at + 63], v_latencies[v_at:v_at + 63],
                          v_errors[v_at:v_at + 63], p_gateway,
                          (select jsonb_agg(j.e) from jsonb_array_elements(p_jobs) j (e)
                           where (j.e ->> 'id')::uuid = any (v_fresh)
                             and (j.e ->> 'id')::uuid = any (v_end_ids[v_at:v_at + 63]))) c;
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
$_$;


comment on function public.record_jobs(uuid, jsonb) is
  'A gateway''s leased jobs, written behind, idempotently. p_jobs: a JSON array (at most 1000) of records, {"id": the job''s id (made at the gateway), "key": API key id or null, "model", "policy", "region": text or null, "stream": bool, "node": node id, "started_at": ISO 8601 time, "hold_usd": the budget hold, "end_user": text or null, "end": null or {"status": succeeded|failed|cancelled, "prompt_tokens", "completion_tokens", "ttft_ms", "latency_ms", "error"}}. A job not yet recorded is recorded as p_gateway''s, its first attempt leased, its hold moved from the gateway''s escrow for the key (private.key_escrows) to the job: running, or, when its record carries its end, ended at once (one insert each of the job and its attempt); an end is written by private.end_jobs() as complete_jobs() writes one (price, charge, earnings, reputation, moving averages; no slot freed for a leased attempt) unless the job has ended already. Returns a row per record, in order: the job''s cost once ended, and what was done (started, ended, started+ended, already). A batch with a record at fault changes nothing: invalid_parameter_value (foreign_key_violation for a node or key that does not exist) naming the record.';
