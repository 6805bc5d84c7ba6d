-- A rise in a node's price applies to jobs placed a job deadline after it; a cut, at once.
--
-- Found by a security review, as the authenticated role through the Data API: a job priced by node
-- time was charged the node's price per slot as it was when the job ended. Its owner raised the
-- price a million-fold and cut the slots to one mid-job: a one-minute job cost its key $16,666
-- (a budgeted key, all its budget) and earned the owner 85% of it.
--
-- A job's price is not recorded at placement (that would be one more write on every claim, for
-- the few models priced by node time). A node keeps instead the lowest price per slot it has had
-- since its last change, until a job deadline (platform_settings.job_deadline_s: no job runs longer)
-- has passed: a job is charged the lower of that and the price now, so never more than when it was
-- placed. A rise takes effect for jobs a deadline later; a cut, at once.

alter table public.nodes
  add column slot_price_floor numeric,
  add column price_floor_until timestamptz;
comment on column public.nodes.slot_price_floor is 'The lowest price per slot (hourly_rate / max_concurrency, USD an hour) the node has had since price_floor_until less a job deadline: what a job priced by node time is charged at most until then.';
comment on column public.nodes.price_floor_until is 'When the price floor lapses: a job deadline after the node''s price per slot last changed.';

create function private.nodes_keep_price_floor() returns trigger
language plpgsql
set search_path = ''
as $$
declare
  v_was numeric := old.hourly_rate / old.max_concurrency;
begin
  -- (A count of 0 is the description trigger's to refuse, by name: not a division by zero here.)
  if new.hourly_rate / nullif(new.max_concurrency, 0) is distinct from v_was then
    new.slot_price_floor := least(v_was, case when old.price_floor_until > now() then old.slot_price_floor end);
    new.price_floor_until := now() + make_interval(secs => (select s.job_deadline_s from public.platform_settings s));
  end if;
  return new;
end;
$$;
comment on function private.nodes_keep_price_floor() is 'Trigger: when a node''s price per slot changes, keeps the lowest it has had (slot_price_floor) for a job deadline (price_floor_until), so no job running then is charged a rise (complete_jobs()).';
revoke execute on function private.nodes_keep_price_floor() from public, anon, authenticated, service_role;

create trigger nodes_keep_price_floor before update of hourly_rate, max_concurrency on public.nodes
  for each row execute function private.nodes_keep_price_floor();

create or replace function public.complete_jobs(
  p_job_ids uuid[],
  p_statuses text[],
  p_prompt_tokens integer[],
  p_completion_tokens integer[],
  p_ttft_ms real[],
  p_latency_ms real[],
  p_errors text[]
) returns table (job_id uuid, cost_usd numeric, latency_ms real)
language plpgsql
set search_path = ''
set plan_cache_mode = force_generic_plan  -- 20261203000300: planned once per connection
as $$
declare
  v_count integer := coalesce(cardinality(p_job_ids), 0);
  v_running uuid[];
  v_keys uuid[];  -- the keys of the running jobs, each once
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
  if v_running is null then
    return;
  end if;
  perform from public.nodes n
  where n.id in (select a.node_id from public.job_attempts a where a.job_id = any (v_running) and a.status = 'running')
  order by n.id for no key update;
  perform from public.api_keys k where k.id = any (v_keys) order by k.id for no key update;

  return query
  with input as (
    select * from unnest(p_job_ids, p_statuses, p_prompt_tokens, p_completion_tokens, p_ttft_ms,
                         p_latency_ms, p_errors)
      with ordinality as i (job_id, status, prompt_tokens, completion_tokens, ttft_ms, latency_ms, error, ord)
    where i.job_id = any (v_running)
  ),
  ended as (
    update public.job_attempts a
    set status = i.status, error = i.error, ttft_ms = i.ttft_ms,
        latency_ms = coalesce(i.latency_ms, 1000 * extract(epoch from clock_timestamp() - a.started_at)),
        ended_at = clock_timestamp()
    from input i
    where a.job_id = any (v_running) and a.job_id = i.job_id and a.status = 'running'
    returning a.job_id, a.node_id, a.latency_ms, i.status, i.prompt_tokens, i.completion_tokens,
              i.ttft_ms, i.error, i.ord
  ),
  costed as (
    select e.*, j.api_key_id, j.reserved_usd,
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
    from ended e
    join public.jobs j on j.id = e.job_id
    left join public.models m on m.id = j.model_id
    left join public.nodes n on n.id = e.node_id
    cross join lateral (
      -- Decode speed, from streams only: a whole answer's first byte comes with its last token.
      select case when j.stream and e.completion_tokens > 0 and e.latency_ms > coalesce(e.ttft_ms, 0)
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
    from priced p
    where j.id = p.job_id
  ),
  per_node as (
    select p.node_id,
           count(*) as ended,
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
    set inflight = greatest(n.inflight - c.ended, 0),
        status = case when n.status = 'busy' then 'online' else n.status end,
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
end;
$$;

