-- Grouped claims (issue 16): a gateway places the requests that arrive while its previous placement
-- is in Postgres with one call, as it already ends jobs in batches (complete_jobs()). One statement
-- and one commit for the group instead of one each: less of Postgres's time per request goes to the
-- protocol, the executor's start-up and the commit.
--
-- Each request is placed as place_job() places it, in the order given, each seeing the claims of
-- those before it. One that fails (its key's budget spent, a bad parameter) fails alone: its row
-- says how (the SQLSTATE and message place_job() would have raised) and the others are placed all
-- the same.
--
-- Rankings: a request ranked like the one before it (same model, policy, need, place, price cap,
-- route and fallbacks) starts from that request's ranking, moved on by its claim, rather than
-- scoring the fleet again. That is exact: a claim changes only the claimed node's score, by the
-- change in its capacity term (private.node_components, read again after the claim); the node is
-- moved to its new place, or out of the ranking once full (score_nodes() ranks only nodes with a
-- free slot). Two things would make the moved ranking differ from a fresh one, and either sends the
-- next request to score_nodes() again: the claimed node falling to or below the last of a ranking
-- cut at its limit, or leaving it (nodes left out might now rank), and a ranking with no free node
-- left (private.place() then ranks afresh itself). Exact, that is, as to the group's own claims:
-- what other transactions commit during the group's few milliseconds (a slot freed, another
-- gateway's claim) reaches the claims, which re-check status, slots and cooldown under the row's
-- lock, but not the ranking until the next one is made.
--
-- Locks: the group holds the rows of the nodes (and budgeted keys) it has locked until it commits,
-- and it claims in ranking order, not in the id order completions lock in. A later request of the
-- group that waited for a row a completion holds could deadlock with it (measured: a 1 s stall at
-- 64 callers, Postgres's deadlock_timeout). So only the first request to be placed (before any has
-- reached a claim, which may lock rows even when it claims nothing) waits for a lock, and for at
-- most 100 ms; the others wait at most 10 ms. Either then fails with lock_not_available (55P03):
-- the gateway asks again, first in its next call, and places one that fails so again alone, with
-- place_job() on a connection of its own, so that a row held long holds up that request only.

-- How many nodes a placement ranks: the best few are enough (a claim skips only nodes filled or
-- locked since scoring), and enough for its fallbacks. private.place() and place_jobs() rank alike.
create function private.ranking_limit(p_fallbacks integer) returns integer
language sql immutable
set search_path = ''
return greatest(32, 4 * (p_fallbacks + 1));
comment on function private.ranking_limit(integer) is 'How many nodes a placement with p_fallbacks fallbacks ranks (private.place(), place_jobs()).';
revoke execute on function private.ranking_limit(integer) from public, anon, authenticated;
grant execute on function private.ranking_limit(integer) to service_role;

drop function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean, text);
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
  p_wait boolean,
  p_route text,
  p_ranked uuid[] default null
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text,
  busy boolean,
  tokens_per_s real[],
  refusal text,
  reranked boolean
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
  v_reranked boolean := false;
begin
  if p_fallbacks < 0 then
    raise exception 'fallbacks must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if p_reserve_usd < 0 then
    raise exception 'a reservation must not be negative' using errcode = 'invalid_parameter_value';
  end if;
  if p_route is not null and not p_route = any (
    '{chat/completions,completions,embeddings,responses,rerank,score,audio/transcriptions,audio/translations,audio/speech}'::text[]) then
    raise exception 'unknown route "%"', p_route using errcode = 'invalid_parameter_value';
  end if;
  -- A ranking handed in (place_jobs(): the one of the request before, moved on by its claim) is
  -- tried first; when it has no free node left, nodes it left out may rank now: ranked afresh. An
  -- empty one is a ranking too: nothing was eligible, and the group has freed nothing since.
  if p_ranked is not null then
    v_ranked := p_ranked;
    select * into v_node from private.claim_node(v_ranked);
  end if;
  if v_node.id is null and coalesce(cardinality(p_ranked), 1) > 0 then
    -- The best few are enough: a claim skips only nodes filled or locked since scoring.
    select array_agg(s.node_id order by s.rank) into v_ranked
    from public.score_nodes(p_model, p_min_vram_gb, p_policy, p_region, p_latitude, p_longitude,
                            p_max_hourly_rate, false, private.ranking_limit(p_fallbacks), p_route) s;
    v_reranked := p_ranked is not null;
    select * into v_node from private.claim_node(coalesce(v_ranked, '{}'));
  end if;

  if v_node.id is null then
    v_state := private.capacity_state(p_model, p_min_vram_gb, p_max_hourly_rate, p_route);
    if p_wait and v_state in ('busy', 'cooling') then
      -- Nothing recorded: the caller waits for a slot and asks again.
      return query select null::uuid, null::uuid, null::text, null::bytea, 0, '{}'::uuid[],
        null::text, true, '{}'::real[], v_state, v_reranked;
      return;
    end if;
    v_error := case v_state
      when 'none' then format('no capable node is online for %s', p_model)
      when 'route' then format('no online node serves /v1/%s for %s', p_route, p_model)
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
      order by c.ord) end,
    v_state, v_reranked;
