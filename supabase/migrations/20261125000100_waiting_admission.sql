-- Admission that waits: a request that finds every capable node busy waits for a slot instead of
-- being refused at once.
--
-- match_job() could not tell a busy fleet from an empty one (full nodes are not ranked, so "no
-- capable node is online" was said of two online nodes at capacity), and each refusal recorded a
-- failed job. Now:
--   * private.place() is match_job()'s one body. Asked to wait (p_wait) when every capable node is
--     busy, it records nothing and says `busy`: the gateway queues the request and asks again when
--     a slot frees. A refusal says which it was: none online, or every one busy.
--   * public.place_job() is the gateway's call (the sized match_job() plus p_wait and `busy`); both
--     match_job() overloads keep their answers, through the same bodies.
--   * place_job() also says how fast the node and each fallback have decoded (measured), so
--     that a whole answer is given the time its max_tokens take there, not the first-byte timeout.
--   * Every freed slot (and every node coming online) is announced on the `neuralgrid_slots`
--     channel, once per transaction, so waiting gateways ask again at once.

create function private.capacity_state(p_model text, p_min_vram_gb real, p_max_hourly_rate numeric)
returns text
language sql stable
set search_path = ''
as $$
  -- Nodes that hold the model and pass every filter but a free slot: what a request may wait for.
  select case
    when count(*) filter (where n.inflight < n.max_concurrency
                            and n.cooldown_until is not null and n.cooldown_until > now()) > 0
      and count(*) filter (where n.inflight >= n.max_concurrency) = 0
      then 'cooling'
    when count(*) > 0 then 'busy'
    else 'none' end
  from public.node_models nm
  join public.nodes n on n.id = nm.node_id
  cross join public.platform_settings s
  where nm.model_id = p_model
    and n.status in ('online', 'busy')
    and n.vram_gb >= private.required_vram_gb(p_model, p_min_vram_gb)
    and (p_max_hourly_rate is null or n.hourly_rate <= p_max_hourly_rate)
    and n.last_heartbeat_at >= now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
$$;
comment on function private.capacity_state(text, real, numeric) is 'Why no node took a request for a model: ''busy'' (capable nodes online, every slot taken), ''cooling'' (capable nodes with free slots are all cooling down after failures), or ''none'' (no capable node online).';
revoke execute on function private.capacity_state(text, real, numeric) from public, anon, authenticated;
grant execute on function private.capacity_state(text, real, numeric) to service_role;

create function private.place(
  p_model text,
  p_api_key_id uuid,
  p_policy text,
  p_min_vram_gb real,
  p_region text,
  p_latitude double precision,
  p_longitude double precision,
  p_max_hourly_rate numeric,
  p_stream boolean,
  p_fallbacks integer,
  p_reserve_usd numeric,
  p_wait boolean
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text,
  busy boolean,
  tokens_per_s real[]
)
language plpgsql
set search_path = ''
as $$
declare
  v_min real := private.required_vram_gb(p_model, p_min_vram_gb);
  v_ranked uuid[];
  v_fallbacks uuid[];
  v_node public.nodes;
  v_job uuid;
  v_error text;
  v_state text;
  v_held numeric := 0;
  v_budgeted boolean;
begin
  if p_fallbacks < 0 then
    raise exception 'fallbacks must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if p_reserve_usd < 0 then
    raise exception 'a reservation must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  -- The best few are enough: a claim skips only nodes filled or locked since scoring.
  select array_agg(s.node_id order by s.rank) into v_ranked
  from public.score_nodes(p_model, p_min_vram_gb, p_policy, p_region, p_latitude, p_longitude,
                          p_max_hourly_rate, false, greatest(32, 4 * (p_fallbacks + 1))) s;

  select * into v_node from private.claim_node(coalesce(v_ranked, '{}'));

  if v_node.id is null then
    v_state := private.capacity_state(p_model, p_min_vram_gb, p_max_hourly_rate);
    if p_wait and v_state <> 'none' then
      -- Nothing recorded: the caller waits for a slot and asks again.
      return query select null::uuid, null::uuid, null::text, null::bytea, 0, '{}'::uuid[],
        null::text, true, '{}'::real[];
      return;
    end if;
    v_error := case v_state
      when 'none' then format('no capable node is online for %s', p_model)
      when 'cooling' then format('every capable node for %s is cooling down after failures', p_model)
      else format('every capable node for %s is busy: all their slots are taken', p_model) end;
  end if;

  -- Hold the request's estimated cost against the key's budget, atomically, so that concurrent
  -- requests never overspend it by more than one request: a request is admitted while the
  -- budget covers what is spent and held, or when nothing is held and something is left.
  -- After the claim: nodes are always locked before keys (complete_job's order too); a refusal
  -- rolls the claim back. Keys without a budget hold nothing, so their requests never queue on
  -- the key's row.
  if p_api_key_id is not null and v_node.id is not null then
    update public.api_keys k set reserved_usd = k.reserved_usd + p_reserve_usd
    where k.id = p_api_key_id and k.budget_usd is not null
      and (k.spent_usd + k.reserved_usd + p_reserve_usd <= k.budget_usd
           or (k.reserved_usd = 0 and k.spent_usd < k.budget_usd));
    if found then
      v_held := p_reserve_usd;
    else
      select k.budget_usd is not null into v_budgeted from public.api_keys k where k.id = p_api_key_id;
      if not found then
        raise exception 'no api_key with id %', p_api_key_id using errcode = 'invalid_parameter_value';
      elsif v_budgeted then
        raise exception 'the budget of this API key is spent' using errcode = 'NG402';
      end if;
    end if;
  end if;

  insert into public.jobs as j (api_key_id, owner_id, model_id, policy, status, node_id, attempts, stream,
                                region, min_vram_gb, reserved_usd, error, finished_at)
  values (p_api_key_id, (select k.owner_id from public.api_keys k where k.id = p_api_key_id), p_model,
          p_policy, case when v_node.id is null then 'failed' else 'running' end, v_node.id,
          case when v_node.id is null then 0 else 1 end, p_stream, p_region, v_min, v_held, v_error,
          case when v_node.id is null then now() end)
  returning j.id into v_job;

  if v_node.id is not null then
    insert into public.job_attempts (job_id, attempt, node_id) values (v_job, 1, v_node.id);
  end if;

  v_fallbacks := array(select x from unnest(v_ranked) with ordinality as r (x, ord)
                       where x is distinct from v_node.id order by ord limit p_fallbacks);
  return query select v_job, v_node.id, v_node.endpoint_url, v_node.secret_hash,
    case when v_node.id is null then 0 else 1 end, v_fallbacks, v_error, false,
    -- How fast each has answered (for the gateway's timeouts; null until measured).
    case when v_node.id is null then '{}'::real[] else array(
      select n.ewma_tokens_per_s
      from unnest(v_node.id || v_fallbacks) with ordinality as c (id, ord)
      join public.nodes n on n.id = c.id
      order by c.ord) end;
end;
$$;
comment on function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean) is 'match_job()''s body: holds p_reserve_usd against the key''s budget (NG402 when spent), scores nodes, claims a slot on the best one, records the job and its first attempt, and returns the node and an ordered fallback list. When no node is free: with p_wait and capable nodes busy (or cooling down), nothing is recorded and busy is true; otherwise the job is recorded as failed with the reason (none online, busy, cooling down). tokens_per_s: the node''s and each fallback''s measured decode speed (null until measured), in the same order.';
revoke execute on function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean) from public, anon, authenticated;
grant execute on function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean) to service_role;

