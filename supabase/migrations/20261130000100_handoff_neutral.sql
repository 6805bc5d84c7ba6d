-- A stream handed over after its first event says whose failure it was, as failover_job() does before
-- the first byte: with p_http_status 421 (the gateway holding the node's tunnel broke off mid-stream)
-- the dropped attempt ends cancelled, neutral for the node. A new overload: the old one stays for
-- gateways that do not pass a status, and means what it always meant (the node's failure).

create function public.handoff_job(
  p_job_id uuid, p_error text, p_http_status integer, p_candidates uuid[]
) returns table (node_id uuid, endpoint_url text, node_key bytea, attempt integer)
language plpgsql
set search_path = ''
as $$
begin
  return query select * from private.move_job(p_job_id, p_error, p_http_status, p_candidates, false);
end;
$$;
comment on function public.handoff_job(uuid, text, integer, uuid[]) is 'After the first byte: moves a running job to the next free candidate not yet tried. The running attempt fails and its node cools down, unless p_http_status is 421 (no gateway could reach the node''s tunnel any more: the platform''s failure), when it ends cancelled, neutral for the node. When no candidate is free, changes nothing and returns no row, so the job ends later with the tokens its client already received.';
revoke execute on function public.handoff_job(uuid, text, integer, uuid[]) from public, anon, authenticated;
grant execute on function public.handoff_job(uuid, text, integer, uuid[]) to service_role;
