-- The embedded Realtime server's feed: what Supabase Realtime reads from the WAL, sent here with
-- NOTIFY on the `realtime` channel so that every gateway instance LISTENing receives every change.
--
-- * Row changes of the tables in the `supabase_realtime` publication (postgres_changes): a trigger on
--   each, kept in step with the publication by realtime.sync_change_triggers() (run by an event
--   trigger on publication DDL and after each migration run).
-- * Broadcast from Database: each row inserted into realtime.messages (realtime.send()).
--
-- NOTIFY payloads are limited to 8000 bytes; larger ones are parked in realtime.feed_overflow and
-- only their id is notified. Applied only where Supabase's own Realtime does not run (no
-- realtime.subscription table); every statement is idempotent.

create unlogged table if not exists realtime.feed_overflow (
  id bigint generated always as identity primary key,
  payload jsonb not null,
  created_at timestamptz not null default now()
);
comment on table realtime.feed_overflow is 'Feed notifications too large for NOTIFY; read by id, swept after an hour.';
revoke all on realtime.feed_overflow from public, anon, authenticated;

-- Which published tables some gateway's subscriber watches: the row-change trigger stays silent for the
-- others, so an unwatched table's writes (every claim of a node, say) cost no NOTIFY. Each instance
-- keeps its rows fresh; rows not refreshed for 90 s (an instance that died) no longer count.
create table if not exists realtime.feed_subscriptions (
  relid oid not null,
  instance text not null,
  seen_at timestamptz not null default now(),
  primary key (relid, instance)
);
comment on table realtime.feed_subscriptions is 'Tables watched through postgres_changes, per gateway instance.';
revoke all on realtime.feed_subscriptions from public, anon, authenticated;

create or replace function realtime.feed_notify(payload jsonb) returns void
language plpgsql
set search_path = ''
set jit = off  -- as the platform's functions (20261219000100): a short call, never worth a compile
as $$
declare
  v_text text := payload::text;
  v_id bigint;
begin
  if octet_length(v_text) < 7900 then
    perform pg_notify('realtime', v_text);
  else
    insert into realtime.feed_overflow (payload) values (payload) returning id into v_id;
    perform pg_notify('realtime', jsonb_build_object('k', 'overflow', 'id', v_id)::text);
  end if;
end;
$$;
-- Only the feed's own triggers (security definer) notify the gateways: a payload from anyone else
-- would reach subscribers as a row change or a message (found by a security review).
revoke execute on function realtime.feed_notify(jsonb) from public, anon, authenticated;

create or replace function realtime.feed_row_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  if not exists (select from realtime.feed_subscriptions
                 where relid = tg_relid and seen_at > now() - interval '90 seconds') then
    return null;
  end if;
  perform realtime.feed_notify(jsonb_build_object(
    'k', 'change', 'schema', tg_table_schema, 'table', tg_table_name, 'type', tg_op,
    'commit_timestamp', clock_timestamp(),
    'record', case when tg_op = 'DELETE' then null else to_jsonb(new) end,
    'old_record', case when tg_op = 'INSERT' then null else to_jsonb(old) end));
  return null;
end;
$$;
revoke execute on function realtime.feed_row_change() from public, anon, authenticated;

create or replace function realtime.feed_message() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  perform realtime.feed_notify(jsonb_build_object(
    'k', 'message', 'id', new.id, 'topic', new.topic, 'extension', new.extension, 'event', new.event,
    'private', coalesce(new.private, false), 'payload', new.payload));
  return null;
end;
$$;
revoke execute on function realtime.feed_message() from public, anon, authenticated;

drop trigger if exists realtime_feed on realtime.messages;
create trigger realtime_feed after insert on realtime.messages
  for each row execute function realtime.feed_message();

-- Retention, as Supabase keeps realtime.messages for a few days; the gateway's sweeper calls it.
create or replace function realtime.prune_feed(p_keep interval default interval '3 days') returns integer
language sql
set jit = off
as $$
  with messages as (delete from realtime.messages where inserted_at < localtimestamp - p_keep returning 1),
       overflow as (delete from realtime.feed_overflow where created_at < now() - interval '1 hour' returning 1),
       stale as (delete from realtime.feed_subscriptions where seen_at < now() - interval '5 minutes' returning 1)
  select ((select count(*) from messages) + (select count(*) from overflow) + (select count(*) from stale))::integer
$$;
revoke execute on function realtime.prune_feed(interval) from public, anon, authenticated;

create or replace function realtime.sync_change_triggers() returns void
language plpgsql
as $$
declare
  r record;
begin
  -- Add the trigger to published tables that lack it...
  for r in
    select format('%I.%I', schemaname, tablename) as rel from pg_publication_tables
    where pubname = 'supabase_realtime'
      and not exists (select from pg_trigger t
                      where t.tgrelid = format('%I.%I', schemaname, tablename)::regclass
                        and t.tgname = 'realtime_changes')
  loop
    execute format('create trigger realtime_changes after insert or update or delete on %s'
                   ' for each row execute function realtime.feed_row_change()', r.rel);
  end loop;
  -- ...and drop it from tables no longer published.
  for r in
    select t.tgrelid::regclass::text as rel from pg_trigger t
    join pg_class c on c.oid = t.tgrelid join pg_namespace n on n.oid = c.relnamespace
    where t.tgname = 'realtime_changes'
      and not exists (select from pg_publication_tables p where p.pubname = 'supabase_realtime'
                      and p.schemaname = n.nspname and p.tablename = c.relname)
  loop
    execute format('drop trigger realtime_changes on %s', r.rel);
  end loop;
end;
$$;
revoke execute on function realtime.sync_change_triggers() from public, anon, authenticated;

create or replace function realtime.on_publication_ddl() returns event_trigger
language plpgsql
as $$
begin
  perform realtime.sync_change_triggers();
end;
$$;

drop event trigger if exists realtime_publication_ddl;
create event trigger realtime_publication_ddl on ddl_command_end
  when tag in ('CREATE PUBLICATION', 'ALTER PUBLICATION', 'DROP PUBLICATION')
  execute function realtime.on_publication_ddl();

select realtime.sync_change_triggers();
