-- A gateway that the sweep judged silent while it still held its tunnels gets their routes back.
--
-- Found by a fault-injection review: after a Postgres outage longer than gateway_timeout_s (15 s), or
-- with the gateway paused while another gateway's sweeper (or pg_cron) ran, the sweep forgot the
-- tunnels the gateway held and set their nodes offline. The sockets stayed open and the agents
-- went on beating, so nothing dialled again: the nodes stayed offline until their agents were
-- restarted. A gateway that checks in late now hands in the tunnels it holds, and each one that no
-- route names any more is recorded as its again (one that an agent has since dialled elsewhere
-- keeps its newer route).

create function public.restore_tunnels(p_gateway_id uuid, p_node_ids uuid[], p_socket_ids uuid[])
returns table (node_id uuid)
language plpgsql
set search_path = ''
as $$
declare
  v_node uuid;
begin
  insert into private.gateways (id) values (p_gateway_id) on conflict (id) do nothing;
  for v_node in
    insert into private.tunnel_routes as r (node_id, gateway_id, socket_id)
    select t.node_id, p_gateway_id, t.socket_id
    from unnest(p_node_ids, p_socket_ids) as t (node_id, socket_id)
    -- Not one deleted meanwhile, nor one its owner has since given another endpoint.
    where exists (select 1 from public.nodes n where n.id = t.node_id and n.endpoint_url like 'tunnel:%')
    on conflict on constraint tunnel_routes_pkey do nothing
    returning r.node_id
  loop
    perform public.set_tunnel(v_node, true);
    return query select v_node;
  end loop;
end;
$$;
comment on function public.restore_tunnels(uuid, uuid[], uuid[]) is 'A gateway holding the tunnels of p_node_ids (on sockets p_socket_ids) after checking in late: those no route names any more (the sweep forgot them) are recorded as its again, and their nodes online if their servers are up (set_tunnel()). Returns the nodes restored.';
revoke execute on function public.restore_tunnels(uuid, uuid[], uuid[]) from public, anon, authenticated;
grant execute on function public.restore_tunnels(uuid, uuid[], uuid[]) to service_role;
