-- The Data API's own shapes (20261129000100_data_api.sql), what a front-end reads with `select *`:
-- my_api_keys, my_usage and my_nodes() give a signed-in user their own rows (never a key hash; their
-- own nodes' endpoints, nobody else's), revoke_api_key() revokes one of their own keys only, and
-- fleet_stats() gives anyone the fleet's totals. anon reads none of a user's shapes; service_role,
-- which has no user, reads nothing through them (not everyone's rows).
begin;
create extension if not exists pgtap with schema extensions;
select plan(37);

select tests.create_user('alice');
select tests.create_user('bob');

insert into public.api_keys (owner_id, name, prefix, key_hash, budget_usd)
values (tests.user_id('alice'), 'alice laptop', 'ng-alice001', sha256('alice 1'), 5),
       (tests.user_id('alice'), 'alice server', 'ng-alice002', sha256('alice 2'), null),
       (tests.user_id('bob'), 'bob ci', 'ng-bob00001', sha256('bob 1'), null);
insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url, status)
values (tests.user_id('alice'), 'alice-4090', 'pgtap GPU', 24, 82.6, 0.40, 'eu-west', 'https://alice.example.com', 'online'),
       (tests.user_id('bob'), 'bob-a100', 'A100 80GB', 80, 312, 1.60, 'us-east', 'https://bob.example.com', 'online');
insert into public.node_models (node_id, model_id, state)
select id, 'meta-llama/Llama-3.1-8B-Instruct', 'loaded' from public.nodes where name in ('alice-4090', 'bob-a100');
insert into public.jobs (api_key_id, owner_id, model_id, policy, status, node_id, min_vram_gb, prompt_tokens,
                         completion_tokens, cost_usd, finished_at, latency_ms)
select k.id, k.owner_id, 'meta-llama/Llama-3.1-8B-Instruct', 'balanced', j.status, n.id, 18, 100, 50, j.cost, now(), 250
from (values ('alice laptop', 'succeeded', 0.01), ('alice laptop', 'failed', 0.001), ('bob ci', 'succeeded', 0.02))
       as j (key, status, cost)
join public.api_keys k on k.name = j.key
cross join public.nodes n where n.name = 'bob-a100';

-- my_api_keys ----------------------------------------------------------------------------------------
select tests.as_anon();
select throws_ok($$ select * from public.my_api_keys $$,
  '42501', 'permission denied for view my_api_keys', 'anon cannot read my_api_keys');
select tests.as_user('alice');
select results_eq($$ select name, prefix, budget_usd, active from public.my_api_keys order by name $$,
  $$ values ('alice laptop', 'ng-alice001', 5.0000::numeric(12, 4), true), ('alice server', 'ng-alice002', null, true) $$,
  'a user reads their own keys with select *, and only theirs');
select throws_ok($$ update public.my_api_keys set budget_usd = 100 $$,
  '42501', 'permission denied for view my_api_keys', 'a user cannot raise a budget through the view');
select tests.as_user('bob');
select results_eq($$ select name from public.my_api_keys $$, array['bob ci'], 'the other user reads only theirs');
select tests.as_service_role();
select is_empty($$ select * from public.my_api_keys $$, 'service_role (no user) reads no one''s keys through my_api_keys');

-- revoke_api_key() -----------------------------------------------------------------------------------
select tests.as_anon();
select throws_ok($$ select public.revoke_api_key(gen_random_uuid()) $$,
  '42501', 'permission denied for function revoke_api_key', 'anon cannot revoke a key');
select tests.as_user('alice');
select isnt((select public.revoke_api_key(id) from public.my_api_keys where name = 'alice server'), null,
  'a user revokes their own key, and learns when');
select results_eq($$ select name, active from public.my_api_keys order by name $$,
  $$ values ('alice laptop', true), ('alice server', false) $$, 'the key is revoked, the other one is not');
select is((select public.revoke_api_key(id) from public.my_api_keys where name = 'alice server'),
  (select revoked_at from public.my_api_keys where name = 'alice server'),
  'revoking it again is no error and returns when it was first revoked');
select throws_ok(format('select public.revoke_api_key(%L)', (select k.id from public.api_keys k where k.name = 'bob ci')),
  'PT404', null, 'a user cannot revoke another user''s key (it is not found among theirs)');
select throws_ok($$ select public.revoke_api_key(gen_random_uuid()) $$, 'PT404', null, 'nor a key that does not exist');
select tests.as_user('bob');
select results_eq($$ select active from public.my_api_keys $$, array[true], 'the other user''s key is still active');
select tests.as_service_role();
select isnt((select public.revoke_api_key(id) from public.api_keys where name = 'bob ci'), null,
  'service_role revokes any key');

-- my_usage ---------------------------------------------------------------------------------------------
select tests.as_anon();
select throws_ok($$ select * from public.my_usage $$,
  '42501', 'permission denied for view my_usage', 'anon cannot read my_usage');
