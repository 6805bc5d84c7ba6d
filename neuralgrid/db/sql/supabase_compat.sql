-- Supabase compatibility layer for a plain PostgreSQL server.
--
-- Creates, where missing, what Supabase's Postgres image and services provide and our migrations use:
-- the API roles, the auth/extensions/realtime schemas, auth.users, auth.uid()/role()/jwt() (reading
-- request.jwt.claims as Supabase's do), realtime.messages/send()/broadcast_changes()/topic(), and the
-- supabase_realtime publication. Every statement is idempotent. It is never applied to a database that
-- already has these (a Supabase project): the runner checks first, see neuralgrid/db/migrate.py.

-- Roles -----------------------------------------------------------------------------------------------
do $$
declare
  r text;
begin
  foreach r in array array['anon', 'authenticated', 'service_role'] loop
    if not exists (select from pg_roles where rolname = r) then
      execute format('create role %I nologin noinherit', r);
    end if;
  end loop;
  if not exists (select from pg_roles where rolname = 'authenticator') then
    create role authenticator login noinherit;
  end if;
end
$$;

alter role service_role bypassrls;
grant anon, authenticated, service_role to authenticator;

-- Schemas ---------------------------------------------------------------------------------------------
create schema if not exists extensions;
create schema if not exists auth;
create schema if not exists realtime;

grant usage on schema public, extensions to anon, authenticated, service_role;
grant usage on schema auth, realtime to anon, authenticated, service_role;

-- Supabase grants the API roles everything in `public` by default and relies on RLS; do the same so
-- that migrations behave identically on both targets.
alter default privileges in schema public grant all on tables to anon, authenticated, service_role;
alter default privileges in schema public grant all on sequences to anon, authenticated, service_role;
alter default privileges in schema public grant all on functions to anon, authenticated, service_role;

-- auth ------------------------------------------------------------------------------------------------
create table if not exists auth.users (
  id uuid primary key default gen_random_uuid(),
  email text unique,
  role text not null default 'authenticated',
  raw_app_meta_data jsonb not null default '{}',
  raw_user_meta_data jsonb not null default '{}',
  created_at timestamptz not null default now(),
  updated_at timestamptz not null default now()
);
comment on table auth.users is 'Users of the platform (the subset of Supabase Auth''s table that NeuralGrid uses).';
grant select on auth.users to service_role;

create or replace function auth.jwt() returns jsonb
language sql stable
as $$
  select coalesce(
    nullif(current_setting('request.jwt.claim', true), ''),
    nullif(current_setting('request.jwt.claims', true), '')
  )::jsonb
$$;
comment on function auth.jwt() is 'The claims of the request''s JWT, as set by PostgREST/Realtime in request.jwt.claims.';

create or replace function auth.uid() returns uuid
language sql stable
as $$
  select coalesce(
    nullif(current_setting('request.jwt.claim.sub', true), ''),
    (nullif(current_setting('request.jwt.claims', true), '')::jsonb ->> 'sub')
  )::uuid
$$;
comment on function auth.uid() is 'The user id (sub claim) of the request''s JWT, or null.';

create or replace function auth.role() returns text
language sql stable
as $$
  select coalesce(
    nullif(current_setting('request.jwt.claim.role', true), ''),
    (nullif(current_setting('request.jwt.claims', true), '')::jsonb ->> 'role')
  )::text
$$;
comment on function auth.role() is 'The role claim of the request''s JWT, or null.';

grant execute on function auth.jwt(), auth.uid(), auth.role() to anon, authenticated, service_role;

-- realtime --------------------------------------------------------------------------------------------
create table if not exists realtime.messages (
  id uuid not null default gen_random_uuid(),
  topic text not null,
  extension text not null,
  payload jsonb,
  event text,
  private boolean default false,
  updated_at timestamp not null default now(),
  inserted_at timestamp not null default now(),
  primary key (id, inserted_at)
);
comment on table realtime.messages is 'Broadcast messages sent from the database; RLS on it authorizes private topics.';
alter table realtime.messages enable row level security;
grant select, insert on realtime.messages to anon, authenticated, service_role;

create or replace function realtime.topic() returns text
language sql stable
as $$
  select nullif(current_setting('realtime.topic', true), '')::text
$$;
comment on function realtime.topic() is 'The topic being authorized, for use in RLS policies on realtime.messages.';

create or replace function realtime.send(payload jsonb, event text, topic text, private boolean default true)
returns void
language plpgsql
as $$
begin
  insert into realtime.messages (payload, event, topic, private, extension)
  values (payload, event, topic, private, 'broadcast');
exception when others then
  -- As on Supabase: a failed broadcast must never fail the transaction that sent it.
  raise warning 'realtime.send failed: %', sqlerrm;
end;
$$;
comment on function realtime.send(jsonb, text, text, boolean) is 'Broadcasts payload as event on topic (private topics are authorized by RLS on realtime.messages).';

create or replace function realtime.broadcast_changes(
  topic_name text, event_name text, operation text, table_name text, table_schema text,
  new record, old record, level text default 'ROW'
) returns void
language plpgsql
as $$
begin
  if level is distinct from 'ROW' then
    raise exception 'realtime.broadcast_changes works per row, not per statement';
  end if;
  if operation not in ('INSERT', 'UPDATE', 'DELETE') then
    raise exception 'unexpected operation %', operation;
  end if;
  perform realtime.send(
    jsonb_build_object(
      'old_record', case when old is null then null else to_jsonb(old) end,
      'record', case when new is null then null else to_jsonb(new) end,
      'operation', operation, 'table', table_name, 'schema', table_schema
    ),
    event_name, topic_name
  );
end;
$$;
comment on function realtime.broadcast_changes(text, text, text, text, text, record, record, text) is 'Broadcasts a row change (from a trigger) on topic_name, as Supabase''s Broadcast from Database does.';

grant execute on function realtime.topic(), realtime.send(jsonb, text, text, boolean),
  realtime.broadcast_changes(text, text, text, text, text, record, record, text)
  to anon, authenticated, service_role;

do $$
begin
  if not exists (select from pg_publication where pubname = 'supabase_realtime') then
    create publication supabase_realtime;
  end if;
end
$$;
