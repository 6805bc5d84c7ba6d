-- Completions that echo their prompt go to the nodes whose server does.
--
-- A completion with `echo: true` asks for its prompt before its answer (lm-evaluation-harness scores
-- prompts this way). vLLM honours it; llama.cpp's llama-server ignores it and answers without the
-- prompt. Each agent checks what its server does (backend.echoes), and one whose server ignores it
-- refuses such a request with a 400 rather than answer wrongly. The matcher did not know that: on a
-- fleet of both, an echo request went to whichever node ranked first, and when that was a
-- llama-server node the client got a 400 while a node that echoes had a free slot.
--
-- Echoing is now matched as a route. A node whose agent verified that its server echoes (and which
-- serves completions) also serves `completions+echo`: not a path, the completions route with echo,
-- derived here from backend.echoes and never taken from what an agent lists. The gateway asks for
-- it when a completion asks to echo, so everything the matcher does with routes holds for echo too:
-- the full scan and the fast path, the refusal that tells no node serving it from a busy fleet, and
-- the line a request waits in.

create or replace function private.nodes_derive_routes() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- An agent that says nothing of routes (an earlier version, or null) leaves them as they were.
  case jsonb_typeof(new.backend -> 'routes')
    when 'array' then
      new.routes := array(select jsonb_array_elements_text(new.backend -> 'routes'));
    when 'null' then
      null;
    else
      if new.backend ? 'routes' then
        raise exception 'backend.routes must be an array of route names' using errcode = 'check_violation';
      end if;
  end case;
  -- Echo is the agent's to verify, not to list: served when it found its server echoes.
  new.routes := array_remove(new.routes, 'completions+echo')
    || case when new.backend -> 'echoes' = 'true'::jsonb and 'completions' = any (new.routes)
            then '{completions+echo}'::text[] else '{}'::text[] end;
  return new;
end;
$$;
comment on function private.nodes_derive_routes() is 'Trigger: sets nodes.routes from the routes the agent reported in backend.routes (an array of route names; a backend without them leaves routes as they were), with completions+echo (a completion that echoes its prompt) when the agent verified its server echoes (backend.echoes) and the node serves completions.';
revoke execute on function private.nodes_derive_routes() from public, anon, authenticated, service_role;

-- Also when routes are written on their own: the echo route follows backend.echoes whoever writes.
drop trigger nodes_derive_routes on public.nodes;
create trigger nodes_derive_routes before insert or update of backend, routes on public.nodes
  for each row execute function private.nodes_derive_routes();

-- The echo route is a known name.
create or replace function private.nodes_check_description() returns trigger
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
  elsif not (new.free_vram_gb >= 0 and new.free_vram_gb <> 'NaN') then  -- NaN is above every number
    v_rule := 'free_vram_gb must be a number, not negative';
  elsif not (new.gpu_count between 1 and 64) then
    v_rule := 'gpu_count must be between 1 and 64';
  elsif not (length(trim(new.gpu_model)) between 1 and 100) then
    v_rule := 'gpu_model must be 1 to 100 characters';
  elsif not (new.gpu_utilization between 0 and 1) then
    v_rule := 'gpu_utilization must be between 0 and 1';
  elsif not (new.hourly_rate between 0 and 10000) then  -- not NaN, which no range holds
    v_rule := 'hourly_rate must be between 0 and 10000';
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
  elsif not (length(trim(new.region)) between 1 and 64) then
    v_rule := 'region must be 1 to 64 characters';
  elsif not (cardinality(new.routes) >= 1 and new.routes <@ '{chat/completions,completions,completions+echo,embeddings,responses,rerank,score,audio/transcriptions,audio/translations,audio/speech}'::text[]) then
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
comment on function private.nodes_check_description() is 'Trigger: the rules about what a node is (specs, place, price, address, name, routes, reported load), checked when a statement writes one of those columns; each raises the check_violation its CHECK constraint did. No rule holds NaN.';

-- A placement may ask for it (the rest of private.place() as it was).
create or replace function private.place(
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
    '{chat/completions,completions,completions+echo,embeddings,responses,rerank,score,audio/transcriptions,audio/translations,audio/speech}'::text[]) then
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
-- Nodes whose agents already found their servers echo. A row that breaks a rule written since it
-- was (20261203001800) keeps its routes: its agent's next report of its server derives them.
do $$
declare
  v_node uuid;
begin
  for v_node in select n.id from public.nodes n where n.backend -> 'echoes' = 'true'::jsonb loop
    begin
      update public.nodes n set routes = n.routes where n.id = v_node;
    exception when check_violation then
      null;
    end;
  end loop;
end;
$$;

comment on column public.nodes.routes is 'The OpenAI routes the node''s server serves, as the paths after /v1/ (chat/completions, responses, rerank, audio/speech, ...): what its agent reported in backend.routes, else the three every node served before; and completions+echo (not a path: completions that echo their prompt) when its agent verified that its server echoes. The matcher sends a request only to nodes serving its route.';
