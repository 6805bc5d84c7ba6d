-- GPU claims that cost something to fake (issue 39, part 3). A gateway probes each online node's GPU
-- (neuralgrid/gateway/gpu_prober.py: fill its memory from a nonce, digests timed against the
-- datasheet bandwidth of the GPU it claims, a few blocks checked afterwards) and records the outcome
-- here. Each node's proof moves:
--   passed  -> proven   (probed again every gpu_probe_every_s)
--   slow    -> suspect  (probed again within minutes), and failed if slow again
--   wrong   -> failed   (digests its fill does not make: it holds no such data)
--   no_gpu  -> no_gpu   (the agent says the machine has no GPU it can use: the claim is not proven)
--   refused -> the state stays (it could not fill: no free memory), probed again within minutes
-- A failed GPU is a hard filter of the matcher, as a failed model is; probed again a day later.

alter table public.platform_settings
  add column gpu_probe_every_s real not null default 86400
    constraint "gpu_probe_every_s must be at least 60" check (gpu_probe_every_s >= 60);
comment on column public.platform_settings.gpu_probe_every_s is 'Seconds between GPU probes of a node whose GPU was proven (or that said it has none); a failed one is probed again after as long, a suspect or refused one within minutes.';

create table public.gpu_proofs (
  node_id uuid primary key references public.nodes (id) on delete cascade,
  state text not null default 'unproven',
  state_since timestamptz not null default now(),
  next_probe_at timestamptz not null default now(),
  probes integer not null default 0,
  gbps real,
  datasheet_gbps real,
  proven_gb real,
  device text,
  reason text,
  constraint "state must be unproven, proven, suspect, failed or no_gpu"
    check (state in ('unproven', 'proven', 'suspect', 'failed', 'no_gpu'))
);
comment on table public.gpu_proofs is 'Each node''s GPU proof: its state (what the last probes showed), the bandwidth its last probe showed against its claimed GPU''s datasheet, the memory it filled, the device its agent named, why it is in this state, and when it is probed next.';
create index gpu_proofs_due_idx on public.gpu_proofs (next_probe_at);
alter table public.gpu_proofs enable row level security;
create policy "Owners can see their own nodes' GPU proofs" on public.gpu_proofs for select to authenticated
  using (exists (select 1 from public.nodes n where n.id = gpu_proofs.node_id and n.owner_id = (select auth.uid())));
revoke all on public.gpu_proofs from anon, authenticated;
grant select on public.gpu_proofs to authenticated;
grant all on public.gpu_proofs to service_role;

create table public.gpu_probes (
  id bigint generated always as identity primary key,
  node_id uuid not null references public.nodes (id) on delete cascade,
  probed_at timestamptz not null default now(),
  outcome text not null
    constraint "outcome must be passed, slow, wrong, no_gpu or refused"
    check (outcome in ('passed', 'slow', 'wrong', 'no_gpu', 'refused')),
  state text not null,
  detail jsonb not null default '{}'
);
comment on table public.gpu_probes is 'The evidence behind each node''s GPU proof: every probe, its outcome, the state after it and what was measured (detail: bytes filled, seconds, round trip, bandwidth, datasheet, blocks found wrong).';
create index gpu_probes_node_idx on public.gpu_probes (node_id, probed_at);
alter table public.gpu_probes enable row level security;
create policy "Owners can see their own nodes' GPU probes" on public.gpu_probes for select to authenticated
  using (exists (select 1 from public.nodes n where n.id = gpu_probes.node_id and n.owner_id = (select auth.uid())));
revoke all on public.gpu_probes from anon, authenticated;
grant select on public.gpu_probes to authenticated;
grant all on public.gpu_probes to service_role;