end;
$$;
comment on function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean, text, uuid[]) is 'match_job()''s body: holds p_reserve_usd against the key''s budget (NG402 when spent), scores the nodes serving p_route (null: any), claims a slot on the best one, records the job and its first attempt, and returns the node and an ordered fallback list. When no node is free: with p_wait and capable nodes busy (or cooling down), nothing is recorded and busy is true; otherwise the job is recorded as failed with the reason. refusal says which it was when no node was claimed: none (no capable node online), route (none serving p_route), busy or cooling. tokens_per_s: the node''s and each fallback''s measured decode speed (null until measured), in the same order. p_ranked (place_jobs()): a ranking to claim from first, ranked afresh if it has no free node (reranked says so).';
revoke execute on function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean, text, uuid[]) from public, anon, authenticated;
grant execute on function private.place(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, numeric, boolean, text, uuid[]) to service_role;

-- The answer's cap: what the key's remaining budget pays for (NG402 when not one token), read
-- without a lock (the hold is checked again, atomically, when it is taken). place_job()'s first
-- step, and each request's in place_jobs().
create function private.answer_cap(
  p_model text, p_api_key_id uuid, p_prompt_bytes integer, p_max_output_tokens integer
) returns integer
language plpgsql stable
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
    v_cap := least(p_max_output_tokens::bigint, floor(greatest(
      v_left - p_prompt_bytes / 4.0 * coalesce(v_input_price, 0) / 1e6, 0) * 1e6 / v_output_price)::bigint);
    if v_cap < least(p_max_output_tokens, 1) then
      raise exception 'the budget left on this API key ($%) cannot pay for this request''s prompt and one token of answer',
        round(greatest(v_left, 0), 6) using errcode = 'NG402';
    end if;
  end if;
  return v_cap;
end;
$$;
comment on function private.answer_cap(text, uuid, integer, integer) is 'The longest answer (tokens, up to p_max_output_tokens) the key''s remaining budget pays for after a prompt of p_prompt_bytes, at the catalog''s prices; NG402 when not one token. place_job()''s and place_jobs()''s first step.';
revoke execute on function private.answer_cap(text, uuid, integer, integer) from public, anon, authenticated;
grant execute on function private.answer_cap(text, uuid, integer, integer) to service_role;  -- place_job()'s caller

create or replace function public.place_job(
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
  p_wait boolean,
  p_route text
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
  tokens_per_s real[],
  refusal text
)
language plpgsql
set search_path = ''
as $$
declare
  v_cap integer := private.answer_cap(p_model, p_api_key_id, p_prompt_bytes, p_max_output_tokens);
begin
  return query
  select p.job_id, p.node_id, p.endpoint_url, p.node_key, p.attempt, p.fallback_ids, p.error, v_cap, p.busy,
    p.tokens_per_s, p.refusal
  from private.place(p_model, p_api_key_id, p_policy, p_min_vram_gb, p_region, p_latitude, p_longitude,
                     p_max_hourly_rate, p_stream, p_fallbacks,
                     private.budget_hold(p_model, p_prompt_bytes, v_cap), p_wait, p_route) p;
end;
$$;

create function public.place_jobs(p_gateway text, p_requests jsonb)
returns table (
  ord integer, job_id uuid, node_id uuid, endpoint_url text, node_key bytea, attempt integer,
  fallback_ids uuid[], error text, max_output_tokens integer, busy boolean, tokens_per_s real[],
  refusal text, failure_state text, failure text)
language plpgsql
set search_path = ''
as $$
declare
  r record;
  v_placed record;
  v_cap integer;
  v_holding boolean := false;  -- whether an earlier request of the group may hold row locks
  -- The ranking the next request may start from, and what it was ranked for.
  v_for jsonb;
  v_key jsonb;
  v_limit integer;
  v_ids uuid[];
  v_scores float8[];
  v_caps float8[];  -- each ranked node's capacity term (private.node_components) when ranked
  v_last float8;  -- the lowest score when ranked
  v_full boolean;  -- whether the ranking was cut at its limit (nodes were left out)
  v_share float8;  -- the policy's capacity weight over all its weights
  v_cap_now float8;
  v_filled boolean;
  v_at integer;
