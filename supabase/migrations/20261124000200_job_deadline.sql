-- A job never outlives its request by long. The sweep ended a running job only after an hour, so a
-- completion that was never written (a gateway that crashed, a write lost in a database restart) kept
-- its node's slot and its key's budget hold for that hour. Now the sweep ends running jobs once they
-- are older than platform_settings.job_deadline_s, 15 minutes by default: a request within the
-- gateway's timeouts (a first byte within 30 s from each of at most three nodes) that streams
-- max_tokens (512 by default) even at a token a second is over well before. The gateway bounds the
-- time between two bytes (30 s), not a whole answer: a stream still going at the deadline is ended
-- all the same, and its late completion ignored, as for any job the sweep has ended. The job is ended by sweep_stale_jobs(), as before: its attempt cancelled (the
-- node's slot freed, its reputation untouched: a lost write is not the node's fault), the job failed,
-- the hold released and nothing charged.

alter table public.platform_settings
  add column job_deadline_s real not null default 900,
  add constraint "job_deadline_s must be positive" check (job_deadline_s > 0);
comment on column public.platform_settings.job_deadline_s is 'Seconds a job may run before the sweep ends it as abandoned (failed, its node slot and budget hold released, nothing charged): longer than the longest request the gateway serves, so that only jobs whose completion was lost reach it.';
comment on table public.platform_settings is 'One row of operating settings: heartbeat interval, misses before offline, failure cooldowns, the job deadline.';

-- Same signature: the default becomes null, read as the platform's deadline, so that the callers
-- that pass nothing (the gateway's sweeper, pg_cron's 'select public.sweep()') follow the setting.
create or replace function public.sweep(p_max_job_age interval default null)
returns table (kind text, id uuid, name text)
language plpgsql
set search_path = ''
as $$
declare
  v_max_job_age interval := coalesce(
    p_max_job_age, (select make_interval(secs => s.job_deadline_s) from public.platform_settings s));
begin
  return query select 'node_offline'::text, s.node_id, s.name from public.sweep_stale_nodes() s;
  return query select 'job_abandoned'::text, s.job_id, null::text from public.sweep_stale_jobs(v_max_job_age) s;
end;
$$;
comment on function public.sweep(interval) is 'One sweep: silent nodes offline (sweep_stale_nodes()) and jobs running longer than p_max_job_age (default: platform_settings.job_deadline_s) ended (sweep_stale_jobs()). Returns a row per node set offline (kind node_offline, with its name) and per job ended (kind job_abandoned). Run every second by pg_cron where it is installed, else by the service''s sweeper.';
revoke execute on function public.sweep(interval) from public, anon, authenticated;
grant execute on function public.sweep(interval) to service_role;
