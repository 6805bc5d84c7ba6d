-- The matcher's API. score_nodes() ranks nodes for a request: signed-in users may call it (it is how
-- the map explains a choice), anon may not. Placing, completing and moving jobs is the gateway's
-- work alone (service_role): anon and signed-in users are refused every such function. The service's
-- own path, end to end: a node registers and beats, a request is placed on it and completed, and its
-- owner (only) sees the earning while the requester (only) sees the job.
begin;
create extension if not exists pgtap with schema extensions;
select plan(44);

select tests.create_user('alice');  -- owns the node
select tests.create_user('bob');    -- sends the request

-- A model of the tests' own, so that only the tests' node serves it (on a stack with other nodes too).
insert into public.models (id, min_vram_gb, input_usd_per_mtok, output_usd_per_mtok)
values ('pgtap/chat-8b', 18, 0.05, 0.10);
insert into public.api_keys (owner_id, name, prefix, key_hash)
values (tests.user_id('bob'), 'bob key', 'ng-bob00000', sha256('bob key'));

create temporary table placed (job_id uuid, node_id uuid, endpoint_url text, error text, refusal text);
grant all on placed to anon, authenticated, service_role;

-- The node joins the grid as the gateway makes it: registered, then beating with its secret.
select tests.as_service_role();
select lives_ok($$
  select h.status
  from public.register_node(tests.user_id('alice'), 'alice-4090', 'RTX 4090', 1, 24, 82.6, 0.40, 'eu-west', 48.85, 2.35,
                            'http://8.8.8.8:8000', 4, array['pgtap/chat-8b'], '1.0', null, '{}') r
  cross join lateral public.agent_heartbeat(r.node_id, sha256(convert_to(r.node_secret, 'UTF8')), 'online', 0, 0.1, 20,
                                            array['pgtap/chat-8b'], null, true, '{}', null, null, null) h
$$, 'service_role registers a node and its agent''s first heartbeat brings it online');

-- score_nodes() ----------------------------------------------------------------------------------------
select tests.as_anon();
select throws_ok($$ select * from public.score_nodes('pgtap/chat-8b') $$,
  '42501', 'permission denied for function score_nodes', 'anon cannot call score_nodes()');
select tests.as_user('bob');
select throws_ok($$ select * from public.score_nodes('pgtap/chat-8b') $$,
  '42501', 'permission denied for function score_nodes',
  'a signed-in user cannot call it through the Data API (the Edge Function match ranks for them)');
select tests.as_service_role();
select results_eq($$ select name, rank from public.score_nodes('pgtap/chat-8b') $$,
  $$ values ('alice-4090', 1::bigint) $$, 'service_role ranks the nodes for a model with score_nodes()');
select results_eq($$ select name, reject_reason is not null
                     from public.score_nodes('pgtap/chat-8b', p_min_vram_gb => 40, p_explain => true) $$,
  $$ values ('alice-4090', true) $$, 'and sees why a node lost, with p_explain');
select ok(has_function_privilege('neuralgrid_matcher', 'public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text)', 'execute'),
  'neuralgrid_matcher, the role match ranks as for a user, may call it');

-- The gateway's functions, refused to anon and to signed-in users --------------------------------------
select tests.as_anon();
select throws_ok($$ select * from public.place_job('pgtap/chat-8b', null::uuid, 'balanced', null::real,
                    null::text, null::float8, null::float8, null::numeric, false, 2, 100, 50, false, 'chat/completions') $$,
  '42501', 'permission denied for function place_job', 'anon cannot place a job');
select throws_ok($$ select * from public.place_job('pgtap/chat-8b', null::uuid, 'balanced', null::real,
                    null::text, null::float8, null::float8, null::numeric, false, 2, 100, 50, false) $$,
  '42501', 'permission denied for function place_job', 'anon cannot place a job (the older overload)');
select throws_ok($$ select * from public.match_job('pgtap/chat-8b') $$,
  '42501', 'permission denied for function match_job', 'anon cannot match a job');
select throws_ok($$ select * from public.match_job('pgtap/chat-8b', null::uuid, 'balanced', null::real,
                    null::text, null::float8, null::float8, null::numeric, false, 2, 100, 50) $$,
  '42501', 'permission denied for function match_job', 'anon cannot match a job (with an output cap)');
