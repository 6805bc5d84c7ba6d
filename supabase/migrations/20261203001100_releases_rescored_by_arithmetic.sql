-- A release that changes only the success count rescores by arithmetic too.
--
-- Claims and changes of outside load rescore a node's node_scores rows by arithmetic (20261203000600);
-- a release still went the long way, computing the node's components again from node_base_scores
-- (a join of the node, its models, the catalog and the policies), because it counts a success or a
-- failure, which moves the reputation term. Since whole answers no longer measure speed
-- (20261203001000), a release of one changes only the counts and the load. The base is now split one
-- step further where it is computed: other_base (fit, compute, price, warm) and the reputation's
-- share of the weight, kept in node_scores, so such a release sets fixed_base = other_base +
-- reputation_share * reputation(new counts), and base_score from it as a claim does: one lookup by
-- the node's key. The view computes fixed_base the same way, so the two agree to the last bit. A
-- stream's release (a measured speed moves compute and price) and new specs go the long way.
--
-- Measured with `neuralgrid bench sql --compare` (this file against the migrations before it, six
-- alternating rounds of 700 whole answers): Postgres CPU per job 0.965x alone, 0.919x in groups of
-- 14 (ending them 0.75x; placing them 1.01x, as a claim now writes fixed_base too). The upper bound,
-- the long way skipped outright, was 0.964x and 0.894x.

alter table public.node_scores
  add column other_base double precision,
  add column reputation_share double precision;

create or replace view private.node_components with (security_invoker = true) as
select w.name as policy, nm.model_id, n.id as node_id, n.region, n.vram_gb::float8 as vram_gb,
       c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation,
       b.fixed_base + b.capacity_share * c.capacity as base,
       w.fit::float8 / s.weight as fit_weight,
       b.fixed_base, b.capacity_share, p.other_base, p.reputation_share
from public.nodes n
join public.node_models nm on nm.node_id = n.id
-- The VRAM a held model needs, as required_vram_gb(model) gives it: the catalog's, else 1.
left join public.models m on m.id = nm.model_id
cross join public.matching_policies w
cross join lateral (
  select w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity + w.reserve as weight
) s
-- The node's numbers as the formulas take them (float8), its load being the platform's requests
-- plus its outside load.
cross join lateral (
  select n.vram_gb::float8 as vram_gb, n.tflops::float8 as tflops, n.hourly_rate::float8 as hourly_rate,
         coalesce(n.speed_ratio, 1.0) as speed_ratio, n.inflight + n.outside_load as load
) i
cross join lateral (
  select
    least(1.0::float8, coalesce(m.min_vram_gb, 1)::float8 / i.vram_gb) as fit,
    -- Claimed TFLOPS, discounted to what was measured when a node delivers less than it claims.
    i.tflops * least(1.0, i.speed_ratio) / (i.tflops * least(1.0, i.speed_ratio) + w.compute_half_tflops) as compute,
    -- Price per unit of work (USD per TFLOP-hour), not per hour: a fast GPU can cost less per token.
    w.price_half_usd_per_tflop_hour
      / (w.price_half_usd_per_tflop_hour + i.hourly_rate / (i.tflops * least(1.0, i.speed_ratio))) as price,
    case when nm.state = 'loaded' then 1.0::float8 else 0.0::float8 end as warm,
    -- private.node_scores_after_node_update() computes this same expression from the new row.
    greatest(0.0::float8, 1.0::float8 - i.load::float8 / n.max_concurrency) as capacity,
    -- Laplace-smoothed success rate, scaled down for a node delivering under a quarter of the
    -- speed its claimed GPU should (nodes can lie about specs).
    (n.successes + 1)::float8 / (n.successes + n.failures + 2) * least(1.0, i.speed_ratio / 0.25) as reputation
) c
-- What a change of load or of the success count leaves alone (other_base), and the shares of the
-- two terms they move: fixed_base is other_base plus the reputation's share, so a release that
-- changes only the counts is rescored without this view, to the same bits.
cross join lateral (
  select (w.fit * c.fit + w.compute * c.compute + w.price * c.price + w.warm * c.warm) / s.weight as other_base,
         w.reputation::float8 / s.weight as reputation_share,
         w.capacity::float8 / s.weight as capacity_share
) p
cross join lateral (
  select p.other_base + p.reputation_share * c.reputation as fixed_base, p.capacity_share
) b;
comment on view private.node_components is 'The request-independent score components of each node for each model it holds under each weighted policy, each in [0,1], with fit for the catalog''s VRAM need; base is their weighted share of the score: fixed_base (all but capacity: other_base plus reputation_share times reputation) plus capacity_share times capacity, so that a change of load or of the success counts alone is rescored without this view. fit_weight is the fit''s share (a request''s own need changes only that term).';

