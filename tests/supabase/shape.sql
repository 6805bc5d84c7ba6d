-- A database shaped the way Supabase's Postgres image and services leave a project's database, for
-- the test suite: written for NeuralGrid from what supabase/postgres (init scripts and migrations) and
-- supabase/realtime (its migrations) set up, reduced to what touches our migrations and gateway.
-- Run as the bootstrap superuser supabase_admin on a fresh cluster. Objects that Supabase's services
-- create (auth.users, realtime.messages, realtime.send(), ...) come from NeuralGrid's compatibility
-- layer first (same definitions the embedded stack uses), then move to the owners Supabase gives them.
--
-- What it reproduces:
-- * postgres is not a superuser: CREATEDB CREATEROLE REPLICATION BYPASSRLS, a member of the API roles;
-- * auth (schema, users, functions) is owned by supabase_auth_admin; postgres has ALL on its tables;
-- * realtime.messages and realtime's functions are owned by supabase_realtime_admin; postgres may
--   select, insert and update messages, but only the owner may create policies on it;
-- * the supabase_realtime publication is owned by postgres;
-- * realtime.subscription exists (Supabase's Realtime reads the WAL; no NeuralGrid feed is installed);
-- * default privileges in public for postgres and supabase_admin grant all to the API roles.

create role postgres login nosuperuser createdb createrole replication bypassrls;
create role supabase_auth_admin login noinherit createrole;
create role supabase_realtime_admin login noinherit createrole replication;
create role supabase_storage_admin login noinherit createrole;
create role dashboard_user nosuperuser createdb createrole replication;
grant all on database postgres to postgres;
grant create on database postgres to supabase_realtime_admin;

-- (NeuralGrid's compatibility layer runs here, as supabase_admin: see tests/supabase/shaped.py.)
-- @@after-compat

grant anon, authenticated, service_role to postgres;
grant anon, authenticated, service_role to supabase_realtime_admin;
grant usage, create on schema public to postgres;
grant all on schema extensions to postgres, dashboard_user;
alter default privileges for role postgres in schema public grant all on tables to postgres, anon, authenticated, service_role;
alter default privileges for role postgres in schema public grant all on functions to postgres, anon, authenticated, service_role;
alter default privileges for role postgres in schema public grant all on sequences to postgres, anon, authenticated, service_role;
alter role anon set statement_timeout = '3s';
alter role authenticated set statement_timeout = '8s';

-- auth: Supabase Auth's own schema.
alter schema auth owner to supabase_auth_admin;
alter table auth.users owner to supabase_auth_admin;
alter function auth.uid() owner to supabase_auth_admin;
alter function auth.role() owner to supabase_auth_admin;
alter function auth.jwt() owner to supabase_auth_admin;
grant usage on schema auth to anon, authenticated, service_role, postgres, supabase_realtime_admin;
grant all on all tables in schema auth to postgres, dashboard_user;
grant all on all routines in schema auth to postgres, dashboard_user;

-- realtime: Supabase Realtime's schema.
alter table realtime.messages owner to supabase_realtime_admin;
alter function realtime.topic() owner to supabase_realtime_admin;
alter function realtime.send(jsonb, text, text, boolean) owner to supabase_realtime_admin;
alter function realtime.broadcast_changes(text, text, text, text, text, record, record, text)
  owner to supabase_realtime_admin;
grant usage on schema realtime to postgres, anon, authenticated, service_role;
grant all on schema realtime to supabase_realtime_admin with grant option;
grant select, insert, update on realtime.messages to postgres, anon, authenticated, service_role;
grant delete, truncate, references, trigger on realtime.messages to postgres;
create table realtime.subscription (
  id bigint generated always as identity primary key,
  subscription_id uuid not null,
  entity regclass not null,
  filters text[] not null default '{}',
  claims jsonb not null,
  created_at timestamp not null default timezone('utc', now())
);
alter table realtime.subscription owner to supabase_realtime_admin;
grant select on realtime.subscription to postgres, anon, authenticated, service_role;

alter publication supabase_realtime owner to postgres;
