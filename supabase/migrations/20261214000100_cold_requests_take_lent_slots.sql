-- A request new to its gateway is placed in one round trip even where the gateway's other lanes
-- lease every slot of the nodes that could take it (issue 42: "cold, at most 1 RTT"). Measured
-- before (`neuralgrid bench world`, 2026-12-05, a node of 4 slots serving every model, leased by
-- four gateways): a cold request waited in line for another lane's renewal to give a slot back,
-- 27 ms to 5.3 s next to the database, a cold whole answer 2.7 RTT at 80 ms and 1.9 at 200.
-- A gateway asking place_jobs() now lends, with each request, one idle slot of its leases on each
-- of a few nodes (kept out of use until the answer comes). When every capable node is full, the
-- best lent slot that could serve the request (the node usable for the model, its VRAM, price cap
-- and route, ranked by the model's base score) leaves its lease for its node, and the request claims
-- it as any placement claims a slot: the node's slots never counted twice, the lease one smaller.

create function private.return_lent_slot(p_gateway uuid, p_model text, p_policy text, p_min_vram_gb real,
                                         p_max_hourly_rate numeric, p_route text, p_offered jsonb)
returns uuid
language plpgsql
set search_path = ''
as $$
declare
  v_lease record;
begin
  -- The best offered lease that could serve the request and holds more slots than the gateway has
  -- in use on it ("busy": a renewal under way may have given idle slots back meanwhile).
  select l.node_id, l.model_id, l.policy, l.region, o.busy into v_lease
  from jsonb_to_recordset(p_offered) as o (node uuid, model text, policy text, region text, busy integer)
  join private.slot_leases l
    on l.gateway_id = p_gateway and l.node_id = o.node and l.model_id = o.model
       and l.policy = coalesce(o.policy, 'balanced') and l.region = coalesce(o.region, '')
  join public.nodes n on n.id = l.node_id
  left join public.node_scores s on s.node_id = n.id and s.model_id = p_model and s.policy = p_policy
  where l.slots > coalesce(o.busy, 0) and l.expires_at > now()
    and n.id in (select private.lease_usable_nodes(p_model, array(
                   select (x ->> 'node')::uuid from jsonb_array_elements(p_offered) x)))
    and n.vram_gb >= private.required_vram_gb(p_model, p_min_vram_gb)
    and (p_max_hourly_rate is null or n.hourly_rate <= p_max_hourly_rate)
    and (p_route is null or p_route = any (n.routes))
  order by s.base_score desc nulls last, n.id
  limit 1;
  if v_lease.node_id is null then
    return null;
  end if;
  -- The node first, then the lease, as renewals lock them (private.move_lease_slots()).
  perform from public.nodes n where n.id = v_lease.node_id for no key update;
  update private.slot_leases l
  set slots = l.slots - 1, in_use = least(l.in_use, l.slots - 1), draining = least(l.draining, l.slots - 1)
  where l.gateway_id = p_gateway and l.node_id = v_lease.node_id and l.model_id = v_lease.model_id
    and l.policy = v_lease.policy and l.region = v_lease.region
    and l.slots > coalesce(v_lease.busy, 0) and l.expires_at > now();
  if not found then  -- changed while the node was locked: nothing lent
    return null;
  end if;
  update public.nodes n
  set inflight = n.inflight - 1,
      status = case when n.status = 'busy' then 'online' else n.status end
  where n.id = v_lease.node_id;
  return v_lease.node_id;
end;
$$;

comment on function private.return_lent_slot(uuid, text, text, real, numeric, text, jsonb) is
  'place_jobs(), when every capable node is full: of the slots gateway p_gateway lends from its leases (p_offered, a JSON array of {"node", "model", "policy", "region", "busy"}: one idle slot of that lease, which the gateway keeps out of use until it has the answer, and how many of the lease''s slots it has in use; a lease holding no more than that lends nothing), the best one that could serve the request (its node usable for p_model as leases are, with the VRAM, under the price cap, serving p_route; ranked by the model''s base score under p_policy) goes back from its lease to its node, free for the request to claim. Returns its node, or null when none could serve it.';

revoke all on function private.return_lent_slot(uuid, text, text, real, numeric, text, jsonb) from public;
grant execute on function private.return_lent_slot(uuid, text, text, real, numeric, text, jsonb) to service_role;

-- place_jobs() as before, with the lent slots and whether the request took one (lent).
drop function public.place_jobs(text, jsonb);

create function public.place_jobs(p_gateway text, p_requests jsonb)
returns table (ord integer, job_id uuid, node_id uuid, endpoint_url text, node_key bytea, attempt integer,
               fallback_ids uuid[], error text, max_output_tokens integer, busy boolean, tokens_per_s real[],
               refusal text, failure_state text, failure text, lent boolean)
language plpgsql
set search_path = ''
as $$
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


comment on function public.place_jobs(p_gateway text, p_requests jsonb) is
  'The gateway''s placements, grouped: place_job() for each request in the JSON array (at most 16), in order, as p_gateway; a request that fails gives its SQLSTATE and message and fails alone (55P03: it waited for a row lock longer than a group may, 100 ms for the first, 10 ms for the others: ask again). A request may carry "lend": idle slots of the gateway''s leases (private.return_lent_slot()); when every capable node is full the best of them that could serve it is claimed, and lent says so (the gateway''s lease is one slot smaller).';

revoke all on function public.place_jobs(text, jsonb) from public, anon, authenticated;
grant execute on function public.place_jobs(text, jsonb) to service_role;
