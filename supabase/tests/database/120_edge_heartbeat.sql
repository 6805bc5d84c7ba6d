-- The heartbeat a node sends through Supabase alone (20261129000200_edge_heartbeat.sql):
-- agent_heartbeat_with_secret() is neuralgrid_node's (the role the Edge Function `heartbeat` acts as,
-- 20261201000400_edge_roles.sql; its Deno tests run it as that role) and the service's; the node's
-- secret is the whole proof, checked before anything is written. The Data API's roles are refused
-- it: anon (no Data API path) and signed-in users (a node carries no user's token).
begin;
create extension if not exists pgtap with schema extensions;
select plan(12);

select tests.create_user('alice');

create temporary table registered (node_id uuid, node_secret text);
grant select on registered to anon, authenticated;
grant all on registered to service_role;

select tests.as_service_role();
insert into registered
select * from public.register_node(tests.user_id('alice'), 'alice-edge', 'RTX 4090', 1, 24, 82.6, 0.40, 'eu-west',
                                   null, null, 'https://alice-edge.example.com', 4,
                                   array['meta-llama/Llama-3.1-8B-Instruct'], '1.0', null, '{}');
update public.nodes set status = 'offline' where id = (select node_id from registered);

-- What each role may call -------------------------------------------------------------------------------
select ok(has_function_privilege('neuralgrid_node', 'public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb)', 'execute')
          and not has_function_privilege('neuralgrid_node', 'public.agent_heartbeat(uuid, bytea, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb)', 'execute')
          and not has_table_privilege('neuralgrid_node', 'public.nodes', 'select, update'),
  'neuralgrid_node may send a heartbeat with a secret, and nothing else: not with a hash, no table');
select tests.as_anon();
select throws_ok($$ select * from registered r cross join lateral public.agent_heartbeat_with_secret(r.node_id, r.node_secret) h $$,
  '42501', 'permission denied for function agent_heartbeat_with_secret',
  'anon cannot call it, even with the node''s secret (no Data API path)');

-- The secret is the proof (as the service; the Edge Function's role runs the same body) ----------------
select tests.as_service_role();
select throws_ok($$ select * from registered r cross join lateral public.agent_heartbeat_with_secret(r.node_id, 'not the secret') h $$,
  '28000', null, 'a heartbeat with a wrong secret is refused');
select throws_ok($$ select * from registered r cross join lateral public.agent_heartbeat_with_secret(r.node_id, null) h $$,
  '28000', null, 'and one without a secret');
select throws_ok($$ select * from public.agent_heartbeat_with_secret(gen_random_uuid(), 'whatever') $$,
  'P0002', null, 'a heartbeat for no node is refused');
select throws_ok($$ select * from registered r
                    cross join lateral public.agent_heartbeat_with_secret(r.node_id, r.node_secret, 'online', -1) h $$,
  '22023', 'a heartbeat out of bounds (status, queue depth, utilization, free VRAM or list lengths)',
  'a heartbeat out of bounds is refused, secret or not');
select results_eq($$ select n.status from public.nodes n join registered r on r.node_id = n.id $$, array['offline'],
  'the refused heartbeats changed nothing');

select results_eq($$ select h.status from registered r
                     cross join lateral public.agent_heartbeat_with_secret(r.node_id, r.node_secret, 'online', 0, 0.5, 20,
                                                                           array['meta-llama/Llama-3.1-8B-Instruct']) h $$,
  array['online'], 'a heartbeat with the node''s secret brings it online');
select tests.as_anon();
select results_eq($$ select m.status from public.node_map m join registered r on r.node_id = m.id $$, array['online'],
  'and the map shows it online');
select throws_ok($$ select * from registered r
                    cross join lateral public.agent_heartbeat(r.node_id, sha256(convert_to(r.node_secret, 'UTF8')), 'online',
                                                              0, 0, 0, '{}', null, true, '{}', null, null, null) h $$,
  '42501', 'permission denied for function agent_heartbeat', 'anon cannot heartbeat with a hash either (the gateway''s path)');

-- authenticated ----------------------------------------------------------------------
select tests.as_user('alice');
select throws_ok($$ select * from registered r cross join lateral public.agent_heartbeat_with_secret(r.node_id, r.node_secret) h $$,
  '42501', 'permission denied for function agent_heartbeat_with_secret',
  'a signed-in user cannot call it, even with their own node''s secret');
select tests.as_service_role();
select results_eq($$ select h.status from registered r
                     cross join lateral public.agent_heartbeat_with_secret(r.node_id, r.node_secret, 'draining') h $$,
  array['draining'], 'a later heartbeat changes the status again');

select * from finish();
rollback;
