-- The functions the gateway calls for node agents and for itself: registering and beating nodes,
-- tunnels, gateway liveness and the sweeps. They are service_role's alone: anon and signed-in users
-- are refused each of them (an owner manages their nodes through the nodes table instead). A node
-- proves itself with its secret: the service's heartbeat refuses a wrong one.
begin;
create extension if not exists pgtap with schema extensions;
select plan(63);

select tests.create_user('alice');

create temporary table registered (node_id uuid, node_secret text);
grant all on registered to anon, authenticated, service_role;

-- Refused to anon and to signed-in users ---------------------------------------------------------------
create temporary table gateway_calls (description text, call text, fn text);
grant select on gateway_calls to anon, authenticated;
insert into gateway_calls values
  ('register a node', $$select * from public.register_node(gen_random_uuid(), 'n', 'RTX 4090', 1, 24, 82.6, 0.4, 'eu-west', null, null, 'https://n.example.com', 4, '{}', null, null, '{}')$$, 'register_node'),
  ('register a node (the older overload)', $$select * from public.register_node(gen_random_uuid(), 'n', 'RTX 4090', 1, 24, 82.6, 0.4, 'eu-west', null, null, 'https://n.example.com', 4, '{}')$$, 'register_node'),
  ('send an agent''s heartbeat', $$select * from public.agent_heartbeat(gen_random_uuid(), sha256(''), 'online', 0, 0, 0, '{}', null, true, '{}', null, null, null)$$, 'agent_heartbeat'),
  ('send an agent''s heartbeat (without pre-warm)', $$select public.agent_heartbeat(gen_random_uuid(), sha256(''), 'online', 0, 0, 0, '{}', null, true, '{}')$$, 'agent_heartbeat'),
  ('send an agent''s heartbeat (the first overload)', $$select public.agent_heartbeat(gen_random_uuid(), sha256(''), 'online', 0, 0, 0, '{}')$$, 'agent_heartbeat'),
  ('beat for a node', $$select public.node_heartbeat(gen_random_uuid())$$, 'node_heartbeat'),
  ('send a gateway''s batch of heartbeats', $$select * from public.node_heartbeats('[]')$$, 'node_heartbeats'),
  ('mark a tunnel up', $$select public.set_tunnel(gen_random_uuid(), true)$$, 'set_tunnel'),
  ('attach a tunnel', $$select public.attach_tunnel(gen_random_uuid(), gen_random_uuid(), gen_random_uuid())$$, 'attach_tunnel'),
  ('detach a tunnel', $$select public.detach_tunnel(gen_random_uuid(), gen_random_uuid())$$, 'detach_tunnel'),
  ('restore a gateway''s tunnels', $$select * from public.restore_tunnels(gen_random_uuid(), '{}', '{}')$$, 'restore_tunnels'),
  ('look up a tunnel''s route', $$select * from public.tunnel_route(gen_random_uuid())$$, 'tunnel_route'),
  ('announce a gateway', $$select public.gateway_alive(gen_random_uuid())$$, 'gateway_alive'),
  ('announce a gateway with its address', $$select public.gateway_alive(gen_random_uuid(), 'http://10.0.0.1:8080')$$, 'gateway_alive'),
  ('announce a gateway with its waiting lines', $$select public.gateway_alive(gen_random_uuid(), null, '{}')$$, 'gateway_alive'),
  ('sweep', $$select * from public.sweep()$$, 'sweep'),
  ('sweep stale nodes', $$select * from public.sweep_stale_nodes()$$, 'sweep_stale_nodes'),
  ('sweep stale jobs', $$select * from public.sweep_stale_jobs()$$, 'sweep_stale_jobs'),
  ('schedule the sweep', $$select public.schedule_sweep()$$, 'schedule_sweep'),
  ('renew a gateway''s slot leases', $$select * from public.renew_leases(gen_random_uuid(), '[]')$$, 'renew_leases'),
  ('renew a gateway''s escrows', $$select * from public.renew_escrows(gen_random_uuid(), '[]')$$, 'renew_escrows'),
  ('write a gateway''s leased jobs', $$select * from public.record_jobs(gen_random_uuid(), '[]')$$, 'record_jobs'),
  ('move a leased job to another leased slot', $$select * from public.move_to_lease(gen_random_uuid(), 'e', null, gen_random_uuid())$$, 'move_to_lease');

select tests.as_anon();
select throws_ok(call, '42501', 'permission denied for function ' || fn, 'anon cannot ' || description)
from gateway_calls order by description;

select tests.as_user('alice');
select throws_ok(call, '42501', 'permission denied for function ' || fn,
                 'a signed-in user cannot ' || description || ', even for their own node')