select tests.as_user('alice');
select results_eq($$ select key_name, model_id, requests, succeeded, failed, prompt_tokens, cost_usd from public.my_usage $$,
  $$ values ('alice laptop', 'meta-llama/Llama-3.1-8B-Instruct', 2::bigint, 1::bigint, 1::bigint, 200::bigint, 0.011::numeric) $$,
  'a user reads their own usage with select *, and only theirs');
select tests.as_user('bob');
select results_eq($$ select key_name, requests, cost_usd from public.my_usage $$,
  $$ values ('bob ci', 1::bigint, 0.02::numeric) $$, 'the other user reads only theirs');
select tests.as_service_role();
select is_empty($$ select * from public.my_usage $$, 'service_role (no user) reads no one''s usage through my_usage');

-- my_nodes() -------------------------------------------------------------------------------------------
select tests.as_anon();
select throws_ok($$ select * from public.my_nodes() $$,
  '42501', 'permission denied for function my_nodes', 'anon cannot call my_nodes()');
select throws_ok($$ select * from public.node_endpoints $$,
  '42501', 'permission denied for table node_endpoints', 'nor read node_endpoints');
select tests.as_user('alice');
select results_eq($$ select name, endpoint_url, warm_models from public.my_nodes() $$,
  $$ values ('alice-4090', 'https://alice.example.com', array['meta-llama/Llama-3.1-8B-Instruct']) $$,
  'an owner reads their own nodes with their endpoints through my_nodes() (the one way to read them back)');
select is_empty($$ select * from public.my_nodes() where endpoint_url = 'https://bob.example.com' $$,
  'an owner reads no other owner''s endpoint through my_nodes()');
select results_eq($$ select endpoint_url from public.node_endpoints $$, $$ values ('https://alice.example.com') $$,
  'an owner reads their own nodes'' endpoints in node_endpoints, and no one else''s');
select throws_ok($$ insert into public.node_endpoints select id, 'https://elsewhere.example.com' from public.nodes limit 1 $$,
  '42501', 'permission denied for table node_endpoints', 'and cannot write one (the platform copies nodes.endpoint_url)');
select tests.as_user('bob');
select results_eq($$ select name, endpoint_url from public.my_nodes() $$,
  $$ values ('bob-a100', 'https://bob.example.com') $$, 'the other owner reads only theirs');
select tests.as_token('authenticated', '{"role": "authenticated"}');
select is_empty($$ select * from public.my_nodes() $$, 'a token without a user reads no node');
select tests.as_service_role();
select is_empty($$ select * from public.my_nodes() $$, 'service_role (no user) reads no node through my_nodes()');

-- fleet_stats() ----------------------------------------------------------------------------------------
select tests.as_postgres();
select private.refresh_fleet_activity();  -- sweep() does this (these nodes never beat, so no sweep here)
select tests.as_anon();
select is((select online_nodes from public.fleet_stats()),
  (select count(*) from public.node_map where status in ('online', 'busy')),
  'anon reads the fleet''s totals: as many nodes online as the map shows');
select ok((select jobs_last_minute >= 3 and p50_latency_ms = 250 from public.fleet_stats()),
  'and the jobs of the last minute and their median latency, which anon cannot read one by one');
select throws_ok($$ select id from public.jobs $$, '42501', 'permission denied for table jobs',
  'while the jobs themselves stay closed to anon');
select ok((select cheapest @> '[{"gpu_model": "pgtap GPU", "hourly_rate": 0.4}]' from public.fleet_stats()),
  'fleet_stats() gives the cheapest rate per GPU model online');
select tests.as_user('alice');
select is((select online_nodes from public.fleet_stats()),
  (select count(*) from public.node_map where status in ('online', 'busy')),
  'a signed-in user reads the same totals');
select throws_ok($$ update public.fleet_activity set jobs_last_minute = 0 $$,
  '42501', 'permission denied for table fleet_activity', 'and cannot change them');
select tests.as_service_role();
select lives_ok($$ select * from public.fleet_stats() $$, 'service_role reads them too');

-- What the Data API shapes are made of ----------------------------------------------------------------
select tests.as_postgres();
select is_empty($$
  select c.relname from pg_catalog.pg_class c
  where c.oid in ('public.my_api_keys'::regclass, 'public.my_usage'::regclass)
    and not coalesce('security_invoker=true' = any (c.reloptions), false)
$$, 'my_api_keys and my_usage run with their caller''s rights');
select isnt_definer('public', 'my_nodes', '{}'::name[], 'my_nodes() runs as its caller: owners read their endpoints from node_endpoints');
select isnt_definer('public', 'fleet_stats', '{}'::name[], 'fleet_stats() runs as its caller: the sweep counts the jobs');
select isnt_definer('public', 'revoke_api_key', array['uuid'], 'revoke_api_key() runs as its caller, under row-level security');

select * from finish();
rollback;
