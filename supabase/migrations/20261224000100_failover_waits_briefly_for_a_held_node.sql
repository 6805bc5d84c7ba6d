-- A failover waits a moment, once, for a free candidate another transaction holds.
--
-- move_job() (failover_job(), handoff_job()) claimed the next node skipping the rows other
-- transactions held: none waited, because this transaction holds the running node's row and two
-- moves waiting for each other's nodes would deadlock. But a heartbeat or a lease renewal holds a
-- free node's row until it commits (milliseconds, more for a large batch), and where that node was
-- the only other candidate the job failed with a free node online (a clean clone's CI run: two nodes
-- failing a request the same way made a 502, not the client's 400, the second never tried).
-- Now, when every free candidate is held, the move waits for the first of them once, up to 250 ms
-- (lock_timeout around that lock alone), then claims as before. A cycle of waits through the
-- running node's row (another move, a completion, move_to_lease(), which lock nodes and wait) ends
-- when the move's wait does, well under deadlock_timeout: the node is passed over, no error.

CREATE OR REPLACE FUNCTION private.move_job(p_job_id uuid, p_error text, p_http_status integer, p_candidates uuid[], p_fail_if_none boolean) RETURNS TABLE(node_id uuid, endpoint_url text, node_key bytea, attempt integer)
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $$
declare
  v_running public.job_attempts;
  v_tried uuid[];
  v_next integer;
  v_node public.nodes;
  v_held uuid;
  v_lock_timeout text := current_setting('lock_timeout');
begin
  -- The running attempt, then its node, then the next node: the order failover_job() has always
  -- taken these locks in.
  select * into v_running from public.job_attempts a
  where a.job_id = p_job_id and a.status = 'running'
  for no key update;
  if not found then
    raise exception 'job % has no running attempt', p_job_id using errcode = 'object_not_in_prerequisite_state';
  end if;
  perform from public.nodes n where n.id = v_running.node_id for no key update;
  select array_agg(a.node_id), max(a.attempt) + 1 into v_tried, v_next
  from public.job_attempts a where a.job_id = p_job_id;

  select * into v_node from private.claim_node(p_candidates, v_tried, false);
  if v_node.id is null then
    -- Every free candidate is held by another transaction (a heartbeat, a renewal), or none is free:
    -- the first free one is waited for once, briefly, since this transaction holds the running
    -- node's row (above). Held past the wait, it is passed over.
    select c.id into v_held
    from unnest(p_candidates) with ordinality as r (id, ord)
    join public.nodes c on c.id = r.id
    where c.status = 'online' and c.inflight < c.max_concurrency
      and (c.cooldown_until is null or c.cooldown_until <= now()) and c.id <> all (v_tried)
    order by r.ord limit 1;
    if v_held is not null then
      perform set_config('lock_timeout', '250ms', true);
      begin
        perform from public.nodes n where n.id = v_held for update;
      exception when lock_not_available then
        null;
      end;
      perform set_config('lock_timeout', v_lock_timeout, true);
      select * into v_node from private.claim_node(p_candidates, v_tried, false);
    end if;
  end if;
  if v_node.id is null and not p_fail_if_none then
    return;  -- nowhere to go, and told to change nothing
  end if;
  -- 421: no gateway could reach the node's tunnel. The platform's failure, not the node's: the
  -- attempt ends cancelled (slot freed, reputation and cooldown untouched).
  perform private.end_attempt(p_job_id, case when p_http_status = 421 then 'cancelled' else 'failed' end,
                              p_error, p_http_status);
  if v_node.id is null then
    update public.jobs j set status = 'failed', error = p_error, finished_at = now() where j.id = p_job_id;
    perform private.release_reservation(p_job_id, 0);
    return;
  end if;
  insert into public.job_attempts (job_id, attempt, node_id) values (p_job_id, v_next, v_node.id);
  update public.jobs j set node_id = v_node.id, attempts = v_next where j.id = p_job_id;
  return query select v_node.id, v_node.endpoint_url, v_node.secret_hash, v_next;
end;
$$;

COMMENT ON FUNCTION private.move_job(p_job_id uuid, p_error text, p_http_status integer, p_candidates uuid[], p_fail_if_none boolean) IS 'Moves a running job to the first free candidate not yet tried (when another transaction holds every free one, waiting once, up to 250 ms, for the first): its running attempt fails (its node cools down) and a new attempt starts there; with p_http_status 421 (no gateway could reach the node''s tunnel) the attempt ends cancelled instead, neutral for the node. When no candidate is free: with p_fail_if_none, the attempt ends and the job fails with the hold released; without, nothing changes. No row means the job did not move.';
