-- A renewal moves every running job SQL placed for its gateway into the lane's lease again, and a
-- slot the gateway lends counts in use every job moved into that lease that the gateway does not
-- say has ended.
--
-- Since 20261222000100 a renewal moved only the jobs its gateway named: one whose placement's
-- answer reached the gateway while a renewal was on its way stayed SQL's until its end was written,
-- a round trip after it ended, and a far gateway's next new model met the node full of it and waited
-- in line (bench world: 31 of 200 far cold requests over 1.5 RTT, against 3 of 80 before). Both ends
-- are kept now: SQL marks each attempt it moves (job_attempts.moved) and counts those in use where
-- the gateway lends the lease (private.moved_into_lease()), known to the gateway or not, but for the
-- jobs the gateway says ended (their ends on their way). The gateway's "busy" no longer counts the
-- moved jobs it knows, so none is counted twice.
--
-- A renewal counts them so too (renew_leases(): a lane's "adopted", the moved slots the gateway
-- knows, and "ended"), and names every one still running among the absorbed: a renewal's answer
-- lost after it moved a job the gateway did not know yet left that job's slot idle to the gateway
-- (a review). The lane's "placed", which served that for the jobs it knew, is gone.
--
-- Two partial indexes keep both reads to the few rows they need: the running attempts SQL holds a
-- slot for (not leased), which renewals move, and the running moved ones on a node.

ALTER TABLE public.job_attempts ADD COLUMN moved boolean DEFAULT false NOT NULL;

COMMENT ON COLUMN public.job_attempts.moved IS 'A renewal moved the attempt''s slot into its gateway''s lease (private.renew_lane()): counted in use where the gateway lends that lease until the attempt ends or the gateway says the job ended (private.moved_into_lease()).';

CREATE INDEX job_attempts_unleased_idx ON public.job_attempts USING btree (job_id) WHERE ((status = 'running'::text) AND (NOT leased));

CREATE INDEX job_attempts_moved_idx ON public.job_attempts USING btree (node_id) WHERE ((status = 'running'::text) AND moved);

DROP FUNCTION private.renew_lane(p_gateway uuid, p_model text, p_policy text, p_region text, p_want integer, p_need integer, p_in_use jsonb, p_placed uuid[], p_reported boolean, p_expires_at timestamp with time zone);

CREATE FUNCTION private.renew_lane(p_gateway uuid, p_model text, p_policy text, p_region text, p_want integer, p_need integer, p_in_use jsonb, p_reported boolean, p_expires_at timestamp with time zone) RETURNS uuid[]
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_ids uuid[];
  v_deltas integer[];
  v_ranked uuid[];
  v_scores float8[];
  v_limit integer;
  v_usable uuid[];  -- of the ranked nodes and those leased in the lane, the usable ones
  v_capacity integer;
  v_target integer;
  v_wanted_elsewhere uuid[];  -- full nodes a lane that holds nothing could be served on
  v_spares_wanted uuid[];  -- full nodes where another lane holds less than it is owed: no idle spare kept there
  v_spares integer;  -- how many idle slots it may hold above its target: what it wants beyond its need
  v_mine uuid[];  -- the gateway's running jobs of the lane that SQL placed
  v_absorbed uuid[];  -- of them, those whose slots join its lease
