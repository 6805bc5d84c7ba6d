-- API keys: a signed-in user creates keys with create_api_key() (the key is shown once; only its hash
-- is kept), sees only their own, may rename or revoke them and nothing more; nobody but the service
-- reads a key's hash or changes its limits and spend. anon has no access at all.
begin;
create extension if not exists pgtap with schema extensions;
select plan(37);

select tests.create_user('alice');
select tests.create_user('bob');

-- The keys create_api_key() returns, kept for the checks below (shown once: nowhere else to read them).
create temporary table created_keys (handle text, id uuid, api_key text, prefix text);
grant all on created_keys to anon, authenticated, service_role;

-- create_api_key() ----------------------------------------------------------------------------------
select tests.as_anon();
select throws_ok($$ select * from public.create_api_key('anon key') $$,
  '42501', 'permission denied for function create_api_key', 'anon cannot create an API key');

select tests.as_user('alice');
select lives_ok($$ insert into created_keys select 'alice', k.* from public.create_api_key('alice laptop', 600, null, 5) k $$,
  'a signed-in user creates an API key');
select lives_ok($$ insert into created_keys select 'alice', k.* from public.create_api_key('alice server') k $$,
  'and a second one');
select tests.as_user('bob');
select lives_ok($$ insert into created_keys select 'bob', k.* from public.create_api_key('bob ci') k $$,
  'another user creates theirs');

select tests.as_postgres();
select ok((select bool_and(api_key ~ '^ng-[0-9a-f]{64}$' and prefix = left(api_key, 11)) from created_keys),
  'each new key is ng- and 64 hex digits, with its first 11 characters as its prefix');
select is((select count(distinct api_key)::integer from created_keys), 3, 'each key is new');
select is_empty($$ select c.handle from created_keys c join public.api_keys k on k.id = c.id
                   where k.key_hash is distinct from sha256(convert_to(c.api_key, 'UTF8')) $$,
  'what is stored of each key is its SHA-256 hash');
select is_empty($$ select k.id from public.api_keys k join created_keys c on c.api_key = any (array[k.name, k.prefix, encode(k.key_hash, 'escape')]) $$,
  'no key is stored in the clear');
select results_eq($$ select k.owner_id, k.rpm_limit, k.budget_usd from public.api_keys k
                     join created_keys c on c.id = k.id where k.name = 'alice laptop' $$,
  $$ values (tests.user_id('alice'), 600, 5.0000::numeric(12, 4)) $$,
  'a key belongs to the user who created it, with the limits they asked for');

select tests.as_token('authenticated', '{"role": "authenticated"}');
select throws_ok($$ select * from public.create_api_key('nobody''s key') $$,
  '42501', 'only a signed-in user or the service can create API keys',
  'a token without a user cannot create a key that belongs to nobody');

select tests.as_service_role();
select lives_ok($$ insert into created_keys select 'service', k.* from public.create_api_key('service key') k $$,
  'service_role creates a key');
select results_eq($$ select k.owner_id from public.api_keys k join created_keys c using (id) where c.handle = 'service' $$,
  array[null::uuid], 'a key service_role creates belongs to no user');

-- Reading keys ---------------------------------------------------------------------------------------
select tests.as_user('alice');
select set_eq($$ select name from public.api_keys $$, array['alice laptop', 'alice server'],
  'a user sees their own keys, and only those');
select throws_ok($$ select key_hash from public.api_keys $$,
  '42501', 'permission denied for table api_keys', 'a user cannot read the hash of a key, even their own');
select throws_ok($$ select * from public.api_keys $$,
  '42501', 'permission denied for table api_keys', 'a user cannot select every column of api_keys');
select tests.as_user('bob');
select set_eq($$ select name from public.api_keys $$, array['bob ci'], 'the other user sees only theirs');
select is_empty($$ select name from public.api_keys where owner_id = tests.user_id('alice') $$,
  'a user cannot find another user''s keys by owner');

-- Changing keys --------------------------------------------------------------------------------------
select tests.as_user('alice');
select results_eq($$ update public.api_keys set revoked_at = now() where name = 'alice server' returning name $$,
  array['alice server'], 'a user revokes their own key');
select results_eq($$ update public.api_keys set name = 'alice desktop' where name = 'alice laptop' returning name $$,
  array['alice desktop'], 'a user renames their own key');