select throws_ok($$ select * from public.complete_job(gen_random_uuid()) $$,
  '42501', 'permission denied for function complete_job', 'anon cannot complete a job');
select throws_ok($$ select * from public.complete_jobs(array[gen_random_uuid()], array['succeeded'], array[1], array[1],
                    array[1::real], array[1::real], array[null::text]) $$,
  '42501', 'permission denied for function complete_jobs', 'anon cannot complete jobs in a batch');
select throws_ok($$ select * from public.failover_job(gen_random_uuid(), 'boom') $$,
  '42501', 'permission denied for function failover_job', 'anon cannot fail a job over');
select throws_ok($$ select * from public.handoff_job(gen_random_uuid(), 'boom') $$,
  '42501', 'permission denied for function handoff_job', 'anon cannot hand a job off');
select throws_ok($$ select * from public.handoff_job(gen_random_uuid(), 'boom', 421, '{}'::uuid[]) $$,
  '42501', 'permission denied for function handoff_job', 'anon cannot hand a job off (saying whose failure it was)');
select throws_ok($$ select public.reject_job(gen_random_uuid(), 'bad request') $$,
  '42501', 'permission denied for function reject_job', 'anon cannot reject a job');
select throws_ok($$ select public.continuing_nodes(array[gen_random_uuid()]) $$,
  '42501', 'permission denied for function continuing_nodes', 'anon cannot ask which nodes continue a stream');

select tests.as_user('bob');
select throws_ok($$ select * from public.place_job('pgtap/chat-8b', null::uuid, 'balanced', null::real,
                    null::text, null::float8, null::float8, null::numeric, false, 2, 100, 50, false, 'chat/completions') $$,
  '42501', 'permission denied for function place_job', 'a signed-in user cannot place a job (it would skip the key''s budget)');
select throws_ok($$ select * from public.place_job('pgtap/chat-8b', null::uuid, 'balanced', null::real,
                    null::text, null::float8, null::float8, null::numeric, false, 2, 100, 50, false) $$,
  '42501', 'permission denied for function place_job', 'a signed-in user cannot place a job (the older overload)');
select throws_ok($$ select * from public.match_job('pgtap/chat-8b') $$,
  '42501', 'permission denied for function match_job', 'a signed-in user cannot match a job');
select throws_ok($$ select * from public.match_job('pgtap/chat-8b', null::uuid, 'balanced', null::real,
                    null::text, null::float8, null::float8, null::numeric, false, 2, 100, 50) $$,
  '42501', 'permission denied for function match_job', 'a signed-in user cannot match a job (with an output cap)');
select throws_ok($$ select * from public.complete_job(gen_random_uuid()) $$,
  '42501', 'permission denied for function complete_job', 'a signed-in user cannot complete a job (and set its cost)');
select throws_ok($$ select * from public.complete_jobs(array[gen_random_uuid()], array['succeeded'], array[1], array[1],
                    array[1::real], array[1::real], array[null::text]) $$,
  '42501', 'permission denied for function complete_jobs', 'a signed-in user cannot complete jobs in a batch');
select throws_ok($$ select * from public.failover_job(gen_random_uuid(), 'boom') $$,
  '42501', 'permission denied for function failover_job', 'a signed-in user cannot fail a job over');
select throws_ok($$ select * from public.handoff_job(gen_random_uuid(), 'boom') $$,
  '42501', 'permission denied for function handoff_job', 'a signed-in user cannot hand a job off');
select throws_ok($$ select * from public.handoff_job(gen_random_uuid(), 'boom', 421, '{}'::uuid[]) $$,
  '42501', 'permission denied for function handoff_job', 'a signed-in user cannot hand a job off (saying whose failure it was)');
select throws_ok($$ select public.reject_job(gen_random_uuid(), 'bad request') $$,
  '42501', 'permission denied for function reject_job', 'a signed-in user cannot reject a job');
select throws_ok($$ select public.continuing_nodes(array[gen_random_uuid()]) $$,
  '42501', 'permission denied for function continuing_nodes', 'a signed-in user cannot ask which nodes continue a stream');
