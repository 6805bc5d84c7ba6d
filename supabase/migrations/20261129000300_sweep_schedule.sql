-- The database sweeps itself with pg_cron whenever pg_cron is enabled: before the push, after it,
-- or not at all (then the gateways' sweepers do it, and the push says so).
--
-- Every gateway runs sweep() each second; pg_cron runs it from the database itself, so that silent
-- nodes still go offline while no gateway runs (nodes heartbeating through the `heartbeat` Edge
-- Function, say). Running both is harmless: sweep()'s updates are idempotent.
--
-- pg_cron schedules in seconds from 1.5 on (hosted Supabase has 1.6). Older versions (Debian 12's
-- 1.4) schedule in minutes only: there a job each minute sweeps once a second for most of that
-- minute, committing each sweep so that it is seen at once. It is a DO block, not a procedure: a
-- procedure cannot commit with the fixed search_path Supabase's advisors ask of every function.

create function public.schedule_sweep()
returns text
language plpgsql
set search_path = ''
as $$
declare
  v_version text := (select extversion from pg_catalog.pg_extension where extname = 'pg_cron');
  v_each_second constant text := 'do $sweep$ begin for i in 1 .. 55 loop perform public.sweep(); commit;'
    ' perform pg_catalog.pg_sleep(1); end loop; end $sweep$';
begin
  if v_version is null then
    return 'pg_cron is not enabled: the gateways sweep (each every second). To sweep from the database'
      ' too, enable pg_cron; it is then scheduled (or run: select public.schedule_sweep();)';
  end if;
  -- The job of the first migrations, which swept nodes only.
  perform cron.unschedule(j.jobid) from cron.job j where j.jobname = 'neuralgrid-sweep-stale-nodes';
  -- cron.schedule() with a job's name replaces that job: calling this again changes nothing.
  if pg_catalog.string_to_array(pg_catalog.split_part(v_version, '-', 1), '.')::integer[] >= '{1,5}' then
    perform cron.schedule('neuralgrid-sweep', '1 seconds', 'select public.sweep()');
    return format('pg_cron %s: the database sweeps every second (job neuralgrid-sweep)', v_version);
  end if;
  perform cron.schedule('neuralgrid-sweep', '* * * * *', v_each_second);
  return format('pg_cron %s schedules in minutes only: the database sweeps every second through a job'
    ' each minute that sweeps 55 times (neuralgrid-sweep)', v_version);
end
$$;
comment on function public.schedule_sweep() is 'Schedules sweep() on pg_cron as its version allows (in seconds from 1.5, else each second through a job per minute), replacing any earlier schedule of ours; returns what it did, or why it did nothing. Run by this migration, when pg_cron is created later (where an event trigger may be made) and by `neuralgrid db migrate`.';
revoke execute on function public.schedule_sweep() from public, anon, authenticated;
grant execute on function public.schedule_sweep() to service_role;

-- pg_cron enabled after the push: schedule then. Making an event trigger needs a superuser (or
-- supautils' leave, on hosted Supabase); without one, the push warns how to schedule by hand.
create function private.schedule_sweep_with_pg_cron()
returns event_trigger
language plpgsql
set search_path = ''
as $$
begin
  if exists (
    select from pg_catalog.pg_event_trigger_ddl_commands() c
    where c.command_tag = 'CREATE EXTENSION' and c.object_identity = 'pg_cron'
  ) then
    raise notice '%', public.schedule_sweep();
  end if;
end
$$;
comment on function private.schedule_sweep_with_pg_cron() is 'Event trigger: schedules the sweep when pg_cron is created after the migrations.';
revoke execute on function private.schedule_sweep_with_pg_cron() from public, anon, authenticated;

do $$
begin
  create event trigger neuralgrid_schedule_sweep on ddl_command_end
    when tag in ('CREATE EXTENSION')
    execute function private.schedule_sweep_with_pg_cron();
exception when insufficient_privilege then
  if not exists (select from pg_catalog.pg_extension where extname = 'pg_cron') then
    raise warning 'pg_cron is not enabled, and enabling it later will not be noticed (%): once it is,'
      ' run select public.schedule_sweep();', sqlerrm;
  end if;
end
$$;

do $$
begin
  raise notice '%', public.schedule_sweep();
end
$$;