create or replace function public.match_job(
  p_model text,
  p_api_key_id uuid default null,
  p_policy text default 'balanced',
  p_min_vram_gb real default null,
  p_region text default null,
  p_latitude double precision default null,
  p_longitude double precision default null,
  p_max_hourly_rate numeric default null,
  p_stream boolean default false,
  p_fallbacks integer default 3,
  p_reserve_usd numeric default 0
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text
)
language sql
set search_path = ''
as $$
  select p.job_id, p.node_id, p.endpoint_url, p.node_key, p.attempt, p.fallback_ids, p.error
  from private.place(p_model, p_api_key_id, p_policy, p_min_vram_gb, p_region, p_latitude, p_longitude,
                     p_max_hourly_rate, p_stream, p_fallbacks, p_reserve_usd, false) p
$$;

create function public.place_job(
  p_model text,
  p_api_key_id uuid,
  p_policy text,
  p_min_vram_gb real,
  p_region text,
  p_latitude double precision,
  p_longitude double precision,
  p_max_hourly_rate numeric,
  p_stream boolean,
  p_fallbacks integer,
  p_prompt_bytes integer,
  p_max_output_tokens integer,
  p_wait boolean
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text,
  max_output_tokens integer,
  busy boolean,
  tokens_per_s real[]
)
language plpgsql
set search_path = ''
as $$
declare
  v_cap integer := p_max_output_tokens;
  v_left numeric;
  v_input_price numeric;
  v_output_price numeric;
