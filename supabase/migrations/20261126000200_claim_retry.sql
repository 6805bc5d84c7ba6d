-- A claim that waited for a locked node and found it full looks again. Before, it answered "none
-- free" although another candidate might have been free all along, its row merely locked for a
-- moment (a heartbeat, a completion) when the claim first looked: the request then waited in the
-- gateway's line for a slot it could have had at once.

create or replace function private.claim_node(p_candidates uuid[], p_exclude uuid[] default '{}', p_wait boolean default true)
returns setof public.nodes
language plpgsql
set search_path = ''
as $$
declare
  v_id uuid;
begin
  -- Each pass either claims a node, or finds the node it waited for full (or gone): at most one
  -- pass per candidate, then the fleet really is full.
  for pass in 0 .. coalesce(cardinality(p_candidates), 0) loop
    -- Lock the first candidate (in the given order) that is online, has a free slot and is not
    -- cooling down. SKIP LOCKED lets concurrent claims pass each other; the lock re-checks the
    -- row, so inflight can never exceed max_concurrency.
    select c.id into v_id
    from unnest(p_candidates) with ordinality as r (id, ord)
    join public.nodes c on c.id = r.id
    where c.status = 'online' and c.inflight < c.max_concurrency
      and (c.cooldown_until is null or c.cooldown_until <= now()) and c.id <> all (p_exclude)
    order by r.ord limit 1
    for update of c skip locked;
    exit when v_id is not null or not p_wait;
    -- Every free candidate was locked by someone (a claim, a completion, a heartbeat): wait for
    -- the first one rather than report a small fleet full. One row only, so no lock is held on
    -- rows passed over (that would let two claims deadlock).
    select c.id into v_id
    from unnest(p_candidates) with ordinality as r (id, ord)
    join public.nodes c on c.id = r.id
    where c.status = 'online' and c.inflight < c.max_concurrency
      and (c.cooldown_until is null or c.cooldown_until <= now()) and c.id <> all (p_exclude)
    order by r.ord limit 1;
    exit when v_id is null;  -- none free, locked or not
    select c.id into v_id from public.nodes c
    where c.id = v_id and c.status = 'online' and c.inflight < c.max_concurrency
      and (c.cooldown_until is null or c.cooldown_until <= now())
    for update;
    exit when v_id is not null;
  end loop;
  if v_id is null then
    return;
  end if;
  return query
    update public.nodes n
    set inflight = n.inflight + 1,
        status = case when n.inflight + 1 >= n.max_concurrency then 'busy' else n.status end
    where n.id = v_id
    returning n.*;
end;
$$;
comment on function private.claim_node(uuid[], uuid[], boolean) is 'Claims one slot on the first available candidate node, in order; returns it, or nothing when none is free. With p_wait, waits for a free candidate another transaction holds locked, and looks again if it was filled meanwhile.';
