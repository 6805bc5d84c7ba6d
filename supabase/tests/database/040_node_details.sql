-- What hangs off a node: the models it holds (node_models), its status history (node_status_changes),
-- the pre-load requests the platform sent it (prewarm_requests), and the matcher's scores
-- (node_scores, node_base_scores). Anyone sees which models nodes hold; only a node's owner lists or
-- removes them, and only the owner sees its history and pre-load requests; the scores are the
-- service's alone.
begin;
create extension if not exists pgtap with schema extensions;
select plan(31);

select tests.create_user('alice');
select tests.create_user('bob');

insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url, status,
                          last_heartbeat_at)
values
  (tests.user_id('alice'), 'alice-4090', 'RTX 4090', 24, 82.6, 0.40, 'eu-west', 'https://alice.example.com', 'online', now()),
  (tests.user_id('bob'), 'bob-a100', 'A100 80GB', 80, 312, 1.60, 'us-east', 'https://bob.example.com', 'online', now());
insert into public.node_models (node_id, model_id, state)
select n.id, m.model_id, 'loaded'
from public.nodes n
join (values ('alice-4090', 'meta-llama/Llama-3.1-8B-Instruct'), ('bob-a100', 'meta-llama/Llama-3.1-8B-Instruct'),
             ('bob-a100', 'Qwen/Qwen2.5-0.5B-Instruct')) as m (node, model_id) on m.node = n.name;
insert into public.prewarm_requests (node_id, model_id)
select id, 'Qwen/Qwen2.5-0.5B-Instruct' from public.nodes where name in ('alice-4090', 'bob-a100');

-- node_models ----------------------------------------------------------------------------------------
select tests.as_anon();
select set_eq($$ select n.name, nm.model_id from public.node_models nm join public.node_map n on n.id = nm.node_id
                 where n.name in ('alice-4090', 'bob-a100') $$,
  $$ values ('alice-4090', 'meta-llama/Llama-3.1-8B-Instruct'), ('bob-a100', 'meta-llama/Llama-3.1-8B-Instruct'),
            ('bob-a100', 'Qwen/Qwen2.5-0.5B-Instruct') $$,
  'anon sees which models each node holds');
select throws_ok($$ insert into public.node_models (node_id, model_id)
                    select id, 'mistralai/Mistral-7B-Instruct-v0.3' from public.nodes where name = 'bob-a100' $$,
  '42501', 'permission denied for table node_models', 'anon cannot list a model on a node');
select throws_ok($$ update public.node_models set state = 'available' $$,
  '42501', 'permission denied for table node_models', 'anon cannot change a node''s models');
select throws_ok($$ delete from public.node_models $$,
  '42501', 'permission denied for table node_models', 'anon cannot remove a node''s models');

select tests.as_user('alice');
select lives_ok($$ insert into public.node_models (node_id, model_id, state)
                   select id, 'Qwen/Qwen2.5-0.5B-Instruct', 'available' from public.nodes where name = 'alice-4090' $$,
  'an owner lists a model on their own node');
select throws_ok($$ insert into public.node_models (node_id, model_id)
                    select id, 'mistralai/Mistral-7B-Instruct-v0.3' from public.nodes where name = 'bob-a100' $$,
  '42501', 'new row violates row-level security policy for table "node_models"',
  'an owner cannot list a model on another owner''s node');
select results_eq($$ update public.node_models nm set state = 'loaded' from public.nodes n
                     where n.id = nm.node_id and n.name = 'alice-4090' and nm.model_id = 'Qwen/Qwen2.5-0.5B-Instruct'
                     returning nm.state $$,
  array['loaded'], 'an owner changes the state of a model on their own node');
select is_empty($$ update public.node_models nm set state = 'available' from public.nodes n
                   where n.id = nm.node_id and n.name = 'bob-a100' returning nm.model_id $$,
  'an owner''s update of another owner''s node''s models changes nothing');
select is_empty($$ delete from public.node_models nm using public.nodes n
                   where n.id = nm.node_id and n.name = 'bob-a100' returning nm.model_id $$,
  'an owner''s delete of another owner''s node''s models removes nothing');
select results_eq($$ delete from public.node_models nm using public.nodes n
                     where n.id = nm.node_id and n.name = 'alice-4090'
                       and nm.model_id = 'meta-llama/Llama-3.1-8B-Instruct' returning nm.model_id $$,
  array['meta-llama/Llama-3.1-8B-Instruct'], 'an owner removes a model from their own node');