begin
  if p_prompt_bytes is null or p_max_output_tokens is null or p_prompt_bytes < 0 or p_max_output_tokens < 0 then
    raise exception 'prompt_bytes and max_output_tokens must be given and must not be negative'
      using errcode = 'invalid_parameter_value';
  end if;
  select k.budget_usd - k.spent_usd - k.reserved_usd into v_left
  from public.api_keys k where k.id = p_api_key_id and k.budget_usd is not null;
  select m.input_usd_per_mtok, m.output_usd_per_mtok into v_input_price, v_output_price
  from public.models m where m.id = p_model;
  if v_left is not null and coalesce(v_output_price, 0) > 0 then
    -- Read without a lock: the hold below is checked again, atomically, when it is taken.
    v_cap := least(p_max_output_tokens::bigint, floor(greatest(
      v_left - p_prompt_bytes / 4.0 * coalesce(v_input_price, 0) / 1e6, 0) * 1e6 / v_output_price)::bigint);
    if v_cap < least(p_max_output_tokens, 1) then
      raise exception 'the budget left on this API key ($%) cannot pay for this request''s prompt and one token of answer',
        round(greatest(v_left, 0), 6) using errcode = 'NG402';
    end if;
  end if;
  return query
  select p.job_id, p.node_id, p.endpoint_url, p.node_key, p.attempt, p.fallback_ids, p.error, v_cap, p.busy,
    p.tokens_per_s
  from private.place(p_model, p_api_key_id, p_policy, p_min_vram_gb, p_region, p_latitude, p_longitude,
                     p_max_hourly_rate, p_stream, p_fallbacks,
                     private.budget_hold(p_model, p_prompt_bytes, v_cap), p_wait) p;
end;
$$;
comment on function public.place_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer, boolean) is 'The gateway''s match_job(): the budget hold priced in SQL from p_prompt_bytes (about four bytes a token) and up to p_max_output_tokens of answer at the catalog''s prices, the answer capped at what the key''s remaining budget pays for (max_output_tokens; NG402 when not one token). With p_wait, a request that finds every capable node busy is not recorded: busy is true, and the gateway asks again when a slot frees (LISTEN neuralgrid_slots). tokens_per_s: the measured decode speed of the node and of each fallback, in order, which bounds how long a whole answer may take.';
revoke execute on function public.place_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer, boolean) from public, anon, authenticated;
grant execute on function public.place_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer, boolean) to service_role;

create or replace function public.match_job(
  p_model text,
  p_api_key_id uuid,
  p_policy text,
  p_min_vram_gb real,
  p_region text,
  p_latitude double precision,
  p_longitude double precision,
  p_max_hourly_rate numeric,
  p_stream boolean,
  p_fallbacks integer,
  p_prompt_bytes integer,
  p_max_output_tokens integer
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text,
  max_output_tokens integer
)
language sql
set search_path = ''
as $$
  select p.job_id, p.node_id, p.endpoint_url, p.node_key, p.attempt, p.fallback_ids, p.error, p.max_output_tokens
  from public.place_job(p_model, p_api_key_id, p_policy, p_min_vram_gb, p_region, p_latitude, p_longitude,
                        p_max_hourly_rate, p_stream, p_fallbacks, p_prompt_bytes, p_max_output_tokens, false) p
$$;

-- Freed slots, announced --------------------------------------------------------------------------

create function private.announce_free_slot() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- One notification per transaction (Postgres folds identical ones): a batch of endings wakes the
  -- waiting gateways once, and each asks the matcher again.
  perform pg_notify('neuralgrid_slots', '');
  return null;
end;
$$;
comment on function private.announce_free_slot() is 'Trigger: tells LISTENing gateways (channel neuralgrid_slots) that a node has a slot to give: one was freed, or the node came online or got more slots.';
revoke execute on function private.announce_free_slot() from public, anon, authenticated, service_role;

create trigger nodes_announce_free_slot after update on public.nodes
  for each row
  when (new.status = 'online' and new.inflight < new.max_concurrency
        and (new.inflight < old.inflight or old.status <> 'online'
             or new.max_concurrency > old.max_concurrency))
  execute function private.announce_free_slot();
