-- nodes and the public map (node_map): anyone sees the fleet on the map, but never where a node is
-- reached (endpoint_url), its secret, or (as anon) who owns it. A signed-in owner adds, changes and
-- removes their own nodes' specs, never another owner's, and never what the platform measures
-- (status, load, reputation). service_role (the gateway) sees and changes everything.
begin;
create extension if not exists pgtap with schema extensions;
select plan(37);

select tests.create_user('alice');
select tests.create_user('bob');

insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region, latitude, longitude,
                          endpoint_url, secret_hash, status)
values
  (tests.user_id('alice'), 'alice-4090', 'RTX 4090', 24, 82.6, 0.40, 'eu-west', 48.85, 2.35,
   'https://alice-gpu.example.com:8000', sha256('alice secret'), 'online'),
  (tests.user_id('bob'), 'bob-a100', 'A100 80GB', 80, 312, 1.60, 'us-east', 40.71, -74.0,
   'https://bob-gpu.example.com:8000', sha256('bob secret'), 'online');

-- anon -----------------------------------------------------------------------------------------------
select tests.as_anon();
select set_eq($$ select name from public.node_map where name in ('alice-4090', 'bob-a100') $$,
  array['alice-4090', 'bob-a100'], 'anon sees both nodes on the map');
select results_eq($$ select gpu_model, vram_gb, region, status from public.node_map where name = 'alice-4090' $$,
  $$ values ('RTX 4090', 24::real, 'eu-west', 'online') $$, 'anon reads a node''s specs and status on the map');
select lives_ok($$ select id, name, gpu_model, vram_gb, hourly_rate, status, backend, routes from public.nodes $$,
  'anon reads the public columns of nodes');
select throws_ok($$ select endpoint_url from public.nodes $$, '42501', 'permission denied for table nodes',
  'anon cannot read where a node is reached (endpoint_url)');
select throws_ok($$ select owner_id from public.nodes $$, '42501', 'permission denied for table nodes',
  'anon cannot read who owns a node');
select throws_ok($$ select secret_hash from public.nodes $$, '42501', 'permission denied for table nodes',
  'anon cannot read a node''s secret hash');
select throws_ok($$ select * from public.nodes $$, '42501', 'permission denied for table nodes',
  'anon cannot select every column of nodes');
select throws_ok($$ insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region)
                    values ('anon-node', 'RTX 3090', 24, 35, 0.2, 'eu-west') $$,
  '42501', 'permission denied for table nodes', 'anon cannot add a node');
select throws_ok($$ update public.nodes set name = 'renamed' $$, '42501', 'permission denied for table nodes',
  'anon cannot rename nodes');
select throws_ok($$ delete from public.nodes $$, '42501', 'permission denied for table nodes',
  'anon cannot delete nodes');

-- authenticated: reading -----------------------------------------------------------------------------
select tests.as_user('alice');
select results_eq($$ select name from public.nodes where owner_id = auth.uid() $$, array['alice-4090'],
  'a signed-in owner finds their own nodes by owner_id');
select set_eq($$ select name from public.node_map where name in ('alice-4090', 'bob-a100') $$,
  array['alice-4090', 'bob-a100'], 'a signed-in user sees the whole fleet on the map');
select throws_ok($$ select endpoint_url from public.nodes where owner_id = auth.uid() $$,
  '42501', 'permission denied for table nodes', 'an owner cannot read even their own node''s endpoint back');
select throws_ok($$ select secret_hash from public.nodes where owner_id = auth.uid() $$,
  '42501', 'permission denied for table nodes', 'an owner cannot read their own node''s secret hash');

-- authenticated: adding ------------------------------------------------------------------------------
select lives_ok($$ insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url)
                   values ('alice-3090', 'RTX 3090', 24, 35.6, 0.20, 'eu-west', 'https://alice-2.example.com') $$,
  'an owner adds a node');
select results_eq($$ select owner_id, status from public.nodes where name = 'alice-3090' $$,
  $$ values (tests.user_id('alice'), 'offline') $$, 'the added node is the owner''s, and offline until its agent beats');
select throws_ok($$ insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region)
                    values (tests.user_id('bob'), 'for-bob', 'RTX 3090', 24, 35.6, 0.20, 'eu-west') $$,
  '42501', 'permission denied for table nodes', 'an owner cannot add a node for another owner');
select throws_ok($$ insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, status)
                    values ('alice-online', 'RTX 3090', 24, 35.6, 0.20, 'eu-west', 'online') $$,
  '42501', 'permission denied for table nodes', 'an owner cannot add a node already online');