select throws_ok($$ select * from public.place_jobs(null, '[]') $$,
  '42501', 'permission denied for function place_jobs', 'a signed-in user cannot place jobs in a group');

-- The gateway's path, as service_role ----------------------------------------------------------------------
select tests.as_service_role();
select lives_ok($$
  insert into placed
  select p.job_id, p.node_id, p.endpoint_url, p.error, p.refusal
  from public.place_job('pgtap/chat-8b', (select id from public.api_keys where name = 'bob key'),
                        'balanced', null, 'eu-west', null, null, null, false, 2, 100, 50, false, 'chat/completions') p
$$, 'service_role places a job');
select results_eq($$ select n.name, p.endpoint_url, p.error, p.refusal from placed p join public.nodes n on n.id = p.node_id $$,
  $$ values ('alice-4090', 'http://8.8.8.8:8000', null::text, null::text) $$,
  'the job is placed on the node, with the endpoint only the gateway reads');
select results_eq($$ select inflight from public.nodes where name = 'alice-4090' $$, array[1],
  'placing it took a slot on the node');
select results_eq($$ select c.cost_usd > 0 from placed p cross join lateral public.complete_job(p.job_id, 'succeeded', 100, 50, 20, 300) c $$,
  array[true], 'service_role completes the job, which costs something');
select results_eq($$ select inflight, successes from public.nodes where name = 'alice-4090' $$,
  $$ values (0, 1::bigint) $$, 'completing it freed the slot and counted a success');
select lives_ok($$
  insert into placed
  select p.job_id, p.node_id, p.endpoint_url, coalesce(p.error, p.failure), p.refusal
  from public.place_jobs(gen_random_uuid()::text, jsonb_build_array(jsonb_build_object(
    'model', 'pgtap/chat-8b', 'key', (select id from public.api_keys where name = 'bob key'), 'policy', 'balanced',
    'stream', true, 'fallbacks', 2, 'prompt_bytes', 100, 'max_out', 50, 'wait', false,
    'route', 'chat/completions'))) p
$$, 'service_role places a second job, in a group of one (place_jobs())');
select results_eq($$ select count(*)::integer from placed p
                     cross join lateral public.complete_jobs(array[p.job_id], array['failed'], array[10], array[0],
                                                             array[null::real], array[50::real], array['node hung up']) c
                     where p.job_id not in (select job_id from public.earnings) $$,
  array[1], 'service_role completes jobs in a batch (here one that failed)');

-- Who sees what came of it.
select tests.as_user('bob');
select set_eq($$ select status from public.jobs $$, array['succeeded', 'failed'],
  'the requester sees both of their jobs, as they ended');
select results_eq($$ select name, revoked_at is null, spent_usd > 0 from public.api_keys $$,
  $$ values ('bob key', true, true) $$, 'and sees what their key has spent');
select is_empty($$ select job_id from public.earnings $$, 'the requester earns nothing from their own request');
select tests.as_user('alice');
select is_empty($$ select id from public.jobs $$, 'the node''s owner does not see the requester''s jobs');
select results_eq($$ select n.name, e.model_id, e.net_usd = e.gross_usd - e.fee_usd and e.fee_usd > 0
                     from public.earnings e join public.nodes n on n.id = e.node_id $$,
  $$ values ('alice-4090', 'pgtap/chat-8b', true) $$,
  'the node''s owner sees the earning of the job that succeeded (less the platform''s fee), and only that');
select results_eq($$ select jobs from public.my_earnings_totals(null) $$, array[1::bigint],
  'and counts it in their totals');
select results_eq($$ select name, jobs_served, failures from public.my_node_stats('1 day') $$,
  $$ values ('alice-4090', 1::bigint, 1::bigint) $$, 'and sees their node''s served and failed jobs');
select tests.as_anon();
select results_eq($$ select name, status, successes, failures from public.node_map where name = 'alice-4090' $$,
  $$ values ('alice-4090', 'online', 1::bigint, 1::bigint) $$, 'anon sees the node''s record on the map, and nothing of the jobs');

select * from finish();
rollback;