from gateway_calls order by description;

-- service_role ---------------------------------------------------------------------------------------------
select tests.as_service_role();
select lives_ok($$
  insert into registered
  select * from public.register_node(tests.user_id('alice'), 'alice-4090', 'RTX 4090', 1, 24, 82.6, 0.40, 'eu-west',
                                     48.85, 2.35, 'http://8.8.8.8:8000', 4, array['meta-llama/Llama-3.1-8B-Instruct'],
                                     '1.0', null, '{"kind": "vllm"}')
$$, 'service_role registers a node for its owner');
select results_eq($$ select n.owner_id, n.status, n.secret_hash = sha256(convert_to(r.node_secret, 'UTF8'))
                     from registered r join public.nodes n on n.id = r.node_id $$,
  $$ values (tests.user_id('alice'), 'online', true) $$,
  'the node is its owner''s and online, and only the hash of its secret is kept');
select throws_ok($$ select * from registered r
                    cross join lateral public.agent_heartbeat(r.node_id, sha256('not the secret'), 'online', 0, 0.1, 20,
                                                              array['meta-llama/Llama-3.1-8B-Instruct'], null, true, '{}',
                                                              null, null, null) $$,
  '42501', null, 'a heartbeat with the wrong secret is refused');
select results_eq($$ select h.status from registered r
                     cross join lateral public.agent_heartbeat(r.node_id, sha256(convert_to(r.node_secret, 'UTF8')), 'online',
                                                               0, 0.1, 20, array['meta-llama/Llama-3.1-8B-Instruct'],
                                                               null, true, '{}', null, null, null) h $$,
  array['online'], 'a heartbeat with the node''s secret brings it online');
select results_eq($$ select public.node_heartbeat(node_id) from registered $$, array['online'],
  'service_role beats for a node (the gateway''s own check)');
select results_eq($$ select h.status, h.error_code from registered r
                     cross join lateral public.node_heartbeats(jsonb_build_array(jsonb_build_object(
                       'node_id', r.node_id, 'key', encode(sha256('not the secret'), 'hex'), 'status', 'online',
                       'queue_depth', 0, 'models', array['meta-llama/Llama-3.1-8B-Instruct']))) h $$,
  $$ values (null::text, '42501'::text) $$, 'a batched heartbeat with the wrong secret is refused, by itself');
select results_eq($$ select h.status, h.error_code from registered r
                     cross join lateral public.node_heartbeats(jsonb_build_array(jsonb_build_object(
                       'node_id', r.node_id, 'key', encode(sha256(convert_to(r.node_secret, 'UTF8')), 'hex'),
                       'status', 'online', 'queue_depth', 0, 'gpu_utilization', 0.1, 'free_vram_gb', 20,
                       'models', array['meta-llama/Llama-3.1-8B-Instruct']))) h $$,
  $$ values ('online'::text, null::text) $$, 'a batched heartbeat with the node''s secret is taken');
select lives_ok($$ select public.gateway_alive(gen_random_uuid(), 'http://10.0.0.1:8080') $$,
  'service_role announces a gateway');
select lives_ok($$ select public.gateway_alive(gen_random_uuid(), null, '{"meta-llama/Llama-3.1-8B-Instruct": 3}') $$,
  'service_role announces a gateway with the requests waiting in its lines');
-- sweep() refreshes private.vram_pressure (writable by service_role since 20261129000400).
select lives_ok($$ select * from public.sweep() $$, 'service_role sweeps');
select lives_ok($$ select * from public.sweep_stale_jobs() $$, 'service_role sweeps stale jobs');
select ok(has_function_privilege('service_role', 'public.schedule_sweep()', 'EXECUTE'),
  'service_role may schedule the sweep');

select tests.as_user('alice');
select results_eq($$ select name, status from public.nodes where owner_id = auth.uid() $$,
  $$ values ('alice-4090', 'online') $$, 'the owner sees the node the service registered as theirs, online');
select results_eq($$ select name, status from public.my_node_stats('1 day') $$,
  $$ values ('alice-4090', 'online') $$, 'and in their node stats');
select results_eq($$ select count(*)::int from public.node_liveness l join registered r on r.node_id = l.node_id $$,
  array[1], 'a signed-in user reads when nodes last beat through a gateway''s batch');
select throws_ok($$ update public.node_liveness set last_heartbeat_at = now() $$,
  '42501', 'permission denied for table node_liveness', 'but cannot keep their own node alive by hand');
select tests.as_anon();
select throws_ok($$ insert into public.node_liveness select node_id, now() from registered $$,
  '42501', 'permission denied for table node_liveness', 'anon cannot write a node''s last heartbeat');

select * from finish();
rollback;