-- Every node with an agent (a signing key: the probe is the agent's to answer) has a proof from
-- its registration; a node without one (an endpoint reached unsigned) has nothing to probe it with.
insert into public.gpu_proofs (node_id) select n.id from public.nodes n where n.secret_hash is not null;

create function private.start_gpu_proof() returns trigger
  language plpgsql security definer set search_path = '' as $$
begin
  -- New claims are proven anew, at once; a failed GPU stays failed until a probe passes.
  insert into public.gpu_proofs as g (node_id) values (new.id)
  on conflict (node_id) do update set state = 'unproven', state_since = now(), next_probe_at = now()
    where g.state <> 'failed';
  return null;
end;
$$;
comment on function private.start_gpu_proof() is 'Trigger: a node registered with an agent (or given one) has a GPU proof, unproven and due at once; so does one whose GPU claims change (a failed one stays failed until a probe passes).';
revoke all on function private.start_gpu_proof() from public;
create trigger nodes_start_gpu_proof after insert on public.nodes
  for each row when (new.secret_hash is not null) execute function private.start_gpu_proof();
create trigger nodes_restart_gpu_proof after update of secret_hash, gpu_model, gpu_count, vram_gb on public.nodes
  for each row when (new.secret_hash is not null and (old.secret_hash is distinct from new.secret_hash
    or old.gpu_model <> new.gpu_model or old.gpu_count <> new.gpu_count or old.vram_gb <> new.vram_gb))
  execute function private.start_gpu_proof();

create function public.due_gpu_probes(p_limit integer)
  returns table (node_id uuid, endpoint_url text, node_key bytea, gpu_model text, gpu_count integer,
                 vram_gb real, free_vram_gb real, state text)
  language plpgsql set search_path = '' as $$
begin
  -- Taken (SKIP LOCKED: gateways pass each other) and put off ten minutes at once: a gateway that
  -- dies mid-probe loses that probe, not the schedule; record_gpu_probe() sets the real next time.
  return query
  with due as (
    select g.node_id
    from public.gpu_proofs g
    join public.nodes n on n.id = g.node_id
    where g.next_probe_at <= now() and n.status in ('online', 'busy') and n.secret_hash is not null
    order by g.next_probe_at
    limit p_limit
    for update of g skip locked
  )
  update public.gpu_proofs g set next_probe_at = now() + interval '10 minutes'
  from due d, public.nodes n
  where g.node_id = d.node_id and n.id = d.node_id
  returning g.node_id, n.endpoint_url, n.secret_hash, n.gpu_model, n.gpu_count, n.vram_gb, n.free_vram_gb,
            g.state;
end;
$$;
comment on function public.due_gpu_probes(integer) is 'Up to p_limit online or busy nodes with an agent due a GPU probe (a node never probed is due at once), with what the probe needs: how to reach the node, the GPU it claims, its VRAM and free VRAM; each is put off ten minutes as it is taken.';
revoke all on function public.due_gpu_probes(integer) from public, anon, authenticated;
grant execute on function public.due_gpu_probes(integer) to service_role;

create function public.record_gpu_probe(p_node_id uuid, p_outcome text, p_detail jsonb default '{}')
  returns table (state text, next_probe_at timestamptz)
  language plpgsql set search_path = '' as $$
declare
  v_proof public.gpu_proofs;
  v_state text;
  v_every real;
begin
  if p_outcome is null or p_outcome not in ('passed', 'slow', 'wrong', 'no_gpu', 'refused') then
    raise exception 'outcome must be passed, slow, wrong, no_gpu or refused, got %', coalesce(p_outcome, 'null')
      using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_typeof(coalesce(p_detail, '{}')) <> 'object' then
    raise exception 'detail must be a JSON object' using errcode = 'invalid_parameter_value';
  end if;
  select * into v_proof from public.gpu_proofs g where g.node_id = p_node_id for update;
  if not found then
    raise exception 'node % has no GPU proof to record (due_gpu_probes() starts one)', p_node_id
      using errcode = 'foreign_key_violation';
  end if;
  select s.gpu_probe_every_s into v_every from public.platform_settings s;
  v_state := case p_outcome
    when 'passed' then 'proven'
    when 'wrong' then 'failed'
    when 'no_gpu' then 'no_gpu'
    when 'slow' then case when v_proof.state = 'suspect' then 'failed' else 'suspect' end
    else v_proof.state end;
  update public.gpu_proofs g set
    state = v_state,
    state_since = case when v_state = g.state then g.state_since else now() end,
    probes = g.probes + 1,
    next_probe_at = now() + make_interval(secs => case
      when p_outcome = 'refused' or v_state = 'suspect' then 600 else v_every end),
    gbps = coalesce((p_detail ->> 'gbps')::real, g.gbps),
    datasheet_gbps = coalesce((p_detail ->> 'datasheet_gbps')::real, g.datasheet_gbps),
    proven_gb = case when p_outcome = 'passed' then (p_detail ->> 'bytes')::real / 2 ^ 30 else g.proven_gb end,
    device = coalesce(p_detail ->> 'device', g.device),
    reason = p_detail ->> 'reason'
  where g.node_id = p_node_id;
  insert into public.gpu_probes (node_id, outcome, state, detail)
  values (p_node_id, p_outcome, v_state, coalesce(p_detail, '{}'));
  if v_state = 'failed' and v_proof.state <> 'failed' then
    delete from public.node_scores s where s.node_id = p_node_id;  -- out of the matcher's cache
  elsif v_proof.state = 'failed' and v_state <> 'failed' then
    perform private.refresh_node_scores(array[p_node_id]);  -- back in it
  end if;
  return query select v_state, g.next_probe_at from public.gpu_proofs g where g.node_id = p_node_id;
end;
$$;
comment on function public.record_gpu_probe(uuid, text, jsonb) is 'Records a GPU probe of p_node_id: p_outcome passed, slow (the time showed less bandwidth than the claimed GPU''s datasheet allows), wrong (digests the fill does not make), no_gpu or refused (it could not fill), with what was measured (p_detail: bytes, gbps, datasheet_gbps, device, reason, ...). Moves its proof: passed proves it; slow makes it suspect, and fails a suspect; wrong fails it; a failed GPU leaves the matcher (a hard filter) until a probe passes. Returns the state and the next probe''s time.';
revoke all on function public.record_gpu_probe(uuid, text, jsonb) from public, anon, authenticated;
grant execute on function public.record_gpu_probe(uuid, text, jsonb) to service_role;

-- The matcher's hard filter: a node whose GPU failed is not scored (node_components, node_scores),
-- not dispatched to on a lease, and explained.
CREATE OR REPLACE VIEW private.node_components WITH (security_invoker='true') AS
 SELECT w.name AS policy,
    nm.model_id,
    n.id AS node_id,
    n.region,
    (n.vram_gb)::double precision AS vram_gb,
    c.fit,
    c.compute,
    c.price,
    c.warm,
    c.capacity,
    c.reputation,
    (b.fixed_base + (b.capacity_share * c.capacity)) AS base,
    ((w.fit)::double precision / s.weight) AS fit_weight,
    b.fixed_base,
    b.capacity_share,
    p.other_base,
    p.reputation_share
   FROM ((((((((public.nodes n
     JOIN public.node_models nm ON ((nm.node_id = n.id)))
     LEFT JOIN public.models m ON ((m.id = nm.model_id)))
     CROSS JOIN public.matching_policies w)
     CROSS JOIN LATERAL ( SELECT (((((((w.fit + w.compute) + w.price) + w.warm) + w.capacity) + w.reputation) + w.proximity) + w.reserve) AS weight) s)
     CROSS JOIN LATERAL ( SELECT (n.vram_gb)::double precision AS vram_gb,
            (n.tflops)::double precision AS tflops,
            (n.hourly_rate)::double precision AS hourly_rate,
            COALESCE(n.speed_ratio, (1.0)::real) AS speed_ratio,
            (n.inflight + n.outside_load) AS load) i)
     CROSS JOIN LATERAL ( SELECT LEAST((1.0)::double precision, ((COALESCE(m.min_vram_gb, (1)::real))::double precision / i.vram_gb)) AS fit,
            ((i.tflops * LEAST((1.0)::real, i.speed_ratio)) / ((i.tflops * LEAST((1.0)::real, i.speed_ratio)) + w.compute_half_tflops)) AS compute,
            (w.price_half_usd_per_tflop_hour / (w.price_half_usd_per_tflop_hour + (i.hourly_rate / (i.tflops * LEAST((1.0)::real, i.speed_ratio))))) AS price,
                CASE
                    WHEN (nm.state = 'loaded'::text) THEN (1.0)::double precision
                    ELSE (0.0)::double precision
                END AS warm,
            GREATEST((0.0)::double precision, ((1.0)::double precision - ((i.load)::double precision / (n.max_concurrency)::double precision))) AS capacity,
            ((((n.successes + 1))::double precision / (((n.successes + n.failures) + 2))::double precision) * LEAST((1.0)::double precision, (i.speed_ratio / (0.25)::double precision))) AS reputation) c)
     CROSS JOIN LATERAL ( SELECT (((((w.fit * c.fit) + (w.compute * c.compute)) + (w.price * c.price)) + (w.warm * c.warm)) / s.weight) AS other_base,
            ((w.reputation)::double precision / s.weight) AS reputation_share,
            ((w.capacity)::double precision / s.weight) AS capacity_share) p)
     CROSS JOIN LATERAL ( SELECT (p.other_base + (p.reputation_share * c.reputation)) AS fixed_base,
            p.capacity_share) b)
  WHERE NOT EXISTS (SELECT 1 FROM public.model_checks mc
                    WHERE mc.node_id = nm.node_id AND mc.model_id = nm.model_id AND mc.state = 'failed')
    AND NOT EXISTS (SELECT 1 FROM public.gpu_proofs g WHERE g.node_id = n.id AND g.state = 'failed');
COMMENT ON VIEW private.node_components IS 'The request-independent score components of each node for each model it holds under each weighted policy, each in [0,1], with fit for the catalog''s VRAM need; base is their weighted share of the score: fixed_base (all but capacity: other_base plus reputation_share times reputation) plus capacity_share times capacity, so that a change of load or of the success counts alone is rescored without this view. fit_weight is the fit''s share (a request''s own need changes only that term). A model its node failed verification for (model_checks) is not there: a hard filter; so is a node whose GPU failed its probe (gpu_proofs).';
CREATE OR REPLACE FUNCTION private.lease_usable_nodes(p_model text, p_node_ids uuid[]) RETURNS SETOF uuid
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $$
begin
  -- A node a lease may be dispatched to: online (or busy: full, most likely with leased slots), not
  -- cooling down, beating (score_nodes()'s freshness), holding the model, not failed for it and its GPU not failed. (PL/pgSQL,
  -- not SQL: a function that pins its search_path is not inlined, and this way its plan is kept.)
  return query
  select n.id
  from public.nodes n
  join public.node_models nm on nm.node_id = n.id and nm.model_id = p_model
  left join public.node_liveness l on l.node_id = n.id
  cross join public.platform_settings s
  where n.id = any (p_node_ids)
    and n.status in ('online', 'busy')
    and (n.cooldown_until is null or n.cooldown_until <= now())
    and greatest(n.last_heartbeat_at, l.last_heartbeat_at)
        >= now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
    and not exists (select 1 from public.model_checks mc
                    where mc.node_id = n.id and mc.model_id = p_model and mc.state = 'failed')
    and not exists (select 1 from public.gpu_proofs g where g.node_id = n.id and g.state = 'failed');
end;
$$;
COMMENT ON FUNCTION private.lease_usable_nodes(p_model text, p_node_ids uuid[]) IS 'Of p_node_ids, the nodes a lease for p_model may be dispatched to: online or busy, not cooling down, with a fresh heartbeat, holding the model, not failed verification for it, its GPU not failed its probe.';
CREATE OR REPLACE FUNCTION public.score_nodes(p_model text, p_min_vram_gb real DEFAULT NULL::real, p_policy text DEFAULT 'balanced'::text, p_region text DEFAULT NULL::text, p_latitude double precision DEFAULT NULL::double precision, p_longitude double precision DEFAULT NULL::double precision, p_max_hourly_rate numeric DEFAULT NULL::numeric, p_explain boolean DEFAULT false, p_limit integer DEFAULT NULL::integer, p_route text DEFAULT NULL::text) RETURNS TABLE(node_id uuid, name text, rank bigint, score double precision, fit double precision, compute double precision, price double precision, warm double precision, capacity double precision, reputation double precision, proximity double precision, reserve double precision, reject_reason text)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_min float8 := private.required_vram_gb(p_model, p_min_vram_gb);
  v_seed boolean := p_policy = 'seed';
  w public.matching_policies;
  v_weight float8;
  v_fresh_after timestamptz;
  v_kth float8;
  v_candidates uuid[];
  v_levels real[];
  v_pressures float8[];
begin
  if not v_seed then
    select * into w from public.matching_policies mp where mp.name = p_policy;
    if not found then
      raise exception 'unknown matching policy "%"', p_policy using errcode = 'invalid_parameter_value';
    end if;
    v_weight := w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity + w.reserve;
    -- Only levels above this request's need can cost it anything.
    if w.reserve > 0 then
      select array_agg(p.level_gb order by p.level_gb), array_agg(p.pressure order by p.level_gb)
        into v_levels, v_pressures
      from private.vram_pressure p where p.level_gb > v_min and p.pressure > 0;
    end if;
  end if;
  if (p_latitude is null) <> (p_longitude is null) then
    raise exception 'give both latitude and longitude, or neither' using errcode = 'invalid_parameter_value';
  end if;
  if p_limit is not null and p_limit < 1 then
    raise exception 'limit must be positive, got %', p_limit using errcode = 'invalid_parameter_value';
  end if;
  select now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
    into v_fresh_after from public.platform_settings s;

  -- Fast path: candidates from the node_scores index, then the exact top k among them (the base
  -- scores assume the catalog's VRAM need, so a custom need takes the full path). The route is a
  -- hard filter inside each walk, so a walk never stops short of k nodes that serve it.
  if not v_seed and not p_explain and p_limit is not null
     and v_min = private.required_vram_gb(p_model) then
    if v_levels is not null then
      -- Some bigger VRAM level is under pressure: the reserve differs between tiers. Each tier
      -- that can hold the request is walked on its own (below the request's own, all too small).
      v_candidates := array(
        select private.top_by_total(
          w, v_weight, p_model, t.tier_gb, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route,
          v_levels, v_pressures, p_region, p_latitude, p_longitude)
        from (select 0::real as tier_gb union select m.min_vram_gb from public.models m) t
        where t.tier_gb >= private.vram_tier(v_min)
          -- A tier with no node has nothing to walk. One index probe per tier: a subquery with a
          -- limit is run per row, where an EXISTS would be joined to every row of the model; and
          -- in the index's order, which a scan of the table cannot give without reading it all.
          and (select true from public.node_scores s
               where s.policy = p_policy and s.model_id = p_model and s.tier_gb = t.tier_gb
               order by s.base_score desc limit 1));
    elsif p_latitude is null and p_region is null then
      -- Every node's proximity is the same 0.5: the top k by base are the top k.
      v_candidates := array(select t.node_id from private.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route) t);
    elsif p_latitude is null then
      -- Proximity is 1 in the caller's region and 0 elsewhere: the top k is within the top k of
      -- each side.
      v_candidates := array(
        select t.node_id from private.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route, p_region, true) t
        union all
        select t.node_id from private.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route, p_region, false) t);
    else
      -- Proximity varies continuously: every node whose base is within the proximity weight of
      -- the k-th best base may still rank.
      select min(t.base_score) into v_kth from private.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route) t;
      v_candidates := array(select t.node_id from private.top_by_base(
        p_policy, p_model, 2147483647, v_min, v_fresh_after, p_max_hourly_rate, p_route, null, null,
        v_kth - w.proximity / v_weight - 1e-12) t);
    end if;
    return query
    select r.id, r.name, row_number() over (order by r.total desc, r.id), r.total,
           r.fit, r.compute, r.price, r.warm, r.capacity, r.reputation, r.prox, r.reserve, null::text
    from (
      select n.id, n.name, c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, x.prox, x.reserve,
             c.base + (w.proximity * x.prox + w.reserve * x.reserve) / v_weight as total
      from unnest(v_candidates) as k (id)
      join public.nodes n on n.id = k.id
      join private.node_components c on c.node_id = n.id and c.model_id = p_model and c.policy = p_policy
      cross join lateral (
        -- Known without the node: an unknown caller is 0.5 from everyone, and with no level under
        -- pressure nothing is reserved (what the two functions return then, without calling them).
        select case when p_region is null and p_latitude is null then 0.5::float8
                    else private.proximity_component(w, n.region, n.latitude, n.longitude, p_region, p_latitude, p_longitude)
               end as prox,
               case when v_levels is null then 1.0::float8
                    else private.reserve_component(c.vram_gb, v_min, v_levels, v_pressures) end as reserve
        offset 0  -- once per node: not again for the total
      ) x
      order by total desc, n.id
      limit p_limit
    ) r
    order by 3;
    return;
  end if;

  -- Full path: every node judged, for seed, explanations, a custom VRAM need or no limit.
  return query
  with judged as (
    select n.id, n.name, n.vram_gb::float8 as vram_gb, n.tflops::float8 as tflops,
           n.hourly_rate::float8 as hourly_rate, n.region, n.latitude, n.longitude,
           coalesce(private.reject_reason(n, greatest(n.last_heartbeat_at, l.last_heartbeat_at), nm.state, p_model,
                                          v_min, v_fresh_after, p_max_hourly_rate, v_seed, p_route),
                    -- Hard filters of every policy, seed too (model_checks, gpu_proofs).
                    case when mc.state = 'failed' then format('failed verification of %s', p_model)
                         when gp.state = 'failed' then 'its GPU failed its probe' end) as reason
    from public.nodes n
    left join public.node_liveness l on l.node_id = n.id
    left join public.node_models nm on nm.node_id = n.id and nm.model_id = p_model
    left join public.model_checks mc on mc.node_id = n.id and mc.model_id = p_model
    left join public.gpu_proofs gp on gp.node_id = n.id
    where p_explain or n.status = 'online'
  ),
  ranked as (
    select j.id, j.name, c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, c.prox,
           c.reserve, c.total
    from judged j
    cross join lateral (
      select 0.3 * (j.vram_gb / v_min) + 0.5 * (j.tflops / 100.0) + 0.2 * (1.0 / (j.hourly_rate + 0.01)) as total,
             j.vram_gb / v_min as fit, j.tflops / 100.0 as compute, 1.0 / (j.hourly_rate + 0.01) as price,
             null::float8 as warm, null::float8 as capacity, null::float8 as reputation, null::float8 as prox,
             null::float8 as reserve
      where v_seed
      union all
      -- The view's fit and base are for the catalog's VRAM need; this request's need changes only
      -- the fit term.
      select c.base + c.fit_weight * (f.fit - c.fit) + (w.proximity * x.prox + w.reserve * x.reserve) / v_weight,
             f.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, x.prox, x.reserve
      from private.node_components c
      cross join lateral (select least(1.0::float8, v_min / c.vram_gb) as fit) f
      cross join lateral (
        select private.proximity_component(w, j.region, j.latitude, j.longitude, p_region, p_latitude, p_longitude)
                 as prox,
               private.reserve_component(c.vram_gb, v_min, v_levels, v_pressures) as reserve
        offset 0
      ) x
      where not v_seed and c.node_id = j.id and c.model_id = p_model and c.policy = p_policy
    ) c
    where j.reason is null
    order by c.total desc, j.id
    limit p_limit
  )
  select r.id, r.name, row_number() over (order by r.total desc, r.id), r.total,
         r.fit, r.compute, r.price, r.warm, r.capacity, r.reputation, r.prox, r.reserve, null::text
  from ranked r
  union all
  select j.id, j.name, null, null, null, null, null, null, null, null, null, null, j.reason
  from judged j
  where p_explain and j.reason is not null
  order by 3 nulls last, 1;
end;
$$;
COMMENT ON FUNCTION public.score_nodes(p_model text, p_min_vram_gb real, p_policy text, p_region text, p_latitude double precision, p_longitude double precision, p_max_hourly_rate numeric, p_explain boolean, p_limit integer, p_route text) IS 'Ranks the nodes that can serve p_model under a policy (seed or a row of matching_policies), best first, with each score component (reserve: how little it takes from requests needing more VRAM, under current demand); with p_route (the path after /v1/), only nodes serving that route; with p_explain, also lists every rejected node and why (a model the node failed verification for, or a GPU that failed its probe, among the reasons: hard filters of every policy).';