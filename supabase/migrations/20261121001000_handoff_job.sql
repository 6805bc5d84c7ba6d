-- Handing a stream that broke mid-way to another node. Before the first byte, failover_job() moves a
-- job to the next node and fails it when none is left. After the first byte the gateway resumes the
-- stream on another node instead; if none can take it, the job must stay as it was, so that its end
-- is recorded with the tokens the client already received (complete_jobs()), not as a failure that
-- used nothing.

create function public.handoff_job(p_job_id uuid, p_error text, p_candidates uuid[] default '{}')
returns table (node_id uuid, endpoint_url text, node_key bytea, attempt integer)
language plpgsql
set search_path = ''
as $$
declare
  v_next record;
begin
  begin
    select f.node_id, f.endpoint_url, f.node_key, f.attempt into v_next
    from public.failover_job(p_job_id, p_error, null, p_candidates) f;
    if v_next.node_id is null then
      -- Undo failover_job(): the running attempt, the node's reputation and the job are untouched.
      raise exception 'no node left' using errcode = 'NG404';
    end if;
  exception when sqlstate 'NG404' then
    return;
  end;
  return query select v_next.node_id, v_next.endpoint_url, v_next.node_key, v_next.attempt;
end;
$$;
comment on function public.handoff_job(uuid, text, uuid[]) is 'Moves a running job to the next free candidate not yet tried (failover_job(): the running attempt fails and its node cools down); when there is none, changes nothing and returns no row.';
revoke execute on function public.handoff_job(uuid, text, uuid[]) from public, anon, authenticated;
grant execute on function public.handoff_job(uuid, text, uuid[]) to service_role;
