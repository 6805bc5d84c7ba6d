-- Jobs and their attempts: a user sees the jobs their keys ran, and their attempts; not other users'
-- jobs, not even those that ran on their own nodes. Only the service writes them. anon reads nothing.
begin;
create extension if not exists pgtap with schema extensions;
select plan(23);

select tests.create_user('alice');  -- owns the node
select tests.create_user('bob');    -- sends requests
select tests.create_user('carol');  -- sends requests too

insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url, status)
values (tests.user_id('alice'), 'alice-4090', 'RTX 4090', 24, 82.6, 0.40, 'eu-west', 'https://alice.example.com', 'online');
insert into public.api_keys (owner_id, name, prefix, key_hash)
values (tests.user_id('bob'), 'bob key', 'ng-bob00000', sha256('bob key')),
       (tests.user_id('carol'), 'carol key', 'ng-carol000', sha256('carol key'));
insert into public.jobs (id, api_key_id, owner_id, model_id, policy, status, node_id, attempts, min_vram_gb,
                         prompt_tokens, completion_tokens, cost_usd, finished_at, end_user)
select j.id, k.id, k.owner_id, 'meta-llama/Llama-3.1-8B-Instruct', 'balanced', j.status, n.id, 1, 18, 100, 50,
       j.cost, case when j.status <> 'running' then now() end, j.end_user
from (values ('00000000-0000-4000-8000-0000000000b1'::uuid, 'bob key', 'succeeded', 0.00002, 'bob-customer-1'),
             ('00000000-0000-4000-8000-0000000000b2'::uuid, 'bob key', 'running', 0, null),
             ('00000000-0000-4000-8000-0000000000c1'::uuid, 'carol key', 'failed', 0, null))
       as j (id, key, status, cost, end_user)
join public.api_keys k on k.name = j.key
cross join public.nodes n where n.name = 'alice-4090';
insert into public.job_attempts (job_id, attempt, node_id, status, http_status, error)
select j.id, 1, j.node_id, j.status, case when j.status = 'failed' then 502 end,
       case when j.status = 'failed' then 'node went away' end
from public.jobs j where j.id::text like '00000000-0000-4000-8000-0000000000%';

-- authenticated --------------------------------------------------------------------------------------
select tests.as_user('bob');
select set_eq($$ select id from public.jobs $$,
  array['00000000-0000-4000-8000-0000000000b1', '00000000-0000-4000-8000-0000000000b2']::uuid[],
  'a user sees the jobs of their own keys, and only those');
select results_eq($$ select status, cost_usd, end_user from public.jobs where id = '00000000-0000-4000-8000-0000000000b1' $$,
  $$ values ('succeeded', 0.00002::numeric(16, 8), 'bob-customer-1') $$,
  'a user reads what their job cost and for which of their own users it ran');
select set_eq($$ select job_id from public.job_attempts $$,
  array['00000000-0000-4000-8000-0000000000b1', '00000000-0000-4000-8000-0000000000b2']::uuid[],
  'a user sees the attempts of their own jobs, and only those');
select is_empty($$ select id from public.jobs where owner_id = tests.user_id('carol') $$,
  'a user cannot find another user''s jobs by owner');
select throws_ok($$ insert into public.jobs (model_id, policy, min_vram_gb) values ('meta-llama/Llama-3.1-8B-Instruct', 'balanced', 18) $$,
  '42501', 'permission denied for table jobs', 'a user cannot create a job by hand');
select throws_ok($$ update public.jobs set cost_usd = 0 $$,
  '42501', 'permission denied for table jobs', 'a user cannot change what their jobs cost');
select throws_ok($$ update public.jobs set status = 'cancelled', finished_at = now() where status = 'running' $$,
  '42501', 'permission denied for table jobs', 'a user cannot end a job in the table');
select throws_ok($$ delete from public.jobs $$,
  '42501', 'permission denied for table jobs', 'a user cannot delete their jobs');
select throws_ok($$ update public.job_attempts set status = 'succeeded' $$,
  '42501', 'permission denied for table job_attempts', 'a user cannot rewrite an attempt');
select throws_ok($$ insert into public.job_attempts (job_id, attempt) values ('00000000-0000-4000-8000-0000000000b1', 2) $$,
  '42501', 'permission denied for table job_attempts', 'a user cannot add an attempt');

select tests.as_user('carol');
select results_eq($$ select id, status from public.jobs $$,
  $$ values ('00000000-0000-4000-8000-0000000000c1'::uuid, 'failed') $$, 'the other user sees only their job');
select results_eq($$ select http_status, error from public.job_attempts $$, $$ values (502, 'node went away') $$,
  'and only its attempt, with why it failed');

select tests.as_user('alice');
select is_empty($$ select id from public.jobs $$,
  'a node''s owner does not see the jobs others ran on their node (the requests are the requesters'')');
select is_empty($$ select job_id from public.job_attempts $$,
  'nor those jobs'' attempts');

select tests.as_token('authenticated', '{"role": "authenticated"}');
select is_empty($$ select id from public.jobs $$, 'a token without a user sees no job (not the jobs of no user)');

-- anon -----------------------------------------------------------------------------------------------
select tests.as_anon();
select throws_ok($$ select id from public.jobs $$,
  '42501', 'permission denied for table jobs', 'anon cannot read jobs');
select throws_ok($$ select job_id from public.job_attempts $$,
  '42501', 'permission denied for table job_attempts', 'anon cannot read job attempts');
select throws_ok($$ update public.jobs set cost_usd = 0 $$,
  '42501', 'permission denied for table jobs', 'anon cannot change jobs');

-- service_role -----------------------------------------------------------------------------------------
select tests.as_service_role();
select is((select count(*)::integer from public.jobs where id::text like '00000000-0000-4000-8000-0000000000%'), 3,
  'service_role sees every user''s jobs');
select is((select count(*)::integer from public.job_attempts where job_id::text like '00000000-0000-4000-8000-0000000000%'), 3,
  'service_role sees every attempt');
select results_eq($$ update public.jobs set status = 'cancelled', finished_at = now()
                     where id = '00000000-0000-4000-8000-0000000000b2' returning status $$,
  array['cancelled'], 'service_role ends a job');
select lives_ok($$ insert into public.job_attempts (job_id, attempt, node_id)
                   select id, 2, node_id from public.jobs where id = '00000000-0000-4000-8000-0000000000c1' $$,
  'service_role records an attempt');

select tests.as_user('bob');
select results_eq($$ select status from public.jobs where id = '00000000-0000-4000-8000-0000000000b2' $$,
  array['cancelled'], 'the user sees the service''s change to their job');

select * from finish();
rollback;