select tests.as_user('bob');
select set_eq($$ select nm.model_id, nm.state from public.node_models nm join public.nodes n on n.id = nm.node_id
                 where n.owner_id = auth.uid() $$,
  $$ values ('meta-llama/Llama-3.1-8B-Instruct', 'loaded'), ('Qwen/Qwen2.5-0.5B-Instruct', 'loaded') $$,
  'the other owner''s models are untouched');
select set_eq($$ select nm.model_id from public.node_models nm join public.nodes n on n.id = nm.node_id
                 where n.name = 'alice-4090' $$,
  array['Qwen/Qwen2.5-0.5B-Instruct'], 'and the first owner''s changes are seen by others');

-- node_status_changes ---------------------------------------------------------------------------------
select tests.as_user('alice');
select results_eq($$ select c.status from public.node_status_changes c join public.nodes n on n.id = c.node_id
                     where n.name = 'alice-4090' $$,
  array['online'], 'an owner sees their node''s status history');
select is_empty($$ select c.status from public.node_status_changes c join public.nodes n on n.id = c.node_id
                   where n.name = 'bob-a100' $$,
  'an owner sees none of another owner''s node history');
select throws_ok($$ insert into public.node_status_changes (node_id, status)
                    select id, 'online' from public.nodes where name = 'alice-4090' $$,
  '42501', 'permission denied for table node_status_changes', 'an owner cannot write uptime history');
select throws_ok($$ delete from public.node_status_changes $$,
  '42501', 'permission denied for table node_status_changes', 'an owner cannot erase downtime');
select tests.as_anon();
select throws_ok($$ select status from public.node_status_changes $$,
  '42501', 'permission denied for table node_status_changes', 'anon cannot read any node''s history');

-- prewarm_requests ------------------------------------------------------------------------------------
select tests.as_user('alice');
select results_eq($$ select r.model_id, r.outcome from public.prewarm_requests r $$,
  $$ values ('Qwen/Qwen2.5-0.5B-Instruct', 'requested') $$,
  'an owner sees the pre-load requests of their own node, and only those');
select throws_ok($$ update public.prewarm_requests set outcome = 'loaded', answered_at = now() $$,
  '42501', 'permission denied for table prewarm_requests', 'an owner cannot answer a pre-load request by hand');
select tests.as_user('bob');
select results_eq($$ select n.name from public.prewarm_requests r join public.nodes n on n.id = r.node_id $$,
  array['bob-a100'], 'the other owner sees only theirs');
select tests.as_anon();
select throws_ok($$ select model_id from public.prewarm_requests $$,
  '42501', 'permission denied for table prewarm_requests', 'anon cannot read pre-load requests');

-- node_scores, node_base_scores ------------------------------------------------------------------------
select throws_ok($$ select * from public.node_scores $$,
  '42501', 'permission denied for table node_scores', 'anon cannot read the matcher''s scores');
select throws_ok($$ select * from public.node_base_scores $$,
  '42501', 'permission denied for view node_base_scores', 'anon cannot read the base scores');
select tests.as_user('alice');
select throws_ok($$ select * from public.node_scores $$,
  '42501', 'permission denied for table node_scores', 'a signed-in user cannot read the matcher''s scores');
select throws_ok($$ select * from public.node_base_scores $$,
  '42501', 'permission denied for view node_base_scores', 'a signed-in user cannot read the base scores');
select throws_ok($$ delete from public.node_scores $$,
  '42501', 'permission denied for table node_scores', 'a signed-in user cannot tamper with the scores');

select tests.as_service_role();
select isnt_empty($$ select s.base_score from public.node_scores s join public.nodes n on n.id = s.node_id
                     where n.name = 'alice-4090' $$,
  'service_role reads the scores kept for a node');
select isnt_empty($$ select v.base_score from public.node_base_scores v join public.nodes n on n.id = v.node_id
                     where n.name = 'alice-4090' $$,
  'service_role reads the base scores computed for a node');
-- The view's tier_gb calls private.vram_tier() (granted to service_role in 20261129000400).
select lives_ok($$ select tier_gb from public.node_base_scores $$, 'service_role reads every column of the base scores');
select lives_ok($$ select private.refresh_node_scores() $$, 'service_role refreshes the scores itself');
select lives_ok($$ insert into public.node_models (node_id, model_id)
                   select id, 'mistralai/Mistral-7B-Instruct-v0.3' from public.nodes where name = 'bob-a100' $$,
  'service_role lists a model on any node (as the heartbeat does)');

select * from finish();
rollback;
