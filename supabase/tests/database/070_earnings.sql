-- Earnings: the ledger (earnings) and what an owner reads of it (my_earnings, my_earnings_totals,
-- my_node_stats). A node owner sees the earnings of their own nodes only; the developers who paid
-- for the jobs see none of it; anon nothing; only the service writes the ledger.
begin;
create extension if not exists pgtap with schema extensions;
select plan(27);

select tests.create_user('alice');  -- owns two nodes
select tests.create_user('bob');    -- owns one node
select tests.create_user('carol');  -- owns none: sends requests

insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url, status, successes)
values (tests.user_id('alice'), 'alice-4090', 'RTX 4090', 24, 82.6, 0.40, 'eu-west', 'https://a1.example.com', 'online', 2),
       (tests.user_id('alice'), 'alice-l4', 'L4', 24, 121, 0.50, 'eu-west', 'https://a2.example.com', 'online', 1),
       (tests.user_id('bob'), 'bob-a100', 'A100 80GB', 80, 312, 1.60, 'us-east', 'https://b1.example.com', 'online', 1);
insert into public.earnings (job_id, node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd, earned_at)
select gen_random_uuid(), n.id, n.owner_id, e.model, e.gross, 0.15, e.gross * 0.15, e.gross * 0.85, e.at
from (values ('alice-4090', 'meta-llama/Llama-3.1-8B-Instruct', 1.00, now()),
             ('alice-4090', 'meta-llama/Llama-3.1-8B-Instruct', 2.00, now()),
             ('alice-l4', 'Qwen/Qwen2.5-0.5B-Instruct', 0.20, now() - interval '10 days'),
             ('bob-a100', 'meta-llama/Llama-3.1-8B-Instruct', 4.00, now())) as e (node, model, gross, at)
join public.nodes n on n.name = e.node;

-- The ledger -----------------------------------------------------------------------------------------
select tests.as_user('alice');
select bag_eq($$ select n.name, e.net_usd from public.earnings e join public.nodes n on n.id = e.node_id $$,
  $$ values ('alice-4090', 0.85::numeric(16, 8)), ('alice-4090', 1.70), ('alice-l4', 0.17) $$,
  'an owner sees the earnings of their own nodes, and only those');
select throws_ok($$ insert into public.earnings (job_id, node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd)
                    values (gen_random_uuid(), null, auth.uid(), 'x', 100, 0, 0, 100) $$,
  '42501', 'permission denied for table earnings', 'an owner cannot write themselves earnings');
select throws_ok($$ update public.earnings set net_usd = gross_usd, fee_usd = 0 $$,
  '42501', 'permission denied for table earnings', 'an owner cannot waive the platform''s fee');
select throws_ok($$ delete from public.earnings $$,
  '42501', 'permission denied for table earnings', 'an owner cannot delete ledger rows');

select tests.as_user('bob');
select results_eq($$ select net_usd from public.earnings $$, array[3.40::numeric(16, 8)],
  'the other owner sees only their own earnings');
select tests.as_user('carol');
select is_empty($$ select job_id from public.earnings $$, 'a user who owns no node sees no earnings');

select tests.as_anon();
select throws_ok($$ select job_id from public.earnings $$,
  '42501', 'permission denied for table earnings', 'anon cannot read the ledger');

select tests.as_service_role();
select is((select count(*)::integer from public.earnings e join public.nodes n on n.id = e.node_id
           where n.name in ('alice-4090', 'alice-l4', 'bob-a100')), 4, 'service_role reads the whole ledger');
select lives_ok($$ insert into public.earnings (job_id, node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd)
                   values (gen_random_uuid(), null, tests.user_id('bob'), 'meta-llama/Llama-3.1-8B-Instruct', 1, 0.15, 0.15, 0.85) $$,
  'service_role writes the ledger');

