-- The catalog the platform publishes (models, platform_settings, matching_policies): anyone reads it,
-- through the Data API as anon or signed in; only the service changes it.
begin;
create extension if not exists pgtap with schema extensions;
select plan(22);

select tests.create_user('alice');

-- anon -----------------------------------------------------------------------------------------------
select tests.as_anon();
select isnt_empty($$ select id, min_vram_gb, kind from public.models $$, 'anon reads the model catalog');
select isnt_empty($$ select heartbeat_interval_s, platform_fee_rate from public.platform_settings $$,
  'anon reads the platform settings');
select isnt_empty($$ select * from public.matching_policies where name = 'balanced' $$,
  'anon reads the matching policies');
select throws_ok($$ insert into public.models (id, min_vram_gb) values ('pgtap/model', 8) $$,
  '42501', 'permission denied for table models', 'anon cannot add a model');
select throws_ok($$ update public.platform_settings set platform_fee_rate = 0 $$,
  '42501', 'permission denied for table platform_settings', 'anon cannot change the platform fee');
select throws_ok($$ delete from public.matching_policies $$,
  '42501', 'permission denied for table matching_policies', 'anon cannot delete matching policies');

-- authenticated ----------------------------------------------------------------------------------------
select tests.as_user('alice');
select isnt_empty($$ select id, input_usd_per_mtok, output_usd_per_mtok from public.models $$,
  'a signed-in user reads the model catalog');
select isnt_empty($$ select platform_fee_rate from public.platform_settings $$,
  'a signed-in user reads the platform settings');
select isnt_empty($$ select name, fit, price from public.matching_policies $$,
  'a signed-in user reads the matching policies');
select throws_ok($$ insert into public.models (id, min_vram_gb) values ('pgtap/model', 8) $$,
  '42501', 'permission denied for table models', 'a signed-in user cannot add a model');
select throws_ok($$ update public.models set input_usd_per_mtok = 0 $$,
  '42501', 'permission denied for table models', 'a signed-in user cannot change model prices');
select throws_ok($$ delete from public.models $$,
  '42501', 'permission denied for table models', 'a signed-in user cannot delete models');
select throws_ok($$ update public.platform_settings set platform_fee_rate = 0 $$,
  '42501', 'permission denied for table platform_settings', 'a signed-in user cannot change the platform fee');
select throws_ok($$ insert into public.matching_policies (name, description) values ('mine', 'mine') $$,
  '42501', 'permission denied for table matching_policies', 'a signed-in user cannot add a matching policy');
select throws_ok($$ update public.matching_policies set price = 1 $$,
  '42501', 'permission denied for table matching_policies', 'a signed-in user cannot change a matching policy');

-- service_role -----------------------------------------------------------------------------------------
select tests.as_service_role();
select lives_ok($$ insert into public.models (id, min_vram_gb, kind) values ('pgtap/embedder', 2, 'embedding') $$,
  'service_role adds a model');
select lives_ok($$ update public.platform_settings set platform_fee_rate = 0.2 $$,
  'service_role changes the platform fee');
select lives_ok($$ update public.matching_policies set description = 'changed by pgtap' where name = 'balanced' $$,
  'service_role changes a matching policy');

-- What service_role wrote is what everyone reads.
select tests.as_anon();
select is((select kind from public.models where id = 'pgtap/embedder'), 'embedding',
  'anon reads the model service_role added');
select is((select platform_fee_rate from public.platform_settings), 0.2000::numeric(5, 4),
  'anon reads the fee service_role set');
select tests.as_user('alice');
select is((select description from public.matching_policies where name = 'balanced'), 'changed by pgtap',
  'a signed-in user reads the policy service_role changed');
select tests.as_service_role();
select lives_ok($$ delete from public.models where id = 'pgtap/embedder' $$, 'service_role deletes a model');

select * from finish();
rollback;
