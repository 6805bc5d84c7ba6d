-- Fair shares of a scarce lane, over time (issue 42). A gateway's share of a lane is C x want / W
-- slots, rarely a whole number. Rounded by largest remainders, the same gateways got the left-over
-- slots at every renewal: in bench chaos, 16 slots among gateways of 4, 8, 12 and 18 callers went
-- 2, 3, 5, 6, and the smallest gateway was served 31% above its share, the largest 13% below.
-- Now the left-over slots rotate: over any ten seconds, each gateway holds its extra slot for the
-- fractional part of its share of the time (a share of 1.5 slots is 1 half the time and 2 the other
-- half), and at any one instant the targets still sum to at most C.

-- Where the rotation stands: a fraction in [0, 1) that sweeps once every 10 seconds, the same for
-- every renewal in the same instant, so that gateways renewing together agree.
create function private.lane_turn() returns numeric
  language sql stable set search_path = '' as $$
  select mod(extract(epoch from now()) / 10, 1)
$$;
comment on function private.lane_turn() is 'Where the rotation of a scarce lane''s left-over slots stands (private.lane_target()): a fraction in [0, 1) of a 10-second sweep, from the transaction''s time.';
revoke execute on function private.lane_turn() from public, anon, authenticated;
grant execute on function private.lane_turn() to service_role;

drop function private.lane_target(uuid, text, text, text, integer);

create function private.lane_target(
  p_gateway uuid, p_model text, p_policy text, p_region text, p_capacity integer,
  p_turn numeric default private.lane_turn()
) returns integer
  language sql stable set search_path = '' as $$
  -- Each live gateway that renewed the lane within lease_s gets the floor of its share C x want / W.
  -- The L slots that leaves (L = C - the floors, the sum of the fractional parts) rotate: lay the
  -- fractional parts end to end in gateway id order on [0, L); the points p_turn, p_turn + 1, ...,
  -- p_turn + L - 1 each fall in one part (none is as long as 1, so none holds two), and a gateway
  -- whose part holds one gets a slot more. As p_turn sweeps [0, 1) a part holds a point for its
  -- own length of the sweep, and at any turn exactly L parts hold one: the targets sum to C. A
  -- gateway never gets more than it wants (when W <= C every share is at least its want).
  with demand as (
    select d.gateway_id, d.wanted
    from private.lane_demand d
    join private.gateways g on g.id = d.gateway_id
    cross join public.platform_settings s
    where d.model_id = p_model and d.policy = p_policy and d.region = p_region and d.wanted > 0
      and d.renewed_at >= now() - make_interval(secs => s.lease_s) and private.gateway_is_live(g.seen_at)
  ),
  shares as (  -- share = base + part / W, in whole numbers: the parts add up to L x W exactly
    select d.gateway_id, d.wanted,
           (greatest(p_capacity, 0)::bigint * d.wanted) / sum(d.wanted) over () as base,
           (greatest(p_capacity, 0)::bigint * d.wanted) % sum(d.wanted) over () as part,
           sum(d.wanted) over () as total
    from demand d
  ),
  laid as (
    select s.gateway_id, s.wanted, s.base, s.part, s.total,
           sum(s.part) over (order by s.gateway_id) as ends_at
    from shares s
  )
  select coalesce((select least(l.wanted, l.base + ceil((l.ends_at - p_turn * l.total) / l.total)
                                               - ceil((l.ends_at - l.part - p_turn * l.total) / l.total))::integer
                   from laid l where l.gateway_id = p_gateway), 0)
$$;
comment on function private.lane_target(uuid, text, text, text, integer, numeric) is 'How many of a lane''s p_capacity slots gateway p_gateway may lease: its share in proportion to what each live gateway that renewed the lane within platform_settings.lease_s wants (private.lane_demand), never more than it wants. The floors of the shares first; the slots left rotate among the fractional parts as p_turn sweeps [0, 1) (private.lane_turn(), once every 10 seconds), each gateway holding its extra slot for its fractional part of the sweep, so that the shares never sum above p_capacity at any turn and are exact over a sweep.';
revoke execute on function private.lane_target(uuid, text, text, text, integer, numeric) from public, anon, authenticated;
grant execute on function private.lane_target(uuid, text, text, text, integer, numeric) to service_role;