create or replace view public.node_base_scores with (security_invoker = true) as
select c.policy, c.model_id, c.node_id, c.region, c.base as base_score, private.vram_tier(c.vram_gb) as tier_gb,
       c.fixed_base, c.capacity_share, c.other_base, c.reputation_share
from private.node_components c;

create or replace function private.refresh_node_scores(
  p_node_ids uuid[] default null, p_model_id text default null, p_policy text default null
) returns void
language plpgsql
set search_path = ''
as $$
begin
  -- Two statements, not one with `p_node_ids is null or ...`: each keeps a cheap cached plan.
  if p_node_ids is not null then
    insert into public.node_scores as s (policy, model_id, node_id, region, base_score, tier_gb, fixed_base,
                                         capacity_share, other_base, reputation_share)
    select v.policy, v.model_id, v.node_id, v.region, v.base_score, v.tier_gb, v.fixed_base, v.capacity_share,
           v.other_base, v.reputation_share
    from public.node_base_scores v
    where v.node_id = any (p_node_ids)
    on conflict (policy, model_id, node_id) do update
    set base_score = excluded.base_score, region = excluded.region, tier_gb = excluded.tier_gb,
        fixed_base = excluded.fixed_base, capacity_share = excluded.capacity_share,
        other_base = excluded.other_base, reputation_share = excluded.reputation_share
    where (s.base_score, s.region, s.tier_gb, s.fixed_base, s.capacity_share, s.other_base, s.reputation_share)
          is distinct from (excluded.base_score, excluded.region, excluded.tier_gb, excluded.fixed_base,
                            excluded.capacity_share, excluded.other_base, excluded.reputation_share);
  else
    insert into public.node_scores as s (policy, model_id, node_id, region, base_score, tier_gb, fixed_base,
                                         capacity_share, other_base, reputation_share)
    select v.policy, v.model_id, v.node_id, v.region, v.base_score, v.tier_gb, v.fixed_base, v.capacity_share,
           v.other_base, v.reputation_share
    from public.node_base_scores v
    where (p_model_id is null or v.model_id = p_model_id) and (p_policy is null or v.policy = p_policy)
    on conflict (policy, model_id, node_id) do update
    set base_score = excluded.base_score, region = excluded.region, tier_gb = excluded.tier_gb,
        fixed_base = excluded.fixed_base, capacity_share = excluded.capacity_share,
        other_base = excluded.other_base, reputation_share = excluded.reputation_share
    where (s.base_score, s.region, s.tier_gb, s.fixed_base, s.capacity_share, s.other_base, s.reputation_share)
          is distinct from (excluded.base_score, excluded.region, excluded.tier_gb, excluded.fixed_base,
                            excluded.capacity_share, excluded.other_base, excluded.reputation_share);
  end if;
end;
$$;

create or replace function private.node_scores_after_node_update()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  if (old.region, old.vram_gb, old.tflops, old.hourly_rate, old.max_concurrency, old.speed_ratio)
     is not distinct from (new.region, new.vram_gb, new.tflops, new.hourly_rate, new.max_concurrency,
                           new.speed_ratio) then
    if (old.inflight, old.outside_load, old.successes, old.failures)
       is not distinct from (new.inflight, new.outside_load, new.successes, new.failures) then
      return null;  -- nothing scored changed (a heartbeat)
    end if;
    -- Only the load or the counts moved (a claim, a whole answer's release, outside load): the
    -- reputation and capacity terms, as node_components has them.
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
comment on function private.node_scores_after_node_update() is 'Trigger: rescores a node whose scored columns changed: by arithmetic when only its load or success counts moved (a claim, a whole answer''s release, outside load), from node_base_scores otherwise (a stream''s release with a measured speed, new specs).';


select private.refresh_node_scores();
alter table public.node_scores
  alter column other_base set not null,
  alter column reputation_share set not null;
comment on column public.node_scores.other_base is 'The base score but its reputation and capacity terms (node_components.other_base).';
comment on column public.node_scores.reputation_share is 'The reputation term''s share of the policy''s weight: fixed_base = other_base + reputation_share * reputation.';