select throws_ok($$ insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url)
                    values ('alice-local', 'RTX 3090', 24, 35.6, 0.20, 'eu-west', 'http://127.0.0.1:8000') $$,
  '23514', 'endpoint_url must be a public address, not http://127.0.0.1:8000; behind NAT, run the agent with --tunnel',
  'an owner cannot point a node at a private address');
select tests.as_token('authenticated', '{"role": "authenticated"}');
select throws_ok($$ insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region)
                    values ('nobody-node', 'RTX 3090', 24, 35.6, 0.20, 'eu-west') $$,
  '42501', 'new row violates row-level security policy for table "nodes"',
  'a token without a user cannot add a node that belongs to nobody');

-- authenticated: changing and removing ----------------------------------------------------------------
select tests.as_user('alice');
select results_eq($$ update public.nodes set name = 'alice-4090-renamed', hourly_rate = 0.35
                     where name = 'alice-4090' returning name $$,
  array['alice-4090-renamed'], 'an owner renames and reprices their own node');
select is_empty($$ update public.nodes set name = 'taken-by-alice' where name = 'bob-a100' returning name $$,
  'an owner''s update of another owner''s node changes nothing');
select throws_ok($$ update public.nodes set status = 'online' where owner_id = auth.uid() $$,
  '42501', 'permission denied for table nodes', 'an owner cannot set their node''s status');
select throws_ok($$ update public.nodes set successes = 1000000 where owner_id = auth.uid() $$,
  '42501', 'permission denied for table nodes', 'an owner cannot raise their node''s reputation');
select throws_ok($$ update public.nodes set secret_hash = sha256('mine') where owner_id = auth.uid() $$,
  '42501', 'permission denied for table nodes', 'an owner cannot replace their node''s secret');
select throws_ok($$ update public.nodes set owner_id = tests.user_id('bob') where owner_id = auth.uid() $$,
  '42501', 'permission denied for table nodes', 'an owner cannot give a node away');
select throws_ok($$ update public.nodes set endpoint_url = 'http://10.0.0.5:8000' where owner_id = auth.uid() $$,
  '23514', 'endpoint_url must be a public address, not http://10.0.0.5:8000; behind NAT, run the agent with --tunnel',
  'an owner cannot move their node to a private address');
select is_empty($$ delete from public.nodes where name = 'bob-a100' returning name $$,
  'an owner''s delete of another owner''s node deletes nothing');
select results_eq($$ delete from public.nodes where name = 'alice-3090' returning name $$, array['alice-3090'],
  'an owner deletes their own node');

select tests.as_user('bob');
select results_eq($$ select name, hourly_rate from public.nodes where owner_id = auth.uid() $$,
  $$ values ('bob-a100', 1.6000::numeric(10, 4)) $$, 'the other owner''s node is untouched');
select is_empty($$ update public.nodes set name = 'taken-by-bob' where owner_id = tests.user_id('alice') returning name $$,
  'and that owner cannot change the first owner''s nodes either');

-- service_role -----------------------------------------------------------------------------------------
select tests.as_service_role();
select results_eq($$ select endpoint_url, secret_hash from public.nodes where name = 'bob-a100' $$,
  $$ values ('https://bob-gpu.example.com:8000', sha256('bob secret')) $$,
  'service_role reads a node''s endpoint and secret hash');
select results_eq($$ update public.nodes set status = 'draining' where name = 'bob-a100' returning status $$,
  array['draining'], 'service_role sets a node''s status');
select lives_ok($$ insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url)
                   values (tests.user_id('bob'), 'bob-lan', 'L4', 24, 121, 0.5, 'us-east', 'http://10.1.2.3:8000') $$,
  'service_role writes any endpoint (the gateway checks the addresses it connects to itself)');
select results_eq($$ delete from public.nodes where name = 'bob-lan' returning name $$, array['bob-lan'],
  'service_role deletes any owner''s node');

-- What the others changed, seen by anon on the map.
select tests.as_anon();
select results_eq($$ select name, status from public.node_map where name like 'alice-%' or name like 'bob-%' order by name $$,
  $$ values ('alice-4090-renamed', 'online'), ('bob-a100', 'draining') $$,
  'anon sees the owner''s rename and the service''s status change on the map, and nothing else changed');
select hasnt_column('public', 'node_map', 'secret_hash', 'the public map has no secret hash');

select * from finish();
rollback;
