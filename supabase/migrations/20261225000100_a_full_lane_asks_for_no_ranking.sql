-- A request placed while every node that could take it is full asks for no ranking.
--
-- place_jobs() ranked the nodes for each request (score_nodes()), and place() ranked them again when
-- the ranking had no free node: two rankings for an answer of busy, which a ranking of only full
-- nodes could not change (a node ranks only with a free slot). On a scarce lane most asks are such:
-- the requests waiting in line ask at each turn, and a gateway below its share asks SQL for the slots
-- others free (bench capacity, three gateways on 8 slots, 2026-12-08: 1,475 of 1,771 placements
-- busy, the rankings some 1.1 s of 11 s of Postgres). Now a request for a model that no online node
-- holding it has a free slot of (outside a cooldown: what a claim takes) is placed from an empty
-- ranking: the same answer, the same refusal (capacity_state()), lent slots taken as before.

CREATE FUNCTION private.has_free_slot(p_model text) RETURNS boolean
    LANGUAGE sql STABLE
    SET search_path TO ''
    AS $$
  select exists (
    select from public.node_models nm
    join public.nodes n on n.id = nm.node_id
    where nm.model_id = p_model and n.status = 'online' and n.inflight < n.max_concurrency
      and (n.cooldown_until is null or n.cooldown_until <= now()))
$$;

COMMENT ON FUNCTION private.has_free_slot(p_model text) IS 'Whether some online node holding p_model has a slot a claim could take (free, the node not cooling down): without one, no ranking for the model has a node (place_jobs() skips it).';

REVOKE ALL ON FUNCTION private.has_free_slot(p_model text) FROM PUBLIC;
GRANT ALL ON FUNCTION private.has_free_slot(p_model text) TO service_role;

CREATE OR REPLACE FUNCTION public.place_jobs(p_gateway text, p_requests jsonb) RETURNS TABLE(ord integer, job_id uuid, node_id uuid, endpoint_url text, node_key bytea, attempt integer, fallback_ids uuid[], error text, max_output_tokens integer, busy boolean, tokens_per_s real[], refusal text, failure_state text, failure text, lent boolean)
    LANGUAGE plpgsql
    SET search_path TO ''
    SET jit TO 'off'
    AS $$
declare
  r record;
  v_placed record;
  v_lent uuid;  -- the node of a slot the gateway lent this request from its leases
  v_borrowed record;
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
  v_final integer;  -- the number of the group's last request
begin
  if jsonb_typeof(p_requests) is distinct from 'array' then
    raise exception 'place_jobs takes a JSON array of requests' using errcode = 'invalid_parameter_value';
  end if;
  -- Each request runs in a subtransaction of its own (so that it can fail alone), one that takes a
  -- lent slot one more, and a claim that fills a node up to two more (realtime.send(), for the map
  -- and the owner): 64 at most in a group of 16; past 64 in one transaction Postgres's per-backend
  -- cache of them overflows and every snapshot reads pg_subtrans.
  if jsonb_array_length(p_requests) > 16 then
    raise exception 'place_jobs takes at most 16 requests, not %', jsonb_array_length(p_requests)
      using errcode = 'invalid_parameter_value';
  end if;
  v_final := jsonb_array_length(p_requests);
  perform set_config('neuralgrid.gateway_id', coalesce(p_gateway, ''), true);  -- stamp_job_gateway()
  for r in
    select * from rows from (jsonb_to_recordset(p_requests) as (
      model text, key uuid, policy text, min_vram real, region text, lat float8, lon float8,
      max_rate numeric, stream boolean, fallbacks integer, prompt_bytes integer, max_out integer,
      wait boolean, route text, end_user text, lend jsonb))
    with ordinality as x (model, key, policy, min_vram, region, lat, lon, max_rate, stream, fallbacks,
                          prompt_bytes, max_out, wait, route, end_user, lend, n)
  loop
    begin
      perform set_config('neuralgrid.end_user', coalesce(r.end_user, ''), true),
              set_config('lock_timeout', case when v_holding then '10ms' else '100ms' end, true);
      v_cap := private.answer_cap(r.model, r.key, r.prompt_bytes, r.max_out);
      v_key := jsonb_build_array(r.model, r.policy, r.min_vram, r.region, r.lat, r.lon, r.max_rate, r.route,
                                 coalesce(r.fallbacks, 0));
      if v_key is distinct from v_for then
        v_for := null;
        if not private.has_free_slot(r.model) then
          -- No online node holding the model has a free slot: the ranking would be empty (a node
          -- ranks only with one), and place() ranks no further from an empty one. A scarce lane's
          -- waiting requests ask often, and found it so at the cost of two rankings each.
          v_ids := '{}';
        else
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
      end if;
      select * into v_placed
      from private.place(r.model, r.key, r.policy, r.min_vram, r.region, r.lat, r.lon, r.max_rate,
                         coalesce(r.stream, false), coalesce(r.fallbacks, 0),
                         private.budget_hold(r.model, r.prompt_bytes, v_cap), coalesce(r.wait, false), r.route,
                         coalesce(v_ids, '{}')) p;
      v_lent := null;
      if v_placed.busy and jsonb_typeof(r.lend) = 'array' then
        -- Every capable node is full, and the gateway lends slots it leases idle (kept out of use
        -- until it has this answer): the best one that could serve the request goes back to its
        -- node, and the request claims it. One round trip for a request new to the gateway, where
        -- its other lanes lease every slot of the nodes it could take.
        begin
          v_lent := private.return_lent_slot(nullif(p_gateway, '')::uuid, r.model, r.policy, r.min_vram,
                                             r.max_rate, r.route, r.lend);
          if v_lent is not null then
            select * into v_borrowed
            from private.place(r.model, r.key, r.policy, r.min_vram, r.region, r.lat, r.lon, r.max_rate,
                               coalesce(r.stream, false), coalesce(r.fallbacks, 0),
                               private.budget_hold(r.model, r.prompt_bytes, v_cap), coalesce(r.wait, false),
                               r.route, array[v_lent]) p;
            if v_borrowed.node_id is distinct from v_lent then  -- kept for bigger jobs, say: not lent
              raise exception using errcode = 'NG409';
            end if;
            v_placed := v_borrowed;
          end if;
        exception when sqlstate 'NG409' then
          v_lent := null;  -- the slot stays leased: the answer is still busy
        end;
      end if;
      v_holding := true;  -- its claim may have locked rows, even one that claimed nothing
      v_at := array_position(v_ids, v_placed.node_id);
      if r.n = v_final then
        null;  -- no request after it to rank for
      elsif v_placed.reranked or v_at is null then
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
        v_placed.tokens_per_s, v_placed.refusal, null::text, null::text, v_lent is not null;
    exception when others then
      v_for := null;  -- what it claimed is undone: its ranking's move with it
      return query
      select r.n::integer, null::uuid, null::uuid, null::text, null::bytea, 0, '{}'::uuid[], null::text,
        null::integer, false, '{}'::real[], null::text, sqlstate, sqlerrm, false;
    end;
  end loop;
end;
$$;

