-- Cross-checks (issue 39): where no reference can run (a model pinned to a Hugging Face revision,
-- or a GGUF the gateway's referee does not hold), a (node, model) due a challenge is checked against
-- other nodes serving the same pinned artifact. The gateway asks the node and a peer the same greedy
-- challenge; when they disagree, a second peer decides, and the odd one out fails
-- (neuralgrid/gateway/cross_check.py). The verdicts go through record_challenges(): the same
-- sequential test, states and consequences as a referee's.

-- Which (node, model)s are due, for both: those whose artifact is among p_held (the referee's), or
-- the others.
create function private.take_due_checks(p_held text[], p_held_only boolean, p_limit integer)
  returns table (node_id uuid, model_id text, sha256 text, state text)
  language plpgsql set search_path = '' as $$
begin
  if p_limit is null or p_limit < 1 or p_limit > 1000 then
    raise exception 'limit must be between 1 and 1000, not %', p_limit using errcode = 'invalid_parameter_value';
  end if;
  -- Taken (SKIP LOCKED: gateways pass each other) and given their next time at once: a gateway that
  -- dies before challenging loses one challenge, not the schedule. The wait is exponential around the
  -- state's mean (capped at three means), so a node cannot learn when the next will come.
  return query
  with due as (
    select c.node_id, c.model_id, a.sha256
    from public.model_checks c
    join public.model_artifacts a on a.model_id = c.model_id
    join public.nodes n on n.id = c.node_id
    where c.state <> 'failed' and c.next_challenge_at <= now()
      and coalesce(a.sha256 = any (p_held), false) = p_held_only
      and n.status in ('online', 'busy')
      and exists (select 1 from public.node_models nm where nm.node_id = c.node_id and nm.model_id = c.model_id)
    order by c.next_challenge_at
    limit p_limit
    for update of c skip locked
  )
  update public.model_checks c
  set next_challenge_at = now() + make_interval(secs => least(3.0, -ln(1.0 - random())) * case c.state
        when 'verified' then s.challenge_verified_s
        when 'suspect' then s.challenge_suspect_s
        else s.challenge_unverified_s end)
  from due d cross join public.platform_settings s
  where c.node_id = d.node_id and c.model_id = d.model_id
  returning c.node_id, c.model_id, d.sha256, c.state;
end;
$$;
comment on function private.take_due_checks(text[], boolean, integer) is 'Up to p_limit (node, model)s due a challenge, online or busy and holding the model, whose artifact is among p_held (p_held_only) or is not (a Hugging Face artifact never is); each is given its next, random time (exponential around platform_settings.challenge_<state>_s) as it is returned.';
revoke all on function private.take_due_checks(text[], boolean, integer) from public;
grant execute on function private.take_due_checks(text[], boolean, integer) to service_role;

create or replace function public.due_challenges(p_sha256 text[], p_limit integer default 8)
  returns table (node_id uuid, model_id text, sha256 text, state text)
  language sql set search_path = '' as $$
  select * from private.take_due_checks(p_sha256, true, p_limit);
$$;

create function public.due_cross_checks(p_held text[], p_limit integer default 8)
  returns table (node_id uuid, model_id text, state text, peers uuid[])
  language sql set search_path = '' as $$
  -- Its peers: up to two other nodes online with the model and not failed for it; the platform's
  -- own nodes (no owner) first, then verified ones, then any, at random within each.
  select d.node_id, d.model_id, d.state, array(
    select p.node_id
    from public.model_checks p
    join public.nodes pn on pn.id = p.node_id
    where p.model_id = d.model_id and p.node_id <> d.node_id and p.state <> 'failed'
      and pn.status in ('online', 'busy')
      and exists (select 1 from public.node_models nm where nm.node_id = p.node_id and nm.model_id = p.model_id)
    order by (pn.owner_id is null) desc, (p.state = 'verified') desc, random()
    limit 2)
  from private.take_due_checks(p_held, false, p_limit) d;
$$;
comment on function public.due_cross_checks(text[], integer) is 'Up to p_limit (node, model)s due a challenge whose pinned artifact no referee of the caller holds (p_held: the sha256s of the GGUFs its referee holds; a Hugging Face artifact never is), online or busy and holding the model, each with up to two peers to be checked against (other nodes online with the model, not failed for it: the platform''s own first, then verified ones); each is given its next, random time as due_challenges() gives it.';
revoke all on function public.due_cross_checks(text[], integer) from public, anon, authenticated;
grant execute on function public.due_cross_checks(text[], integer) to service_role;
