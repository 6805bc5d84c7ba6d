-- A stream's release on a node that keeps up with its claim rescores by arithmetic too.
--
-- A stream's release measures the node's speed (speed_ratio: measured over expected for its claimed
-- GPU), and any change of it sent the trigger the long way (20261203001100), computing the node's
-- components again from node_base_scores. But compute and price take the speed only up to the
-- claim (least(1, speed_ratio)), and the reputation's speed factor is computed by the arithmetic
-- path itself. So when the capped speed is the same before and after (a node at or above its claim,
-- as it was), other_base has not moved, and the release takes the arithmetic path. A node below its
-- claim, or one crossing it, still goes the long way.

create or replace function private.node_scores_after_node_update()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  -- The speed enters compute and price only up to the node's claim: least(1, speed_ratio).
  if (old.region, old.vram_gb, old.tflops, old.hourly_rate, old.max_concurrency,
      least(1.0, coalesce(old.speed_ratio, 1.0)))
     is not distinct from (new.region, new.vram_gb, new.tflops, new.hourly_rate, new.max_concurrency,
                           least(1.0, coalesce(new.speed_ratio, 1.0))) then
    if (old.inflight, old.outside_load, old.successes, old.failures)
       is not distinct from (new.inflight, new.outside_load, new.successes, new.failures) then
      return null;  -- nothing scored changed (a heartbeat)
    end if;
    -- Only the load or the counts moved (a claim, a release, outside load), and any new speed is
    -- at or above the claim as the old one was: the reputation and capacity terms, as
    -- node_components has them.
    update public.node_scores s
    set fixed_base = s.other_base + s.reputation_share * t.reputation,
        base_score = (s.other_base + s.reputation_share * t.reputation) + s.capacity_share * t.capacity
    from (
      select (new.successes + 1)::float8 / (new.successes + new.failures + 2)
               * least(1.0, coalesce(new.speed_ratio, 1.0) / 0.25) as reputation,
             greatest(0.0::float8, 1.0::float8 - (new.inflight + new.outside_load)::float8 / new.max_concurrency)
               as capacity
    ) t
    where s.node_id = new.id;
    return null;
  end if;
  -- One cached plan updating this node's rows in place; a new VRAM size moves its tier too.
  update public.node_scores s
  set base_score = v.base_score, region = v.region, tier_gb = v.tier_gb, fixed_base = v.fixed_base,
      capacity_share = v.capacity_share, other_base = v.other_base, reputation_share = v.reputation_share
  from public.node_base_scores v
  where v.node_id = new.id and s.node_id = new.id and s.policy = v.policy and s.model_id = v.model_id
    and (s.base_score, s.region, s.tier_gb, s.fixed_base, s.capacity_share, s.other_base, s.reputation_share)
        is distinct from (v.base_score, v.region, v.tier_gb, v.fixed_base, v.capacity_share, v.other_base,
                          v.reputation_share);
  return null;
end;
$$;
comment on function private.node_scores_after_node_update() is 'Trigger: rescores a node whose scored columns changed: by arithmetic when only its load, success counts or a speed at or above its claim moved (a claim, a release, outside load), from node_base_scores otherwise (a speed below the claim, new specs).';
