-- Realtime's private topics (RLS on realtime.messages, checked by Supabase Realtime as the subscriber
-- with realtime.topic set): a signed-in user receives and sends on their own owner:<id> and jobs:<id>
-- topics only; anon on none. What the database broadcasts: the public node-map topic carries a node's
-- public columns only, the owner's topic the whole row but its secret.
begin;
create extension if not exists pgtap with schema extensions;
select plan(16);

select tests.create_user('alice');
select tests.create_user('bob');

insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url, secret_hash, status)
values (tests.user_id('alice'), 'alice-4090', 'RTX 4090', 24, 82.6, 0.40, 'eu-west', 'https://alice.example.com', sha256('a'), 'online'),
       (tests.user_id('bob'), 'bob-a100', 'A100 80GB', 80, 312, 1.60, 'us-east', 'https://bob.example.com', sha256('b'), 'online');
insert into public.jobs (owner_id, model_id, policy, min_vram_gb, node_id)
select tests.user_id('bob'), 'meta-llama/Llama-3.1-8B-Instruct', 'balanced', 18, id from public.nodes where name = 'alice-4090';
update public.jobs set status = 'succeeded', finished_at = now() where owner_id = tests.user_id('bob');

select policies_are('realtime', 'messages', array[
  'Users receive broadcasts on their own private topics', 'Users broadcast on their own private topics'
]);

-- What is broadcast -------------------------------------------------------------------------------------
select results_eq($$ select private, payload -> 'node' ?| array['endpoint_url', 'owner_id', 'secret_hash']
                     from realtime.messages where topic = 'node-map' and payload -> 'node' ->> 'name' = 'alice-4090' $$,
  $$ values (false, false) $$,
  'a new node is broadcast on the public node-map topic without its endpoint, owner or secret');
select results_eq($$ select private, payload -> 'node' ? 'secret_hash', payload -> 'node' ->> 'endpoint_url'
                     from realtime.messages where topic = 'owner:' || tests.user_id('alice') $$,
  $$ values (true, false, 'https://alice.example.com') $$,
  'and on its owner''s private topic with the whole row but its secret');
select results_eq($$ select private, event, payload -> 'job' ->> 'status'
                     from realtime.messages where topic = 'jobs:' || tests.user_id('bob') $$,
  $$ values (true, 'job_succeeded', 'succeeded') $$, 'a finished job is broadcast on its requester''s private topic');

-- Receiving ----------------------------------------------------------------------------------------------
select tests.as_user('alice');
select tests.on_topic('owner:' || tests.user_id('alice'));
select results_eq($$ select payload -> 'node' ->> 'name' from realtime.messages where topic = realtime.topic() $$,
  array['alice-4090'], 'an owner receives the broadcasts on their own owner topic');
select tests.on_topic('owner:' || tests.user_id('bob'));
select is_empty($$ select id from realtime.messages where topic = realtime.topic() $$,
  'an owner receives nothing on another owner''s topic');
select tests.on_topic('jobs:' || tests.user_id('bob'));
select is_empty($$ select id from realtime.messages where topic = realtime.topic() $$,
  'a node''s owner receives nothing on the topic of the jobs others ran on it');

select tests.as_user('bob');
select tests.on_topic('jobs:' || tests.user_id('bob'));
select results_eq($$ select event from realtime.messages where topic = realtime.topic() $$, array['job_succeeded'],
  'a requester receives their job''s end on their own jobs topic');

select tests.as_anon();
select tests.on_topic('owner:' || tests.user_id('alice'));
select is_empty($$ select id from realtime.messages where topic = realtime.topic() $$,
  'anon receives nothing on a private owner topic');
select tests.on_topic('jobs:' || tests.user_id('bob'));
select is_empty($$ select id from realtime.messages where topic = realtime.topic() $$,
  'anon receives nothing on a private jobs topic');

-- Sending ------------------------------------------------------------------------------------------------
select tests.as_user('alice');
select tests.on_topic('owner:' || tests.user_id('alice'));
select lives_ok($$ insert into realtime.messages (topic, extension, event, payload, private)
                   values (realtime.topic(), 'broadcast', 'note', '{"hello": "me"}', true) $$,
  'a user broadcasts on their own owner topic');
select tests.on_topic('jobs:' || tests.user_id('alice'));
select lives_ok($$ insert into realtime.messages (topic, extension, event, payload, private)
                   values (realtime.topic(), 'broadcast', 'note', '{"hello": "me"}', true) $$,
  'and on their own jobs topic');
select tests.on_topic('owner:' || tests.user_id('bob'));
select throws_ok($$ insert into realtime.messages (topic, extension, event, payload, private)
                    values (realtime.topic(), 'broadcast', 'node_update', '{"node": {"status": "offline"}}', true) $$,
  '42501', 'new row violates row-level security policy for table "messages"',
  'a user cannot broadcast on another owner''s topic (and fake their node''s status)');
select tests.on_topic('jobs:' || tests.user_id('bob'));
select throws_ok($$ insert into realtime.messages (topic, extension, event, payload, private)
                    values (realtime.topic(), 'broadcast', 'job_failed', '{}', true) $$,
  '42501', 'new row violates row-level security policy for table "messages"',
  'a user cannot broadcast on another user''s jobs topic');

select tests.as_anon();
select tests.on_topic('owner:' || tests.user_id('alice'));
select throws_ok($$ insert into realtime.messages (topic, extension, event, payload, private)
                    values (realtime.topic(), 'broadcast', 'note', '{}', true) $$,
  '42501', 'new row violates row-level security policy for table "messages"', 'anon cannot broadcast on a private topic');

select tests.as_user('alice');
select tests.on_topic('owner:' || tests.user_id('alice'));
select results_eq($$ select count(*)::integer from realtime.messages where topic = realtime.topic() $$, array[2],
  'the owner receives what they sent on their topic, with the node''s broadcast');

select * from finish();
rollback;
