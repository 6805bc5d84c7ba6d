-- Verification: what each role may do with a model's pinned artifact, the checks of nodes' models
-- and the evidence behind them. Anyone reads the artifacts; an owner reads their own nodes' checks
-- and evidence, and may start a failed model over in one shape only; nobody but the service records
-- challenges or sets a state.
begin;
create extension if not exists pgtap with schema extensions;
select plan(15);

select tests.create_user('alice');  -- owns the cheat
select tests.create_user('bob');    -- owns an honest node

insert into public.model_artifacts (model_id, format, sha256)
values ('meta-llama/Llama-3.1-8B-Instruct', 'gguf', repeat('c', 64));
insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url, status)
values (tests.user_id('alice'), 'alice-4090', 'RTX 4090', 24, 82.6, 0.40, 'eu-west', 'https://a1.example.com', 'online'),
       (tests.user_id('bob'), 'bob-a100', 'A100 80GB', 80, 312, 1.60, 'us-east', 'https://b1.example.com', 'online');
insert into public.node_models (node_id, model_id)
select n.id, 'meta-llama/Llama-3.1-8B-Instruct' from public.nodes n;
select public.record_challenges(jsonb_agg(jsonb_build_object(
  'node', n.id, 'model', 'meta-llama/Llama-3.1-8B-Instruct', 'passed', false, 'distance', 8,
  'detail', jsonb_build_object('reason', 'canned')))) from public.nodes n, generate_series(1, 2) where n.name = 'alice-4090';

select tests.as_anon();
select results_eq($$ select sha256 from public.model_artifacts where model_id = 'meta-llama/Llama-3.1-8B-Instruct' $$,
  array[repeat('c', 64)], 'anyone reads the pinned artifacts');
select throws_ok($$ select * from public.model_checks $$, '42501', null, 'anon reads no check');
select throws_ok($$ select * from public.request_verification(gen_random_uuid()) $$, '42501', null,
  'anon cannot ask for a verification');

select tests.as_user('bob');
select results_eq($$ select n.name, c.state from public.model_checks c join public.nodes n on n.id = c.node_id $$,
  $$ values ('bob-a100'::text, 'unverified'::text) $$, 'an owner sees their own nodes'' checks, and only those');
select is_empty($$ select * from public.model_challenges $$, 'and their own evidence only');
select throws_ok($$ select * from public.request_verification((select id from public.nodes where name = 'alice-4090')) $$,
  'P0002', null, 'an owner cannot ask again for someone else''s node');
select throws_ok($$ select * from public.record_challenges('[]'::jsonb) $$, '42501', null,
  'an owner cannot record challenges');
select throws_ok($$ select * from public.due_challenges(array['x'], 1) $$, '42501', null, 'nor read the schedule');
select throws_ok($$ insert into public.model_artifacts (model_id, format, sha256) values ('HuggingFaceTB/SmolLM2-135M-Instruct', 'gguf', repeat('d', 64)) $$,
  '42501', null, 'nor pin an artifact');

select tests.as_postgres();
update public.model_checks set state_since = now() - interval '2 hours' where state = 'failed';  -- failed a while ago
select tests.as_user('alice');
select results_eq($$ select c.state, e.detail ->> 'reason' from public.model_checks c join public.model_challenges e using (node_id) order by e.id desc limit 1 $$,
  $$ values ('failed'::text, 'canned'::text) $$, 'the owner of a failed node sees its state and the evidence');
select throws_ok($$ update public.model_checks set state = 'verified', evidence = -5 $$, '42501', null,
  'an owner cannot declare their node verified');
select throws_ok($$ update public.model_checks set failures = 0 $$, '42501', null, 'nor erase its failures');
select throws_ok($$ update public.model_checks set state = 'unverified', evidence = 0, next_challenge_at = now() + interval '1 day' $$,
  '42501', null, 'nor put off its next challenge when starting over');
select results_eq($$ select state from public.request_verification((select id from public.nodes where name = 'alice-4090')) $$,
  array['unverified'], 'the owner asks again for the failed model: it starts over');
select results_eq($$ select state, evidence from public.model_checks $$, $$ values ('unverified'::text, 0::float8) $$,
  'unverified, with no evidence');

select * from finish();
rollback;
