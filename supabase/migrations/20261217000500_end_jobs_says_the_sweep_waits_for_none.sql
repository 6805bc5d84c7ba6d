-- end_jobs()'s comment on lock order: the sweep no longer locks in another order and leaves a
-- deadlock to Postgres; it waits for no row another transaction holds (20261217000400). The body is
-- otherwise unchanged.

CREATE OR REPLACE FUNCTION private.end_jobs(p_job_ids uuid[], p_statuses text[], p_prompt_tokens integer[], p_completion_tokens integer[], p_ttft_ms real[], p_latency_ms real[], p_errors text[], p_gateway uuid DEFAULT NULL::uuid, p_new jsonb DEFAULT NULL::jsonb) RETURNS TABLE(job_id uuid, cost_usd numeric, latency_ms real)
    LANGUAGE plpgsql
    SET search_path TO ''
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
declare
  v_running uuid[];
  v_fresh uuid[];  -- the jobs of p_new: not in the ledger yet
  v_keys uuid[];  -- the keys of the jobs it ends, each once
begin
  -- Locks in the order claims and completions take them (jobs, then nodes, then keys; each by id)
  -- so that batches and claims cannot deadlock one another. The sweep waits for no row another
  -- transaction holds (it skips it: 20261217000400), so it cannot deadlock with one either.
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
