-- Test helpers for NeuralGrid's pgTAP tests (`supabase test db`, and tests/supabase/test_pgtap.py).
--
-- pg_prove runs the files of this directory in name order, so this one runs first: it creates the
-- schema `tests` and its functions, outside any transaction, so that the files after it can use them
-- (each of those runs in a transaction it rolls back, and leaves nothing behind). It can run again:
-- every statement replaces what it creates.
--
-- The helpers act as the roles Supabase's Data API uses, as PostgREST does for a request: they set
-- the role and `request.jwt.claims` for the rest of the transaction (auth.uid() and auth.role() read
-- the claims).
--   tests.create_user(handle)   a user in auth.users, known by its handle; returns its id
--   tests.user_id(handle)       the id of a user created so
--   tests.as_user(handle)       authenticated, as that user
--   tests.as_anon()             anon (a request with the publishable/anon key and no user)
--   tests.as_service_role()     service_role (the gateway's key)
--   tests.as_postgres()         back to the session's own role (postgres), with no claims
--   tests.as_token(role, claims) a role with the claims given, as they are
--   tests.on_topic(topic)       the Realtime topic being authorized (realtime.topic())
--   tests.columns_granted(role, table, privilege), tests.columns_withheld(...)
--                               the columns a role may, or may not, select, insert or update

create extension if not exists pgtap with schema extensions;

create schema if not exists tests;
comment on schema tests is 'Helpers of the pgTAP tests in supabase/tests/database (000_test_helpers.sql).';
grant usage on schema tests to anon, authenticated, service_role;

create or replace function tests.create_user(p_handle text)
returns uuid
language sql
set search_path = ''
as $$
  insert into auth.users (id, email, raw_user_meta_data)
  values (gen_random_uuid(), p_handle || '@pgtap.neuralgrid.test', jsonb_build_object('pgtap_handle', p_handle))
  returning id
$$;
comment on function tests.create_user(text) is 'Creates a user in auth.users known to the tests by p_handle; returns its id.';

-- A definer, so that it also answers after a switch to a role that cannot read auth.users.
create or replace function tests.user_id(p_handle text)
returns uuid
language plpgsql
stable
security definer
set search_path = ''
as $$
declare
  v_id uuid;
begin
  select u.id into v_id from auth.users u where u.raw_user_meta_data ->> 'pgtap_handle' = p_handle;
  if v_id is null then
    raise exception 'no test user "%": create it with tests.create_user()', p_handle;
  end if;
  return v_id;
end;
$$;
comment on function tests.user_id(text) is 'The id of the test user created as p_handle.';

create or replace function tests.as_user(p_handle text)
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_id uuid := tests.user_id(p_handle);
begin
  perform set_config('role', 'authenticated', true);
  perform set_config('request.jwt.claims',
                     jsonb_build_object('sub', v_id, 'role', 'authenticated', 'aud', 'authenticated')::text, true);
end;
$$;
comment on function tests.as_user(text) is 'For the rest of the transaction: role authenticated, with the JWT claims of the test user p_handle.';

create or replace function tests.as_anon()
returns void
language plpgsql
set search_path = ''
as $$
begin
  perform set_config('role', 'anon', true);
  perform set_config('request.jwt.claims', '{"role": "anon"}', true);
end;
$$;
comment on function tests.as_anon() is 'For the rest of the transaction: role anon, with the claims of the anon key.';

create or replace function tests.as_service_role()
returns void
language plpgsql
set search_path = ''
as $$
begin
  perform set_config('role', 'service_role', true);
  perform set_config('request.jwt.claims', '{"role": "service_role"}', true);
end;
$$;
comment on function tests.as_service_role() is 'For the rest of the transaction: role service_role, with the claims of the service key.';

create or replace function tests.as_postgres()
returns void
language plpgsql
set search_path = ''
as $$
begin
  perform set_config('role', 'none', true);
  perform set_config('request.jwt.claims', '', true);
end;
$$;
comment on function tests.as_postgres() is 'For the rest of the transaction: the session''s own role (postgres), with no JWT claims.';

create or replace function tests.as_token(p_role text, p_claims jsonb)
returns void
language plpgsql
set search_path = ''
as $$
begin
  perform set_config('role', p_role, true);
  perform set_config('request.jwt.claims', p_claims::text, true);
end;
$$;
comment on function tests.as_token(text, jsonb) is 'For the rest of the transaction: role p_role with the claims p_claims as they are (tokens without a user, or with mixed-up claims).';

create or replace function tests.on_topic(p_topic text)
returns void
language sql
set search_path = ''
as $$
  select set_config('realtime.topic', p_topic, true) is null
$$;
comment on function tests.on_topic(text) is 'For the rest of the transaction: the Realtime topic being authorized (realtime.topic()), as Supabase Realtime sets it.';

create or replace function tests.columns_granted(p_role name, p_table regclass, p_privilege text)
returns setof name
language sql
stable
set search_path = ''
as $$
  select a.attname from pg_catalog.pg_attribute a
  where a.attrelid = p_table and a.attnum > 0 and not a.attisdropped
    and pg_catalog.has_column_privilege(p_role, p_table, a.attnum, p_privilege)
$$;
comment on function tests.columns_granted(name, regclass, text) is 'The columns of p_table on which p_role has p_privilege (SELECT, INSERT, UPDATE), granted by column or for the whole table.';

create or replace function tests.columns_withheld(p_role name, p_table regclass, p_privilege text)
returns setof name
language sql
stable
set search_path = ''
as $$
  select a.attname from pg_catalog.pg_attribute a
  where a.attrelid = p_table and a.attnum > 0 and not a.attisdropped
    and not pg_catalog.has_column_privilege(p_role, p_table, a.attnum, p_privilege)
$$;
comment on function tests.columns_withheld(name, regclass, text) is 'The columns of p_table on which p_role lacks p_privilege.';

grant execute on all functions in schema tests to anon, authenticated, service_role;

-- The helpers do what they say.
begin;
select plan(16);

select tests.create_user('helper_alice');
select tests.create_user('helper_bob');

select tests.as_user('helper_alice');
select is(current_user::text, 'authenticated', 'as_user() acts as authenticated');
select is(auth.uid(), tests.user_id('helper_alice'), 'as_user() sets the user''s id as auth.uid()');
select is(auth.role(), 'authenticated', 'as_user() sets the role claim');
select tests.as_user('helper_bob');
select is(auth.uid(), tests.user_id('helper_bob'), 'as_user() switches from one user to another');
select isnt(tests.user_id('helper_alice'), tests.user_id('helper_bob'), 'each test user has an id of its own');

select tests.as_anon();
select is(current_user::text, 'anon', 'as_anon() acts as anon');
select is(auth.uid(), null, 'as anon there is no auth.uid()');
select is(auth.role(), 'anon', 'as_anon() sets the anon role claim');

select tests.as_service_role();
select is(current_user::text, 'service_role', 'as_service_role() acts as service_role');
select is(auth.role(), 'service_role', 'as_service_role() sets the service_role claim');

select tests.as_token('authenticated', '{"role": "authenticated"}');
select is(current_user::text, 'authenticated', 'as_token() acts as the role given');
select is(auth.uid(), null, 'as_token() sets the claims given, here without a user');

select tests.on_topic('owner:someone');
select is(realtime.topic(), 'owner:someone', 'on_topic() sets the Realtime topic being authorized');

select tests.as_postgres();
select is(current_user, session_user, 'as_postgres() returns to the session''s role');
select set_eq($$ select * from tests.columns_withheld('authenticated', 'public.api_keys', 'SELECT') $$,
  array['key_hash']::name[], 'columns_withheld() lists the columns a role may not read');
select throws_ok($$ select tests.user_id('nobody') $$, 'P0001',
                 'no test user "nobody": create it with tests.create_user()',
                 'user_id() refuses a handle no user was created with');

select * from finish();
rollback;
