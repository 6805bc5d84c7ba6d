-- The map at any size (20261204005000_map_summary.sql): anyone reads the fleet's summary, a box of the
-- map and the table a page at a time through the Data API, never a node's endpoint, owner or secret;
-- only the platform sends the summary on map:summary (private.send_map_summary(), as service_role or
-- the gateways' postgres), and nobody else writes what viewers were last sent (public.map_feed).
begin;
create extension if not exists pgtap with schema extensions;
select plan(15);

select tests.create_user('alice');
insert into public.nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region, latitude, longitude,
                          endpoint_url, secret_hash, status)
values (tests.user_id('alice'), 'alice-4090', 'RTX 4090', 24, 82.6, 0.40, 'eu-west', 48.85, 2.35,
        'https://alice-gpu.example.com:8000', sha256('alice secret'), 'online'),
       (null, 'platform-a100', 'A100 80GB', 80, 312, 1.60, 'us-east', 40.71, -74.0,
        'https://platform.example.com:8000', sha256('platform secret'), 'offline');

-- anon reads --------------------------------------------------------------------------------------------
select tests.as_anon();
select is((select (public.map_summary() -> 'total')), '[1, 0, 0, 1]'::jsonb,
  'anon reads the fleet''s summary: online, busy, draining, offline');
select is((select jsonb_array_length(public.map_view(-180, -90, 180, 90) -> 'nodes')), 2,
  'anon reads the nodes in a box of the map');
select is((select public.node_list('alice') -> 'total'), '1'::jsonb, 'anon searches the table');
select is((select count(*)::integer from jsonb_array_elements(public.node_list() -> 'nodes') n
           where n ?| array['endpoint_url', 'owner_id', 'secret_hash']), 0,
  'the table''s rows carry no endpoint, owner or secret');
select is((select count(*)::integer from jsonb_array_elements(public.map_view(-180, -90, 180, 90) -> 'nodes') n
           where n ?| array['endpoint_url', 'owner_id', 'secret_hash']), 0,
  'nor do the map''s');
select lives_ok($$ select seq, summary, checked_at, sent_at from public.map_feed $$,
  'anon reads what viewers were last sent');
select throws_ok($$ update public.map_feed set seq = 99 $$, '42501', 'permission denied for table map_feed',
  'anon cannot change it');
select throws_ok($$ select private.send_map_summary() $$, '42501', null, 'anon cannot send the summary');
select throws_ok($$ select public.node_list('', 'secret_hash') $$, '22023', null,
  'the table sorts by the map''s columns only');

-- authenticated ------------------------------------------------------------------------------------------
select tests.as_user('alice');
select is((select (public.map_summary() -> 'regions' -> 'eu-west')), '[1, 0, 0, 0]'::jsonb,
  'a signed-in user reads the same summary');
select throws_ok($$ select private.send_map_summary() $$, '42501', null, 'and cannot send it either');
select throws_ok($$ insert into public.map_feed (one_row) values (true) $$, '42501',
  'permission denied for table map_feed', 'nor write what viewers were sent');

-- the platform ----------------------------------------------------------------------------------------------
select tests.as_service_role();
select ok(private.send_map_summary(), 'service_role sends the summary when due');
select is((select seq from public.map_feed), 1::bigint, 'numbered, and kept');
select ok(not private.send_map_summary(), 'at most once in 950 ms, whoever asks');

select * from finish();
rollback;
