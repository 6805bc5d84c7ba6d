-- Leases (issue 42, docs/scaling.md "Far from the database: leases"): the tables, the settings, and
-- attempts on leased slots.
--
-- A gateway far from the database leases slots on nodes (renew_leases(), next migration) and
-- dispatches on them without asking. A lease's slots are counted in nodes.inflight as a claim's slot
-- is, so the rule every claim keeps (inflight <= max_concurrency) keeps leases from overbooking too.
-- An attempt that runs on a leased slot (job_attempts.leased) therefore frees no slot when it ends:
-- the lease still holds it. Everything else about its ending (the node's successes, failures,
-- cooldown and moving averages; the job's price and charge) is as for any attempt. So release_node()
-- says whether it frees the slot, end_attempt() asks it to for attempts that were not leased (which
-- covers move_job(), failover_job(), handoff_job(), reject_job(), abandon_job() and the sweeps that
-- call it), and complete_jobs() frees one slot a node for each ended attempt that was not leased.
--
-- Budgets are served from escrow: money a gateway holds for a key (private.key_escrows), counted in
-- api_keys.reserved_usd as a running job's hold is, so every placement sees it as held.

alter table public.platform_settings
  add column lease_s real not null default 5,
  add column escrow_usd numeric(12,4) not null default 1.00,
  add constraint "lease_s must be positive" check (lease_s > 0),
  add constraint "escrow_usd must not be negative" check (escrow_usd >= 0);

comment on column public.platform_settings.lease_s is
  'Seconds a slot lease lasts from its renewal (renew_leases()): a gateway stops dispatching on it at its own reckoning of that end, and the sweep gives back the idle slots of a lease not renewed by then.';
comment on column public.platform_settings.escrow_usd is
  'The most a gateway may hold in escrow for one API key (renew_escrows()): money taken from the key''s free budget so that the gateway can admit the key''s requests without asking.';

alter table public.job_attempts add column leased boolean not null default false;
comment on column public.job_attempts.leased is
  'The attempt ran on a slot its gateway leased (record_jobs()): ending it frees no slot, since the lease holds it.';

create table private.slot_leases (
  gateway_id uuid not null,
  node_id uuid not null references public.nodes (id) on delete cascade,
  model_id text not null,
  policy text not null,
  region text not null default '',
  slots integer not null,
  in_use integer not null default 0,
  score double precision,
  expires_at timestamptz not null,
  primary key (gateway_id, node_id, model_id, policy, region),
  constraint "a lease's slots must not be negative" check (slots >= 0),
  constraint "a lease's slots in use must be between 0 and its slots" check (in_use between 0 and slots)
);
comment on table private.slot_leases is
  'Slots a gateway holds on a node for a lane (model, policy, region), taken as claims take them (counted in nodes.inflight): renewed by renew_leases(), given back when a renewal wants fewer, when the lease ends unrenewed (its idle slots) or when its gateway falls silent (all of them, by the sweep).';
comment on column private.slot_leases.gateway_id is 'The gateway holding the slots (private.gateways.id).';
comment on column private.slot_leases.region is 'The lane''s region: requests of that region rank its nodes first; '''' for a lane that names none.';
comment on column private.slot_leases.slots is 'Slots held, each counted in the node''s inflight.';
comment on column private.slot_leases.in_use is 'Slots the gateway said were in use at its last renewal: never given back before the gateway renews lower or is judged dead.';
comment on column private.slot_leases.score is 'The node''s score_nodes() score for the lane when last ranked: how a node the ranking leaves out now (full, because leased) ranks among the gateway''s leases.';
comment on column private.slot_leases.expires_at is 'The lease''s end unless renewed (its renewal plus platform_settings.lease_s).';
create index slot_leases_node_idx on private.slot_leases (node_id);
create index slot_leases_lane_idx on private.slot_leases (model_id, policy, region);
revoke all on table private.slot_leases from public, anon, authenticated;
grant select, insert, update, delete on table private.slot_leases to service_role;

create table private.lane_demand (
  gateway_id uuid not null,
  model_id text not null,
  policy text not null,
  region text not null default '',
  wanted integer not null,
  renewed_at timestamptz not null default now(),
  primary key (gateway_id, model_id, policy, region),
  constraint "wanted must not be negative" check (wanted >= 0)
);
comment on table private.lane_demand is
  'How many slots each gateway wanted of each lane (model, policy, region; region '''' for none) at its last renewal: the shares renew_leases() splits a lane''s slots by, among the live gateways that renewed it within platform_settings.lease_s.';
comment on column private.lane_demand.wanted is 'Slots wanted at the last renewal: the gateway''s requests in flight and waiting for the lane, and a spare.';
comment on column private.lane_demand.renewed_at is 'When the gateway last renewed the lane.';
create index lane_demand_lane_idx on private.lane_demand (model_id, policy, region);
revoke all on table private.lane_demand from public, anon, authenticated;
grant select, insert, update, delete on table private.lane_demand to service_role;

create table private.key_escrows (
  gateway_id uuid not null,
  api_key_id uuid not null references public.api_keys (id) on delete cascade,
  usd numeric(16,8) not null,
  renewed_at timestamptz not null default now(),
  primary key (gateway_id, api_key_id),
  constraint "an escrow must not be negative" check (usd >= 0)
);
comment on table private.key_escrows is
  'Money a gateway holds for an API key with a budget, to admit the key''s requests without asking (renew_escrows()): counted in api_keys.reserved_usd, so that every placement sees it as held. record_jobs() moves each request''s hold from it to the job; the sweep returns it when the gateway falls silent.';
comment on column private.key_escrows.usd is 'What the escrow holds now (at most platform_settings.escrow_usd).';
comment on column private.key_escrows.renewed_at is 'When the gateway last renewed the escrow.';
create index key_escrows_api_key_idx on private.key_escrows (api_key_id);
revoke all on table private.key_escrows from public, anon, authenticated;
grant select, insert, update, delete on table private.key_escrows to service_role;

-- A slot is freed only for an attempt that did not run on a leased one --------------------------------

drop function private.release_node(uuid, text);
create function private.release_node(p_node_id uuid, p_outcome text, p_frees_slot boolean)
returns void
language plpgsql
set search_path = ''
as $$
begin
  if p_outcome not in ('succeeded', 'failed', 'cancelled') then
    raise exception 'unknown outcome "%"', p_outcome using errcode = 'invalid_parameter_value';
  end if;
  -- Failures cool a node down exponentially (cooldown_until()) so requests route around it. A slot a
  -- lease holds stays held (and a cancelled attempt on one changes nothing on the node).
  update public.nodes n
  set inflight = case when p_frees_slot then greatest(n.inflight - 1, 0) else n.inflight end,
      status = case when p_frees_slot and n.status = 'busy' then 'online' else n.status end,
      successes = n.successes + (p_outcome = 'succeeded')::integer,
      failures = n.failures + (p_outcome = 'failed')::integer,
      consecutive_failures = case p_outcome when 'succeeded' then 0
                                            when 'failed' then n.consecutive_failures + 1
                                            else n.consecutive_failures end,
      cooldown_until = case p_outcome
        when 'succeeded' then null
        when 'failed' then private.cooldown_until(n.consecutive_failures + 1, s.cooldown_base_s, s.cooldown_max_s)
        else n.cooldown_until end
  from public.platform_settings s
  where n.id = p_node_id and (p_frees_slot or p_outcome <> 'cancelled');
end;
$$;
comment on function private.release_node(uuid, text, boolean) is 'Records a finished attempt''s outcome in the node''s reputation and cooldown, and frees the slot it held when p_frees_slot (not for an attempt on a leased slot, which its lease holds).';
revoke execute on function private.release_node(uuid, text, boolean) from public, anon, authenticated;
grant execute on function private.release_node(uuid, text, boolean) to service_role;

create or replace function private.end_attempt(
  p_job_id uuid, p_outcome text, p_error text default null, p_http_status integer default null,
  p_ttft_ms real default null, p_latency_ms real default null
) returns public.job_attempts
language plpgsql
set search_path = ''
as $$
declare
  v_attempt public.job_attempts;
begin
  update public.job_attempts a
  set status = p_outcome, error = p_error, http_status = p_http_status, ttft_ms = p_ttft_ms,
      latency_ms = coalesce(p_latency_ms, 1000 * extract(epoch from clock_timestamp() - a.started_at)),
      ended_at = clock_timestamp()
  where a.job_id = p_job_id and a.status = 'running'
  returning a.* into v_attempt;
  if not found then
    raise exception 'job % has no running attempt', p_job_id using errcode = 'object_not_in_prerequisite_state';
  end if;
  perform private.release_node(v_attempt.node_id, p_outcome, not v_attempt.leased);
  return v_attempt;
end;
$$;
comment on function private.end_attempt(uuid, text, text, integer, real, real) is 'Ends a job''s running attempt with an outcome and releases its node (its slot too, unless the attempt ran on a leased slot, which its lease holds).';

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
    returning a.job_id, a.node_id, a.leased, a.latency_ms, i.status, i.prompt_tokens, i.completion_tokens,
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
end;
$$;
comment on function public.complete_jobs(uuid[], text[], integer[], integer[], real[], real[], text[]) is 'Ends a batch of running jobs (parallel arrays, one entry per job) as ending them one by one, in order, would: usage, cost charged to keys, node reputation and EWMA speed, slots released (not those of attempts on leased slots, which their leases hold). Returns the jobs it ended; jobs no longer running are left out. The one place a job''s price and its node''s moving averages are computed.';