begin
  if jsonb_typeof(p_requests) is distinct from 'array' then
    raise exception 'place_jobs takes a JSON array of requests' using errcode = 'invalid_parameter_value';
  end if;
  -- Each request runs in a subtransaction of its own (so that it can fail alone), and a claim that
  -- fills a node runs up to two more (realtime.send(), for the map and the owner); past 64 in one
  -- transaction Postgres's per-backend cache of them overflows and every snapshot reads pg_subtrans.
  if jsonb_array_length(p_requests) > 16 then
    raise exception 'place_jobs takes at most 16 requests, not %', jsonb_array_length(p_requests)
      using errcode = 'invalid_parameter_value';
  end if;
  perform set_config('neuralgrid.gateway_id', coalesce(p_gateway, ''), true);  -- stamp_job_gateway()
  for r in
    select * from rows from (jsonb_to_recordset(p_requests) as (
      model text, key uuid, policy text, min_vram real, region text, lat float8, lon float8,
      max_rate numeric, stream boolean, fallbacks integer, prompt_bytes integer, max_out integer,
      wait boolean, route text, end_user text))
    with ordinality as x (model, key, policy, min_vram, region, lat, lon, max_rate, stream, fallbacks,
                          prompt_bytes, max_out, wait, route, end_user, n)
  loop
    begin
      perform set_config('neuralgrid.end_user', coalesce(r.end_user, ''), true),
              set_config('lock_timeout', case when v_holding then '10ms' else '100ms' end, true);
      v_cap := private.answer_cap(r.model, r.key, r.prompt_bytes, r.max_out);
      v_key := jsonb_build_array(r.model, r.policy, r.min_vram, r.region, r.lat, r.lon, r.max_rate, r.route,
                                 coalesce(r.fallbacks, 0));
      if v_key is distinct from v_for then
        v_for := null;
        -- As private.place() ranks: the same call, with the scores kept.
        v_limit := private.ranking_limit(coalesce(r.fallbacks, 0));
        select array_agg(s.node_id order by s.rank), array_agg(s.score order by s.rank),
               array_agg(s.capacity order by s.rank), min(s.score), count(*) >= v_limit
          into v_ids, v_scores, v_caps, v_last, v_full
        from public.score_nodes(r.model, r.min_vram, r.policy, r.region, r.lat, r.lon, r.max_rate, false,
                                v_limit, r.route) s;
        -- In float8 over the weights' sum in real, as private.node_components divides.
        select w.capacity::float8 / (w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity + w.reserve)::float8
          into v_share from public.matching_policies w where w.name = r.policy;  -- none for seed
        v_for := v_key;
      end if;
      select * into v_placed
      from private.place(r.model, r.key, r.policy, r.min_vram, r.region, r.lat, r.lon, r.max_rate,
                         coalesce(r.stream, false), coalesce(r.fallbacks, 0),
                         private.budget_hold(r.model, r.prompt_bytes, v_cap), coalesce(r.wait, false), r.route,
                         coalesce(v_ids, '{}')) p;
      v_holding := true;  -- its claim may have locked rows, even one that claimed nothing
      v_at := array_position(v_ids, v_placed.node_id);
      if v_placed.reranked or v_at is null then
        v_for := null;  -- claimed from a fresh ranking, or nothing claimed: the next ranks afresh
      else
        -- The claimed node's capacity term now (none for seed, which has none), and whether it is full.
        select c.capacity, n.inflight >= n.max_concurrency into v_cap_now, v_filled
        from public.nodes n
        left join private.node_components c on c.node_id = n.id and c.policy = r.policy and c.model_id = r.model
        where n.id = v_placed.node_id;
        v_scores[v_at] := v_scores[v_at] - coalesce(v_share * (v_caps[v_at] - v_cap_now), 0);
        v_caps[v_at] := v_cap_now;
        if v_full and (v_filled or v_scores[v_at] <= v_last) then
          v_for := null;  -- a node left out of the ranking may take its place now
        elsif v_filled then  -- no longer eligible: out of the ranking, as score_nodes() would leave it
          v_ids := v_ids[:v_at - 1] || v_ids[v_at + 1:];
          v_scores := v_scores[:v_at - 1] || v_scores[v_at + 1:];
          v_caps := v_caps[:v_at - 1] || v_caps[v_at + 1:];
        else
          select array_agg(u.id order by u.score desc, u.id), array_agg(u.score order by u.score desc, u.id),
                 array_agg(u.capacity order by u.score desc, u.id)
            into v_ids, v_scores, v_caps
          from unnest(v_ids, v_scores, v_caps) as u (id, score, capacity);
        end if;
      end if;
      return query
      select r.n::integer, v_placed.job_id, v_placed.node_id, v_placed.endpoint_url, v_placed.node_key,
        v_placed.attempt, v_placed.fallback_ids, v_placed.error, v_cap, v_placed.busy,
        v_placed.tokens_per_s, v_placed.refusal, null::text, null::text;
    exception when others then
      v_for := null;  -- what it claimed is undone: its ranking's move with it
      return query
      select r.n::integer, null::uuid, null::uuid, null::text, null::bytea, 0, '{}'::uuid[], null::text,
        null::integer, false, '{}'::real[], null::text, sqlstate, sqlerrm;
    end;
  end loop;
end;
$$;

comment on function public.place_jobs(text, jsonb) is
  'The gateway''s placements, grouped: place_job() for each request in the JSON array (at most 16), in '
  'order, as p_gateway; a request that fails gives its SQLSTATE and message and fails alone (55P03: '
  'it waited for a row lock longer than a group may, 100 ms for the first, 10 ms for the others: ask again).';

revoke execute on function public.place_jobs(text, jsonb) from public, anon, authenticated;
grant execute on function public.place_jobs(text, jsonb) to service_role;