begin
  -- A count above what the lease holds: the slots are taken back where the node has them free, in
  -- use (renew_leases() wrote every lane's count in use, up to what each lease held).
  select array_agg(u.id order by u.id), array_agg(u.used - coalesce(l.slots, 0) order by u.id) into v_ids, v_deltas
  from (select r.key::uuid as id, r.value::integer as used from jsonb_each_text(p_in_use) r) u
  join public.nodes n on n.id = u.id
  left join private.slot_leases l
    on l.gateway_id = p_gateway and l.node_id = u.id and l.model_id = p_model and l.policy = p_policy
       and l.region = p_region
  where u.used > coalesce(l.slots, 0);
  if v_ids is not null then
    perform private.move_lease_slots(p_gateway, p_model, p_policy, p_region, v_ids, v_deltas, p_expires_at);
    update private.slot_leases l
    set in_use = least((p_in_use ->> l.node_id::text)::integer, l.slots)
    where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region
      and l.node_id = any (v_ids);
  end if;

  -- The gateway's jobs of the lane that SQL placed (no slot it leased was free), still running on a
  -- node the lane may lease: their slots join its lease, in use, and their attempts become leased
  -- (the node's inflight is unchanged: the claim becomes the lease's; their ends free nothing).
  -- Else a gateway at full load places some of its requests in SQL for good: the end of each frees
  -- a slot that its caller's next request claims in SQL again before a renewal could lease it.
  -- Rows another transaction holds are skipped, never waited for; the next renewal takes them.
  -- Only jobs on their first attempt: one SQL moved on stays SQL's to its end (the gateway, which
  -- does not know the nodes it tried, could move it back to one that failed it). Each one moved is
  -- marked (moved): where the gateway lends the lease's idle slots, SQL counts it in use unless the
  -- gateway says it ended (private.moved_into_lease()), since it may not know of it yet.
  if p_reported then
    v_mine := array(
      select j.id from public.jobs j
      where j.id = any (array(select a.job_id from public.job_attempts a where a.status = 'running' and not a.leased))
        and j.gateway_id = p_gateway and j.status = 'running' and j.model_id = p_model and j.policy = p_policy
        and coalesce(j.region, '') = p_region
      order by j.id
      for no key update skip locked);
  end if;
  if cardinality(v_mine) > 0 then
    with running as (
      select a.job_id, a.attempt, a.node_id from public.job_attempts a
      where a.job_id = any (v_mine) and a.status = 'running' and not a.leased and a.attempt = 1
        and a.node_id in (select private.lease_usable_nodes(p_model, array(
                            select r.node_id from public.job_attempts r where r.job_id = any (v_mine) and r.status = 'running')))
      order by a.job_id, a.attempt
      for no key update skip locked
    ),
    taken as (
      update public.job_attempts a set leased = true, moved = true
      from running r
      where a.job_id = r.job_id and a.attempt = r.attempt
      returning a.job_id, a.node_id
    ),
    leased as (
      insert into private.slot_leases as l (gateway_id, node_id, model_id, policy, region, slots, in_use, expires_at)
      select p_gateway, t.node_id, p_model, p_policy, p_region, count(*), count(*), p_expires_at
      from taken t
      group by t.node_id
      on conflict on constraint slot_leases_pkey
      do update set slots = l.slots + excluded.slots, in_use = l.in_use + excluded.in_use
    )
    select array_agg(t.job_id order by t.job_id) into v_absorbed from taken t;
  end if;

  -- A lane that needs nothing and holds nothing (a model asked for lately, idle now) can be given
  -- only a spare, claimed below on a node serving its model that keeps a slot free beside it and
  -- where the gateway holds no idle slot yet. With no such node there is nothing to rank it for: a
  -- gateway renews every model asked for within 10 s, twice a second, and ranking each idle one
  -- cost Postgres some 0.8 ms a renewal on a fleet of 18 nodes (2026-12-07).
  if p_need = 0
     and not exists (select from private.slot_leases l
                     where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy
                       and l.region = p_region)
     and not exists (select from public.node_models nm
                     join public.nodes n on n.id = nm.node_id
                     where nm.model_id = p_model and n.status in ('online', 'busy')
                       and n.max_concurrency - n.inflight >= 2
                       and not exists (select from private.slot_leases y
                                       where y.gateway_id = p_gateway and y.node_id = n.id and y.slots > y.in_use)) then
    update private.lane_demand d set share = 0
    where d.gateway_id = p_gateway and d.model_id = p_model and d.policy = p_policy and d.region = p_region
      and d.share is distinct from 0;
    return coalesce(v_absorbed, '{}');
  end if;

  -- The lane's nodes as score_nodes() ranks them now (only nodes with a free slot), enough of them
  -- to hold what every gateway wants.
  select least(greatest(private.ranking_limit(0), coalesce(sum(d.wanted), 0)), 1000)::integer into v_limit
  from private.lane_demand d
  where d.model_id = p_model and d.policy = p_policy and d.region = p_region;
  -- None where the model or the policy no longer exists (score_nodes() would refuse the lane, and
  -- with it the gateway's whole renewal): the lane's idle slots go back below.
  if private.lane_can_rank(p_model, p_policy) then
    select array_agg(s.node_id order by s.rank), array_agg(s.score order by s.rank) into v_ranked, v_scores
    from public.score_nodes(p_model, null, p_policy, nullif(p_region, ''), null, null, null, false, v_limit, null) s;
  end if;
  v_ranked := coalesce(v_ranked, '{}');

  -- The lane's capacity: free slots on the ranked nodes, and the slots leased in the lane (by any
  -- gateway) on nodes still usable.
  v_usable := array(select private.lease_usable_nodes(p_model, v_ranked || array(
                      select l.node_id from private.slot_leases l
                      where l.model_id = p_model and l.policy = p_policy and l.region = p_region)));
  select coalesce(sum(greatest(n.max_concurrency - n.inflight + coalesce(h.slots, 0), 0)), 0)::integer into v_capacity
  from public.nodes n
  left join lateral (
    select sum(l.slots) as slots from private.slot_leases l
    where l.node_id = n.id and l.model_id = p_model and l.policy = p_policy and l.region = p_region
  ) h on true
  where n.id = any (v_usable);
  -- The lane's nodes that hold the model of another live lane that needs slots and holds none, of
  -- a gateway holding no idle slot on the node (one that does lends it to the lane's first request):
  -- once full, they keep no idle slot for this lane, and it claims no more on them, so that the
  -- starved lane (a model asked for the first time, on nodes leased for others) gets slots at its
  -- next renewal. Slots in use stay. (Yielding to any lane holding none, in `bench world` every
  -- gateway's first request for a model took the idle slots the other gateways would have lent.)
  v_wanted_elsewhere := array(
    select distinct nm.node_id
    from private.lane_demand d
    join private.gateways g on g.id = d.gateway_id
    join public.node_models nm on nm.model_id = d.model_id
    cross join public.platform_settings s
    where (d.model_id, d.policy, d.region) is distinct from (p_model, p_policy, p_region)
      and coalesce(d.needed, d.wanted) > 0 and d.renewed_at >= now() - make_interval(secs => s.lease_s)
      and private.gateway_is_live(g.seen_at)
      and nm.node_id in (select l.node_id from private.slot_leases l
                         where l.model_id = p_model and l.policy = p_policy and l.region = p_region)
      and not exists (select from private.slot_leases x
                      where x.gateway_id = d.gateway_id and x.model_id = d.model_id and x.policy = d.policy
                        and x.region = d.region and x.slots > 0)
      and not exists (select from private.slot_leases y
                      where y.gateway_id = d.gateway_id and y.node_id = nm.node_id and y.slots > y.in_use));
  -- The lane's full nodes that hold the model of another lane that holds less than it is owed:
  -- another lane of this gateway that needs more than it holds (its request waits in line), or a
  -- lane of another gateway below its share (of this lane, or of another) with no idle slot there
  -- to lend. This lane keeps no idle spare there: a spare never stands in the way of a need.
  v_spares_wanted := array(
    select distinct nm.node_id
    from private.lane_demand d
    join private.gateways g on g.id = d.gateway_id
    join public.node_models nm on nm.model_id = d.model_id
    join public.nodes n on n.id = nm.node_id
    cross join public.platform_settings s
    where (d.gateway_id, d.model_id, d.policy, d.region) is distinct from (p_gateway, p_model, p_policy, p_region)
      and d.renewed_at >= now() - make_interval(secs => s.lease_s) and private.gateway_is_live(g.seen_at)
      and case when d.gateway_id = p_gateway then coalesce(d.needed, d.wanted) else coalesce(d.share, 0) end
          > (select coalesce(sum(x.slots), 0) from private.slot_leases x
             where x.gateway_id = d.gateway_id and x.model_id = d.model_id and x.policy = d.policy
               and x.region = d.region)
      and n.inflight >= n.max_concurrency
      and (d.gateway_id = p_gateway
           or not exists (select from private.slot_leases y
                          where y.gateway_id = d.gateway_id and y.node_id = nm.node_id and y.slots > y.in_use))
      and nm.node_id in (select l.node_id from private.slot_leases l
                         where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy
                           and l.region = p_region));
  v_target := case when p_reported then private.lane_target(p_gateway, p_model, p_policy, p_region, v_capacity) else 0 end;
  -- Spares only once all it needs is its share: a gateway short of its need holds none idle.
  v_spares := case when p_reported and v_target >= p_need then p_want - p_need else 0 end;
  update private.lane_demand d set share = v_target
  where d.gateway_id = p_gateway and d.model_id = p_model and d.policy = p_policy and d.region = p_region
    and d.share is distinct from v_target;

  -- Given back: idle slots on nodes no longer usable, or holding more than they have slots (their
  -- server's slots went down); then idle slots above the target from the lowest ranked lease up,
  -- but for the spares it keeps: one of them a node where the node then has another slot free, it
  -- holds none idle in another lane and no other lane is owed one, as many as it wants beyond its
  -- need.
  -- Claimed: free slots toward the target (its need's share) from the best ranked node down; then
  -- spares, one a node, only where the node keeps a slot free (for the requests SQL places: a
  -- gateway's first for a model, a failed job's next node) and the gateway holds no idle slot
  -- already (in any lane: a request SQL places lends it), so that spares spread over the gateways.
  with own as (
    select l.node_id, l.slots, l.in_use, n.inflight, n.max_concurrency,
           l.node_id = any (v_usable) as usable,
           n.inflight >= n.max_concurrency and l.node_id = any (v_wanted_elsewhere) as yields,
           coalesce(r.score, l.score, (select s.base_score from public.node_scores s
                                       where s.node_id = l.node_id and s.policy = p_policy and s.model_id = p_model),
                    '-Infinity'::float8) as score
    from private.slot_leases l
    join public.nodes n on n.id = l.node_id
    left join unnest(v_ranked, v_scores) as r (id, score) on r.id = l.node_id
    where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region
  ),
  forced as (
    select o.node_id, o.usable, o.score, o.in_use,
           case when not o.usable or o.yields then o.slots - o.in_use
                else least(o.slots - o.in_use, greatest(o.inflight - o.max_concurrency, 0)) end as k,
           o.slots, o.inflight, o.max_concurrency
    from own o
  ),
  kept as (
    select f.node_id, f.slots - f.k as slots, f.in_use, f.score, f.inflight - f.k as inflight, f.max_concurrency,
           sum(f.slots - f.k) over () as held
    from forced f
    where f.usable
  ),
  surplus as (  -- the idle slots above the target, from the lowest ranked lease up
    select s.node_id, s.score, s.held, s.inflight, s.max_concurrency,
           least(s.slots - s.in_use,
                 greatest(s.held - v_target
                          - coalesce(sum(s.slots - s.in_use) over (order by s.score, s.node_id desc
                                                                   rows between unbounded preceding and 1 preceding), 0),
                          0)) as k
    from kept s
  ),
  left_over as (
    select s.node_id, s.score, s.held, s.k,
           -- a spare kept here: one of those slots, where the node has another free once the rest
           -- are given back (as a spare is claimed: never a node's last free slot) and the gateway
           -- holds none idle in another lane
           case when s.k > 0 and s.inflight - s.k + 1 < s.max_concurrency and s.node_id <> all (v_spares_wanted)
                     and not exists (select from private.slot_leases x
                                     where x.gateway_id = p_gateway and x.node_id = s.node_id and x.slots > x.in_use
                                       and (x.model_id, x.policy, x.region) <> (p_model, p_policy, p_region))
                then 1 else 0 end as keepable
    from surplus s
  ),
  shrunk as (  -- given back: the surplus but for the spares kept, best ranked first, as many as it wants beyond its need
    select l.node_id,
           l.k - least(l.keepable, greatest(v_spares - coalesce(sum(l.keepable) over (order by l.score desc, l.node_id
                                                                                      rows between unbounded preceding and 1 preceding), 0),
                                            0)) as k
    from left_over l
  ),
  room as (
    select r.id, r.ord, greatest(n.max_concurrency - n.inflight, 0) as free,
           exists (select from private.slot_leases x
                   where x.gateway_id = p_gateway and x.node_id = r.id and x.slots > x.in_use) as idle_here
    from unnest(v_ranked) with ordinality as r (id, ord)
    join public.nodes n on n.id = r.id
    where r.id = any (v_usable) and r.id <> all (v_wanted_elsewhere)
  ),
  claim as (  -- toward the target, then the spares
    select greatest(v_target - h.held, 0) as needed,
           greatest(v_target + v_spares - greatest(h.held, v_target), 0) as spares
    from (select coalesce(max(k.held), 0) as held from left_over k) h
  ),
  for_need as (
    select f.id, f.ord, f.free, f.idle_here,
           least(f.free,
                 greatest(c.needed - coalesce(sum(f.free) over (order by f.ord rows between unbounded preceding and 1 preceding), 0),
                          0)) as k
    from room f cross join claim c
  ),
  for_spares as (
    select f.id, f.ord, f.k, case when f.idle_here then 0 else least(greatest(f.free - f.k - 1, 0), 1) end as room
    from for_need f
  ),
  grown as (
    select f.id as node_id,
           f.k + least(f.room,
                       greatest(c.spares - coalesce(sum(f.room) over (order by f.ord rows between unbounded preceding and 1 preceding), 0),
                                0)) as k
    from for_spares f cross join claim c
  ),
  moves as (
    select f.node_id, -f.k as delta from forced f where f.k > 0
    union all
    select s.node_id, -s.k from shrunk s where s.k > 0
    union all
    select g.node_id, g.k from grown g where g.k > 0
  )
  select array_agg(m.node_id), array_agg(m.delta) into v_ids, v_deltas from moves m;
  if v_ids is not null then
    perform private.move_lease_slots(p_gateway, p_model, p_policy, p_region, v_ids, v_deltas, p_expires_at);
  end if;

  -- What stays above the target on usable nodes, but for the idle spares, is in use (the idle slots
  -- above it went back): the lowest ranked leases' slots in use drain, not taken again, so that a
  -- gateway that keeps its slots busy cannot keep more than its share from the gateways that need
  -- them (whose requests wait meanwhile). A lease on a node no longer usable is not returned at all.
  with held as (
    select l.node_id, l.in_use, l.node_id = any (v_usable) as usable,
           sum(l.in_use) filter (where l.node_id = any (v_usable)) over () - v_target as excess,
           coalesce(sum(l.in_use) filter (where l.node_id = any (v_usable))
                      over (order by l.score nulls first, l.node_id desc
                            rows between unbounded preceding and 1 preceding), 0) as below
    from private.slot_leases l
    where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region
  ),
  draining as (
    select h.node_id, case when h.usable then least(h.in_use, greatest(h.excess - h.below, 0)) else 0 end as n
    from held h
  )
  update private.slot_leases l
  set draining = d.n
  from draining d
  where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region
    and l.node_id = d.node_id and l.draining <> d.n;

  -- Renewed: until the new end, with the score each node ranks by; leases holding nothing are gone.
  update private.slot_leases l
  set expires_at = p_expires_at,
      score = coalesce((select r.score from unnest(v_ranked, v_scores) as r (id, score) where r.id = l.node_id),
                       l.score,
                       (select s.base_score from public.node_scores s
                        where s.node_id = l.node_id and s.policy = p_policy and s.model_id = p_model))
  where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region;
  delete from private.slot_leases l
  where l.gateway_id = p_gateway and l.model_id = p_model and l.policy = p_policy and l.region = p_region
    and l.slots = 0 and l.in_use = 0;
  return coalesce(v_absorbed, '{}');
end;
$$;

COMMENT ON FUNCTION private.renew_lane(p_gateway uuid, p_model text, p_policy text, p_region text, p_want integer, p_need integer, p_in_use jsonb, p_reported boolean, p_expires_at timestamp with time zone) IS 'renew_leases() for one lane of one gateway, its demand recorded (p_reported false: a lane it no longer reports, wanting nothing): sets its leases'' slots in use from p_in_use ({node id: count}), moves the slots of its running jobs of the lane that SQL placed, on their first attempt, into its leases (in use; their attempts leased and moved), works out its target (private.lane_target()) over the lane''s capacity, gives back idle slots (on nodes no longer usable, then above the target from the lowest ranked, but for the spares it keeps: up to p_want - p_need idle slots, one a node, where the node has another slot free, it holds none idle in another lane and no other lane on a full node is owed one), claims free ones toward the target from the best ranked, those above p_need (spares) one a node, only where the node keeps a slot free and the gateway holds no idle slot already (private.move_lease_slots()), marks the slots in use still above the target as draining (lowest ranked first: not to be taken again), and renews the leases until p_expires_at. Returns the ids of the jobs whose slots it moved into the leases.';

REVOKE ALL ON FUNCTION private.renew_lane(p_gateway uuid, p_model text, p_policy text, p_region text, p_want integer, p_need integer, p_in_use jsonb, p_reported boolean, p_expires_at timestamp with time zone) FROM PUBLIC;
GRANT ALL ON FUNCTION private.renew_lane(p_gateway uuid, p_model text, p_policy text, p_region text, p_want integer, p_need integer, p_in_use jsonb, p_reported boolean, p_expires_at timestamp with time zone) TO service_role;

CREATE OR REPLACE FUNCTION public.renew_leases(p_gateway uuid, p_lanes jsonb) RETURNS TABLE(model_id text, policy text, region text, node_id uuid, endpoint_url text, node_key bytea, slots integer, in_use integer, rank integer, tokens_per_s real, routes text[], expires_at timestamp with time zone, hourly_rate numeric, absorbed uuid[], draining integer, share integer)
    LANGUAGE plpgsql
    SET search_path TO ''
    SET jit TO 'off'
    AS $$
declare
  v_lane jsonb;
  v_n integer;
  v_model text;
  v_policy text;
  v_region text;
  v_want numeric;
  v_need numeric;
  v_in_use jsonb;
  v_adopted jsonb;
  v_ended jsonb;
  v_used record;
  v_said integer;  -- slots in use on a lease, as the gateway said
  v_known integer;  -- of them, those a renewal moved in that it adopted
  v_lanes jsonb := '[]';  -- the lanes as read: [{model, policy, region, want, need, in_use, adopted, ended, reported}]
  v_absorbed uuid[] := '{}';  -- its jobs SQL placed whose slots its leases hold
  v_lock bigint;
  v_ranks boolean;  -- whether score_nodes() can rank the lane (private.lane_can_rank())
  v_expires_at timestamptz;
  r record;
  -- A node id: 36 characters of this shape.
  uuid_shape constant text := '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}';
begin
  if p_gateway is null then
    raise exception 'renew_leases needs the gateway''s id' using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_typeof(p_lanes) is distinct from 'array' then
    raise exception 'renew_leases takes a JSON array of lanes' using errcode = 'invalid_parameter_value';
  end if;
  -- The gateway's renewals and journal writes, one at a time, ordered here rather than in the
  -- gateway: they meet on the rows of its own jobs, and each must see what the other committed.
  perform pg_advisory_xact_lock(hashtextextended('gateway' || E'\n' || p_gateway::text, 4242));
  -- Read and check every lane before anything changes.
  for v_lane, v_n in select x.lane, x.n::integer from jsonb_array_elements(p_lanes) with ordinality as x (lane, n) loop
    if jsonb_typeof(v_lane) is distinct from 'object' then
      raise exception 'lane %: a lane is a JSON object', v_n using errcode = 'invalid_parameter_value';
    end if;
    if jsonb_typeof(v_lane -> 'model') is distinct from 'string' then
      raise exception 'lane %: "model" must be a string', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_model := v_lane ->> 'model';
    if coalesce(jsonb_typeof(v_lane -> 'policy'), 'null') not in ('null', 'string') then
      raise exception 'lane %: "policy" must be a string', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_policy := coalesce(v_lane ->> 'policy', 'balanced');
    if coalesce(jsonb_typeof(v_lane -> 'region'), 'null') not in ('null', 'string') then
      raise exception 'lane %: "region" must be a string or null', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_region := coalesce(v_lane ->> 'region', '');
    if jsonb_typeof(v_lane -> 'want') is distinct from 'number' then
      raise exception 'lane %: "want" must be a number of slots', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_want := (v_lane -> 'want')::numeric;
    if v_want < 0 or v_want <> trunc(v_want) or v_want > 1000000 then
      raise exception 'lane %: "want" must be a whole number of slots from 0 to 1000000, not %', v_n, v_want
        using errcode = 'invalid_parameter_value';
    end if;
    if coalesce(jsonb_typeof(v_lane -> 'need'), 'null') not in ('null', 'number') then
      raise exception 'lane %: "need" must be a number of slots', v_n using errcode = 'invalid_parameter_value';
    end if;
    v_need := coalesce((v_lane -> 'need')::numeric, v_want);  -- a gateway that says no need needs all it wants
    if v_need < 0 or v_need <> trunc(v_need) or v_need > v_want then
      raise exception 'lane %: "need" must be a whole number of slots from 0 to "want" (%), not %', v_n, v_want, v_need
        using errcode = 'invalid_parameter_value';
    end if;
    v_ended := coalesce(nullif(v_lane -> 'ended', 'null'), '[]');
    if jsonb_typeof(v_ended) <> 'array' or jsonb_array_length(v_ended) > 10000
       or exists (select from jsonb_array_elements(v_ended) p
                  where jsonb_typeof(p) <> 'string' or length(p #>> '{}') <> 36 or p #>> '{}' !~ uuid_shape) then
      raise exception 'lane %: "ended" must be an array of at most 10000 job ids', v_n
        using errcode = 'invalid_parameter_value';
    end if;
    v_in_use := coalesce(nullif(v_lane -> 'in_use', 'null'), '{}');
    if jsonb_typeof(v_in_use) <> 'object' then
      raise exception 'lane %: "in_use" must be an object of counts by node id', v_n using errcode = 'invalid_parameter_value';
    end if;
    for v_used in select u.key, u.value from jsonb_each(v_in_use) u loop
      if length(v_used.key) <> 36 or v_used.key !~ uuid_shape then
        raise exception 'lane %: "in_use" names "%", which is not a node id', v_n, v_used.key
          using errcode = 'invalid_parameter_value';
      end if;
      if (case when jsonb_typeof(v_used.value) = 'number'
               then (v_used.value)::numeric < 0 or (v_used.value)::numeric <> trunc((v_used.value)::numeric)
                    or (v_used.value)::numeric > 1000000
               else true end) then
        raise exception 'lane %: slots in use on node % must be a whole number from 0, not %', v_n, v_used.key, v_used.value
          using errcode = 'invalid_parameter_value';
      end if;
    end loop;
    v_adopted := coalesce(nullif(v_lane -> 'adopted', 'null'), '{}');
    if jsonb_typeof(v_adopted) <> 'object' then
      raise exception 'lane %: "adopted" must be an object of counts by node id', v_n using errcode = 'invalid_parameter_value';
    end if;
    for v_used in select u.key, u.value from jsonb_each(v_adopted) u loop
      if (case when jsonb_typeof(v_used.value) = 'number'
               then (v_used.value)::numeric < 0 or (v_used.value)::numeric <> trunc((v_used.value)::numeric)
                    or (v_used.value)::numeric > coalesce((v_in_use ->> v_used.key)::numeric, 0)
               else true end) then
        raise exception 'lane %: slots adopted on node % must be a whole number from 0 to those in use there, not %',
          v_n, v_used.key, v_used.value using errcode = 'invalid_parameter_value';
      end if;
    end loop;
    if exists (select from jsonb_array_elements(v_lanes) l
               where l ->> 'model' = v_model and l ->> 'policy' = v_policy and l ->> 'region' = v_region) then
      raise exception 'lane %: the lane (%, %, "%") is named twice', v_n, v_model, v_policy, v_region
        using errcode = 'invalid_parameter_value';
    end if;
    -- A lane of a model or policy that does not exist (a request for one, refused, is wanted a while;
    -- a model's last node dropped it) gets nothing: renewed as a lane its gateway no longer names,
    -- but for the slots it says in use, which stay until their jobs end.
    v_ranks := private.lane_can_rank(v_model, v_policy);
    v_lanes := v_lanes || jsonb_build_object('model', v_model, 'policy', v_policy, 'region', v_region,
                                             'want', case when v_ranks then v_want::integer else 0 end,
                                             'need', case when v_ranks then v_need::integer else 0 end,
                                             'in_use', v_in_use, 'adopted', v_adopted, 'ended', v_ended, 'reported', v_ranks);
  end loop;

  -- A renewal is a check-in.
  insert into private.gateways as g (id) values (p_gateway) on conflict (id) do update set seen_at = now();
  v_expires_at := now() + (select make_interval(secs => s.lease_s) from public.platform_settings s);

  -- The lanes it no longer reports but still holds or wanted: nothing wanted, nothing in use.
  select v_lanes || coalesce(jsonb_agg(jsonb_build_object('model', o.model_id, 'policy', o.policy,
                                                          'region', o.region, 'want', 0, 'need', 0, 'in_use', '{}'::jsonb,
                                                          'reported', false)), '[]')
    into v_lanes
  from (select l.model_id, l.policy, l.region from private.slot_leases l where l.gateway_id = p_gateway
        union
        select d.model_id, d.policy, d.region from private.lane_demand d where d.gateway_id = p_gateway) o
  where not exists (select from jsonb_array_elements(v_lanes) x
                    where x ->> 'model' = o.model_id and x ->> 'policy' = o.policy and x ->> 'region' = o.region);

  -- One renewal of a lane at a time, whichever gateway's: locks taken in one order, so no two
  -- renewals wait on each other in a circle.
  for v_lock in
    select distinct hashtextextended(x ->> 'model' || E'\n' || (x ->> 'policy') || E'\n' || (x ->> 'region'), 4242)
    from jsonb_array_elements(v_lanes) x
    order by 1
  loop
    perform pg_advisory_xact_lock(v_lock);
  end loop;
  perform from private.slot_leases l where l.gateway_id = p_gateway
  order by l.node_id, l.model_id, l.policy, l.region for no key update;

  -- What is in use on each of its leases, as SQL counts it: the slots the gateway says in use, less
  -- those it adopted (slots a renewal moved in for its jobs SQL placed), plus every running job a
  -- renewal moved into the lease that it does not say ended ("ended": their ends on their way),
  -- known to it or not: a renewal's answer lost, or a placement's still on its way when a renewal
  -- moved the job (else the slot is idle to it, and it sends another request to the node while the
  -- job runs). Never less than it says: what it reports in use it may use until this answer comes.
  -- Those jobs are named among the absorbed at every renewal, so a lost answer's are heard next.
  for r in
    select x.n, a.node_id, count(*)::integer as moved, array_agg(a.job_id) as jobs
    from (select m.job_id, m.node_id from public.job_attempts m where m.status = 'running' and m.moved) a
    join public.jobs j on j.id = a.job_id
    join jsonb_array_elements(v_lanes) with ordinality as x (lane, n)
      on j.model_id = x.lane ->> 'model' and j.policy = x.lane ->> 'policy' and coalesce(j.region, '') = x.lane ->> 'region'
    where j.gateway_id = p_gateway and j.status = 'running'
      and a.job_id <> all (array(select jsonb_array_elements_text(coalesce(x.lane -> 'ended', '[]'))::uuid))
    group by x.n, a.node_id
  loop
    v_said := coalesce((v_lanes #>> array[(r.n - 1)::text, 'in_use', r.node_id::text])::integer, 0);
    v_known := coalesce((v_lanes #>> array[(r.n - 1)::text, 'adopted', r.node_id::text])::integer, 0);
    v_lanes := jsonb_set(v_lanes, array[(r.n - 1)::text, 'in_use', r.node_id::text],
                         to_jsonb(greatest(v_said, v_said - v_known + r.moved)));
    v_absorbed := v_absorbed || r.jobs;
  end loop;

  -- What it wants and needs of each lane, for the shares, before any lane is renewed: a lane sees
  -- what the gateway's other lanes need now (a lane it no longer reports wants nothing).
  insert into private.lane_demand as d (gateway_id, model_id, policy, region, wanted, needed, renewed_at)
  select p_gateway, x ->> 'model', x ->> 'policy', x ->> 'region', (x ->> 'want')::integer, (x ->> 'need')::integer, now()
  from jsonb_array_elements(v_lanes) x
  where (x ->> 'reported')::boolean
  on conflict on constraint lane_demand_pkey
  do update set wanted = excluded.wanted, needed = excluded.needed, renewed_at = excluded.renewed_at;
  delete from private.lane_demand d
  where d.gateway_id = p_gateway
    and exists (select from jsonb_array_elements(v_lanes) x
                where not (x ->> 'reported')::boolean and x ->> 'model' = d.model_id and x ->> 'policy' = d.policy
                  and x ->> 'region' = d.region);

  -- What is in use on every lease of it, before any lane is renewed: a lane's spares are judged by
  -- what the gateway's other lanes use now, not at its last renewal.
  update private.slot_leases l
  set in_use = least(coalesce((x -> 'in_use' ->> l.node_id::text)::integer, 0), l.slots)
  from jsonb_array_elements(v_lanes) x
  where l.gateway_id = p_gateway and l.model_id = x ->> 'model' and l.policy = x ->> 'policy'
    and l.region = x ->> 'region'
    and l.in_use is distinct from least(coalesce((x -> 'in_use' ->> l.node_id::text)::integer, 0), l.slots);

  -- The lanes that need least first: what one gives back, a lane renewed after it may claim in the
  -- same call (one renewed before it claims at the next).
  for r in
    select x ->> 'model' as model, x ->> 'policy' as policy, x ->> 'region' as region,
           (x ->> 'want')::integer as want, (x ->> 'need')::integer as need, x -> 'in_use' as in_use,
           (x ->> 'reported')::boolean as reported
    from jsonb_array_elements(v_lanes) x
    order by 5, 1, 2, 3
  loop
    v_absorbed := v_absorbed
                  || private.renew_lane(p_gateway, r.model, r.policy, r.region, r.want, r.need, r.in_use, r.reported,
                                        v_expires_at);
  end loop;

  -- Every lease it may dispatch on, ranked per lane: by the node's score now, or for a node the
  -- ranking leaves out (full, because leased), by its score when last ranked. After them, with no
  -- slot, the lane's best ranked nodes it holds none on: where a job moves (failover_job()) when its
  -- leased node fails and the gateway holds no other slot for it.
  return query
  with held as (
    select l.model_id, l.policy, l.region, l.node_id, n.endpoint_url, n.secret_hash, l.slots - l.draining as slots,
           l.in_use, l.score, n.ewma_tokens_per_s, n.routes, l.expires_at, n.hourly_rate,
           array(select j.id from public.jobs j
                 join public.job_attempts a on a.job_id = j.id and a.status = 'running'
                 where j.id = any (v_absorbed) and a.node_id = l.node_id and j.model_id = l.model_id
                   and j.policy = l.policy and coalesce(j.region, '') = l.region) as absorbed,
           l.draining
    from private.slot_leases l
    join public.nodes n on n.id = l.node_id
    where l.gateway_id = p_gateway and l.slots > 0
      and (l.model_id, l.node_id) in (
        select m.model_id, u.id
        from (select distinct o.model_id from private.slot_leases o where o.gateway_id = p_gateway) m
        cross join lateral private.lease_usable_nodes(m.model_id, array(
          select o.node_id from private.slot_leases o where o.gateway_id = p_gateway and o.model_id = m.model_id)) u (id))
  ),
  fallbacks as (
    select x ->> 'model' as model_id, x ->> 'policy' as policy, x ->> 'region' as region, s.node_id,
           n.endpoint_url, n.secret_hash, 0 as slots, 0 as in_use, null::float8 as score,
           n.ewma_tokens_per_s, n.routes, v_expires_at as expires_at, n.hourly_rate, null::uuid[] as absorbed, 0 as draining, s.rank
    -- The lanes reported that can still be ranked (its model's last node may just have gone), but
    -- those that need nothing and hold nothing: no job of theirs runs on a leased slot to move.
    from (select l.x from jsonb_array_elements(v_lanes) l (x)
          where (l.x ->> 'reported')::boolean and private.lane_can_rank(l.x ->> 'model', l.x ->> 'policy')
            and ((l.x ->> 'need')::integer > 0
                 or exists (select from private.slot_leases o
                            where o.gateway_id = p_gateway and o.model_id = l.x ->> 'model'
                              and o.policy = l.x ->> 'policy' and o.region = l.x ->> 'region' and o.slots > 0))) ranked
    cross join lateral public.score_nodes(ranked.x ->> 'model', null, ranked.x ->> 'policy',
                                          nullif(ranked.x ->> 'region', ''), null, null, null, false,
                                          private.ranking_limit(0), null) s
    join public.nodes n on n.id = s.node_id
    where not exists (select from held h where h.model_id = x ->> 'model' and h.policy = x ->> 'policy'
                                            and h.region = x ->> 'region' and h.node_id = s.node_id)
  )
  select u.model_id, u.policy, u.region, u.node_id, u.endpoint_url, u.secret_hash, u.slots, u.in_use,
         (row_number() over (partition by u.model_id, u.policy, u.region
                             order by u.fallback, u.score desc nulls last, u.rank, u.node_id))::integer,
         u.ewma_tokens_per_s, u.routes, u.expires_at, u.hourly_rate, u.absorbed, u.draining,
         (select d.share from private.lane_demand d
          where d.gateway_id = p_gateway and d.model_id = u.model_id and d.policy = u.policy and d.region = u.region)
  from (select h.*, false as fallback, null::bigint as rank from held h
        union all
        select f.model_id, f.policy, f.region, f.node_id, f.endpoint_url, f.secret_hash, f.slots, f.in_use,
               f.score, f.ewma_tokens_per_s, f.routes, f.expires_at, f.hourly_rate, f.absorbed, f.draining, true,
               f.rank
        from fallbacks f) u
  order by u.model_id, u.policy, u.region, 9;
end;
$$;

COMMENT ON FUNCTION public.renew_leases(p_gateway uuid, p_lanes jsonb) IS 'A gateway''s renewal of its slot leases, once a second, which also checks it in. One at a time with the gateway''s record_jobs() (an advisory lock per gateway). p_lanes: a JSON array of lanes, [{"model": m, "policy": p (default balanced), "region": r (null or absent: none), "want": slots wanted, "need": of them, slots needed (absent: all), "in_use": {node id: slots in use}, "adopted": {node id: of those, slots a renewal moved in for its jobs SQL placed} (absent: none), "ended": ids of its jobs SQL placed that ended there, their ends on their way (absent: none)}]. For each lane it records the demand, sets what is in use (what it says, less what it adopted, plus every running job of its a renewal moved into the lease that it does not say ended; never less than it says), moves the slots of its running jobs of the lane SQL placed, on their first attempt, into its leases (private.renew_lane()), gives back idle slots above the gateway''s fair share (private.lane_target()) from the lowest ranked node and claims free ones toward it from the best ranked (score_nodes()), as claims do (nodes.inflight, never past max_concurrency), those above the need (spares) one a node, only where the node keeps a slot free and the gateway holds no idle slot there already; a lane it leased in and no longer names is given back whole but for slots in use, and so is a lane of a model that does not exist (in no catalog row, held by no node) or of a policy that does not, which gets nothing (its slots in use stay until their jobs end). Returns every lease it may dispatch on (node online or busy, not cooling down, beating, holding the model) with the slots it may use (those held less those draining above its share; draining: how many drain), with where and how to reach the node and its hourly rate (a request''s price cap filters the leases, in their order), its rank in the lane (1: best), the lease''s end (now + platform_settings.lease_s) the ids of the gateway''s running jobs SQL had placed whose slots this renewal moved into the lease (absorbed: the gateway counts them in use there until they end; with them, at every renewal, those an earlier renewal moved that still run and that it does not say ended, so that an answer lost is heard at the next) and the gateway''s share of the lane''s slots (share: holding it, the gateway places none of the lane''s requests in SQL); then, with 0 slots and ranked after them, the lane''s best ranked nodes (score_nodes()) it holds no lease on: a failed leased job''s fallbacks. Bad input raises invalid_parameter_value and changes nothing.';

DROP FUNCTION private.moved_into_lease(p_jobs uuid[], p_node uuid);

CREATE FUNCTION private.moved_into_lease(p_gateway uuid, p_model text, p_policy text, p_region text, p_node uuid, p_ended uuid[]) RETURNS integer
    LANGUAGE sql STABLE
    SET search_path TO ''
    AS $$
  select count(*)::integer
  from public.job_attempts a
  join public.jobs j on j.id = a.job_id
  where a.node_id = p_node and a.status = 'running' and a.moved and a.job_id <> all (p_ended)
    and j.gateway_id = p_gateway and j.model_id = p_model and j.policy = p_policy and coalesce(j.region, '') = p_region
$$;

COMMENT ON FUNCTION private.moved_into_lease(p_gateway uuid, p_model text, p_policy text, p_region text, p_node uuid, p_ended uuid[]) IS 'private.return_lent_slot(): how many running jobs of gateway p_gateway a renewal moved into its lease of the lane (p_model, p_policy, p_region) on node p_node, but for those it says ended (p_ended: their ends on their way).';

REVOKE ALL ON FUNCTION private.moved_into_lease(p_gateway uuid, p_model text, p_policy text, p_region text, p_node uuid, p_ended uuid[]) FROM PUBLIC;
GRANT ALL ON FUNCTION private.moved_into_lease(p_gateway uuid, p_model text, p_policy text, p_region text, p_node uuid, p_ended uuid[]) TO service_role;

CREATE OR REPLACE FUNCTION private.return_lent_slot(p_gateway uuid, p_model text, p_policy text, p_min_vram_gb real, p_max_hourly_rate numeric, p_route text, p_offered jsonb) RETURNS uuid
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_lease record;
begin
  -- The best offered lease that could serve the request and holds more slots than the gateway's
  -- jobs hold on it: those it has in use ("busy": a renewal under way may have given idle slots back
  -- meanwhile), and those of its jobs SQL placed that a renewal moved into it and that it does not
  -- say have ended ("ended"), known to it or not (private.moved_into_lease()).
  select l.node_id, l.model_id, l.policy, l.region, o.busy, o.ended into v_lease
  from (
    select x.node, x.model, coalesce(x.policy, 'balanced') as policy, coalesce(x.region, '') as region,
           coalesce(x.busy, 0) as busy,
           array(select jsonb_array_elements_text(coalesce(x.ended, '[]'))::uuid) as ended
    from jsonb_to_recordset(p_offered) as x (node uuid, model text, policy text, region text, busy integer,
                                             ended jsonb)
  ) o
  join private.slot_leases l
    on l.gateway_id = p_gateway and l.node_id = o.node and l.model_id = o.model and l.policy = o.policy
       and l.region = o.region
  join public.nodes n on n.id = l.node_id
  left join public.node_scores s on s.node_id = n.id and s.model_id = p_model and s.policy = p_policy
  where l.slots > o.busy + private.moved_into_lease(p_gateway, l.model_id, l.policy, l.region, l.node_id, o.ended)
    and l.expires_at > now()
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
    and l.policy = v_lease.policy and l.region = v_lease.region and l.expires_at > now()
    and l.slots > v_lease.busy + private.moved_into_lease(p_gateway, l.model_id, l.policy, l.region, l.node_id, v_lease.ended);
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

COMMENT ON FUNCTION private.return_lent_slot(p_gateway uuid, p_model text, p_policy text, p_min_vram_gb real, p_max_hourly_rate numeric, p_route text, p_offered jsonb) IS 'place_jobs(), when every capable node is full: of the slots gateway p_gateway lends from its leases (p_offered, a JSON array of {"node", "model", "policy", "region", "busy", "ended"}: one idle slot of that lease, which the gateway keeps out of use until it has the answer; how many of the lease''s slots it has in use, not counting those a renewal moved in; and its jobs SQL placed that ended there, their ends not yet written; SQL counts in use besides every job a renewal moved into the lease that is not among them (private.moved_into_lease()); a lease holding no more than that lends nothing), the best one that could serve the request (its node usable for p_model as leases are, with the VRAM, under the price cap, serving p_route; ranked by the model''s base score under p_policy) goes back from its lease to its node, free for the request to claim. Returns its node, or null when none could serve it.';