select is_empty($$ update public.api_keys set revoked_at = now() where id = (select id from created_keys where handle = 'bob')
                   returning id $$,
  'a user''s revocation of another user''s key changes nothing');
select throws_ok($$ update public.api_keys set budget_usd = 1000 where name = 'alice desktop' $$,
  '42501', 'permission denied for table api_keys', 'a user cannot raise their key''s budget');
select throws_ok($$ update public.api_keys set rpm_limit = 100000 where name = 'alice desktop' $$,
  '42501', 'permission denied for table api_keys', 'a user cannot raise their key''s rate limit');
select throws_ok($$ update public.api_keys set spent_usd = 0 where name = 'alice desktop' $$,
  '42501', 'permission denied for table api_keys', 'a user cannot reset what their key has spent');
select throws_ok($$ update public.api_keys set owner_id = tests.user_id('bob') where name = 'alice desktop' $$,
  '42501', 'permission denied for table api_keys', 'a user cannot hand their key to another user');
select throws_ok($$ update public.api_keys set key_hash = sha256('chosen') where name = 'alice desktop' $$,
  '42501', 'permission denied for table api_keys', 'a user cannot choose their key''s hash');
select throws_ok($$ insert into public.api_keys (name, prefix, key_hash) values ('forged', 'ng-forged00', sha256('forged')) $$,
  '42501', 'API keys are issued by create_api_key(): a key of one''s own choosing is not accepted',
  'a user cannot insert a key of their choosing');
select throws_ok($$ delete from public.api_keys where name = 'alice desktop' $$,
  '42501', 'permission denied for table api_keys', 'a user cannot delete a key (they revoke it)');

select tests.as_user('bob');
select results_eq($$ select name, revoked_at is null from public.api_keys $$, $$ values ('bob ci', true) $$,
  'the other user''s key is still live and unchanged');
select is_empty($$ update public.api_keys set revoked_at = now() where owner_id = tests.user_id('alice') returning id $$,
  'and that user cannot revoke the first user''s keys either');

-- anon -----------------------------------------------------------------------------------------------
select tests.as_anon();
select throws_ok($$ select id, name from public.api_keys $$,
  '42501', 'permission denied for table api_keys', 'anon cannot read API keys');
select throws_ok($$ update public.api_keys set revoked_at = now() $$,
  '42501', 'permission denied for table api_keys', 'anon cannot revoke API keys');

-- service_role -----------------------------------------------------------------------------------------
select tests.as_service_role();
select is((select count(*)::integer from public.api_keys k join created_keys c on c.id = k.id
           where k.key_hash = sha256(convert_to(c.api_key, 'UTF8'))), 4,
  'service_role reads key hashes (the gateway looks keys up by hash)');
select results_eq($$ update public.api_keys set spent_usd = spent_usd + 0.25
                     where id = (select id from created_keys where handle = 'bob') returning spent_usd $$,
  array[0.25::numeric(16, 8)], 'service_role charges a key');
select results_eq($$ select name, revoked_at is not null from public.api_keys k join created_keys c using (id)
                     order by name $$,
  $$ values ('alice desktop', false), ('alice server', true), ('bob ci', false), ('service key', false) $$,
  'service_role sees every user''s keys, with the users'' own changes');

-- create_api_key() runs as its caller: the insert it makes is one the caller may make -------------------
select tests.as_postgres();
select isnt_definer('public', 'create_api_key', array['text', 'integer', 'integer', 'numeric'],
  'create_api_key() runs as its caller (no definer the Data API exposes)');
select tests.as_user('alice');
select throws_ok($$ insert into public.api_keys (owner_id, name, prefix, key_hash)
                   select tests.user_id('bob'), 'for bob', k.prefix, sha256(convert_to(k.api_key, 'UTF8'))
                   from created_keys k where k.handle = 'alice' limit 1 $$,
  '42501', 'API keys are issued by create_api_key(): a key of one''s own choosing is not accepted',
  'nor copy a key create_api_key() made earlier, for someone else');
select throws_ok($$ insert into public.api_keys (name, prefix, key_hash, spent_usd) values ('paid', 'ng-paid0001', sha256('paid'), 0) $$,
  '42501', 'permission denied for table api_keys', 'nor set what a key has spent');

select * from finish();
rollback;