-- my_earnings(), my_earnings_totals() -----------------------------------------------------------------
select tests.as_user('alice');
select results_eq($$ select node_name, model_id, jobs, gross_usd, fee_usd, net_usd from public.my_earnings(null) $$,
  $$ values ('alice-l4', 'Qwen/Qwen2.5-0.5B-Instruct', 1::bigint, 0.20::numeric, 0.03::numeric, 0.17::numeric),
            ('alice-4090', 'meta-llama/Llama-3.1-8B-Instruct', 2, 3.00, 0.45, 2.55) $$,
  'my_earnings() gives an owner their earnings per day, node and model');
select results_eq($$ select node_name, jobs from public.my_earnings(now() - interval '1 day') $$,
  $$ values ('alice-4090', 2::bigint) $$, 'my_earnings() since a time leaves out older earnings');
select results_eq($$ select jobs, gross_usd, fee_usd, net_usd from public.my_earnings_totals(null) $$,
  $$ values (3::bigint, 3.20::numeric, 0.48::numeric, 2.72::numeric) $$,
  'my_earnings_totals() sums an owner''s own earnings only');
select tests.as_user('bob');
select results_eq($$ select jobs, net_usd from public.my_earnings_totals(null) $$,
  $$ values (2::bigint, 4.25::numeric) $$, 'the other owner''s totals are theirs alone');
select tests.as_user('carol');
select results_eq($$ select jobs, net_usd from public.my_earnings_totals(null) $$,
  $$ values (0::bigint, 0::numeric) $$, 'a user without nodes earns nothing');
select is_empty($$ select * from public.my_earnings(null) $$, 'and has no earnings by day');

-- my_node_stats() ------------------------------------------------------------------------------------
select tests.as_user('alice');
select results_eq($$ select name, status, jobs_served from public.my_node_stats('7 days') $$,
  $$ values ('alice-4090', 'online', 2::bigint), ('alice-l4', 'online', 1::bigint) $$,
  'my_node_stats() gives an owner the stats of their own nodes, and only those');
select tests.as_user('carol');
select is_empty($$ select * from public.my_node_stats('7 days') $$, 'a user without nodes has no node stats');

-- anon and service_role --------------------------------------------------------------------------------
select tests.as_anon();
select throws_ok($$ select * from public.my_earnings(null) $$,
  '42501', 'permission denied for function my_earnings', 'anon cannot call my_earnings()');
select throws_ok($$ select * from public.my_earnings_totals(null) $$,
  '42501', 'permission denied for function my_earnings_totals', 'anon cannot call my_earnings_totals()');
select throws_ok($$ select * from public.my_node_stats('7 days') $$,
  '42501', 'permission denied for function my_node_stats', 'anon cannot call my_node_stats()');

-- With a user's claims but the anon role (a forged or mixed-up request), still nothing.
select tests.as_token('anon', jsonb_build_object('sub', tests.user_id('alice'), 'role', 'anon'));
select throws_ok($$ select * from public.my_earnings_totals(null) $$,
  '42501', 'permission denied for function my_earnings_totals', 'anon with a user''s id cannot read their totals');

select tests.as_service_role();
select lives_ok($$ select * from public.my_earnings(null) $$, 'service_role may call my_earnings()');
select results_eq($$ select jobs from public.my_earnings_totals(null) $$, array[0::bigint],
  'service_role (no user) earns nothing: the functions are per owner, not a back door to everyone''s earnings');
select is_empty($$ select * from public.my_node_stats('7 days') $$, 'and service_role has no nodes of its own');

-- A user is identified by the token's user, not by a user id passed in.
select tests.as_user('carol');
select is_empty($$ select * from public.my_earnings(null) where node_name like 'alice-%' $$,
  'a user cannot reach another owner''s earnings through my_earnings()');
select results_eq($$ select count(*)::integer from public.my_node_stats('7 days') where name like 'bob-%' $$, array[0],
  'nor another owner''s nodes through my_node_stats()');
select tests.as_user('bob');
select results_eq($$ select name from public.my_node_stats('7 days') $$, array['bob-a100'],
  'the other owner gets their own node');

select * from finish();
rollback;
