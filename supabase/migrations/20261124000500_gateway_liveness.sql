-- Jobs of a gateway that died end within seconds, not at the job deadline.
--
-- A gateway killed mid-request never writes its jobs' completions: their node slots and budget holds
-- stayed taken until the sweep's job deadline (15 minutes). Now each gateway checks in every couple
-- of seconds (gateway_alive()), each job records the gateway that placed it, and the sweep ends the
-- running jobs of a gateway silent for platform_settings.gateway_timeout_s, as it ends jobs past the
-- deadline: attempt cancelled (no blame on the node), job failed, hold released, nothing charged.
-- Silence is counted from the database's own start too: after a restart every gateway gets the full
-- timeout to check in again before its jobs are judged.

alter table public.platform_settings
  add column gateway_timeout_s real not null default 15,
  add constraint "gateway_timeout_s must be positive" check (gateway_timeout_s > 0);
comment on column public.platform_settings.gateway_timeout_s is 'Seconds a gateway may go without checking in (gateway_alive()) before the sweep ends the jobs it placed.';

create table private.gateways (
  id uuid primary key,
  started_at timestamptz not null default now(),
  seen_at timestamptz not null default now()
);
comment on table private.gateways is 'The gateways that place jobs, and when each last checked in.';
revoke all on table private.gateways from public, anon, authenticated;
grant select, insert, update, delete on table private.gateways to service_role;

alter table public.jobs add column gateway_id uuid;
comment on column public.jobs.gateway_id is 'The gateway that placed the job (null: placed outside a gateway, the CLI say); its silence ends the job.';
create index jobs_running_by_gateway on public.jobs (gateway_id) where status = 'running';

create function private.stamp_job_gateway()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- The gateway names itself for the statement that places the job (neuralgrid.gateway_id, set
  -- local to it), so no function signature changes and transaction poolers are safe.
  new.gateway_id := coalesce(new.gateway_id, nullif(current_setting('neuralgrid.gateway_id', true), '')::uuid);
  return new;
end
$$;
comment on function private.stamp_job_gateway() is 'Trigger: records on a new job the gateway placing it (the neuralgrid.gateway_id setting).';
revoke execute on function private.stamp_job_gateway() from public, anon, authenticated;

create trigger jobs_stamp_gateway before insert on public.jobs
  for each row execute function private.stamp_job_gateway();

create function public.gateway_alive(p_gateway_id uuid)
returns void
language sql
set search_path = ''
as $$
  insert into private.gateways as g (id) values (p_gateway_id)
  on conflict (id) do update set seen_at = now();
$$;
comment on function public.gateway_alive(uuid) is 'A gateway checks in (every couple of seconds): the jobs it placed stay its own while it does.';
revoke execute on function public.gateway_alive(uuid) from public, anon, authenticated;
grant execute on function public.gateway_alive(uuid) to service_role;

-- One way to end an abandoned job, for both reasons the sweep has.
create function private.abandon_job(p_job_id uuid, p_reason text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  perform private.end_attempt(p_job_id, 'cancelled', p_reason);
  update public.jobs j set status = 'failed', error = p_reason, finished_at = now() where j.id = p_job_id;
  perform private.release_reservation(p_job_id, 0);
end
$$;
comment on function private.abandon_job(uuid, text) is 'Ends a running job whose completion will never come: its attempt cancelled (the node''s slot freed, no blame), the job failed with p_reason, its hold released and nothing charged.';
revoke execute on function private.abandon_job(uuid, text) from public, anon, authenticated;
grant execute on function private.abandon_job(uuid, text) to service_role;

create or replace function public.sweep_stale_jobs(p_max_age interval default interval '1 hour')
returns table (job_id uuid)
language plpgsql
set search_path = ''
as $$
declare
  v_job uuid;
begin
  for v_job in
    select j.id from public.jobs j
    where j.status = 'running' and j.created_at < now() - p_max_age
    for update skip locked
  loop
    perform private.abandon_job(v_job, 'abandoned: no completion within ' || p_max_age::text);
    job_id := v_job;
    return next;
  end loop;
end;
$$;

create function private.sweep_orphaned_jobs()
returns table (job_id uuid)
language plpgsql
set search_path = ''
as $$
declare
  v_job uuid;
  v_timeout interval := (select make_interval(secs => s.gateway_timeout_s) from public.platform_settings s);
begin
  for v_job in
    select j.id from public.jobs j join private.gateways g on g.id = j.gateway_id
    where j.status = 'running' and greatest(g.seen_at, pg_postmaster_start_time()) < now() - v_timeout
    for update of j skip locked
  loop
    perform private.abandon_job(v_job, 'abandoned: its gateway stopped');
    job_id := v_job;
    return next;
  end loop;
  -- Gateways gone a day, with nothing left running, are forgotten.
  delete from private.gateways g where g.seen_at < now() - interval '1 day'
    and not exists (select from public.jobs j where j.gateway_id = g.id and j.status = 'running');
end;
$$;
comment on function private.sweep_orphaned_jobs() is 'Ends the running jobs of gateways silent for platform_settings.gateway_timeout_s (and since the database started), and forgets gateways gone a day.';
revoke execute on function private.sweep_orphaned_jobs() from public, anon, authenticated;
grant execute on function private.sweep_orphaned_jobs() to service_role;

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
  return query select 'job_orphaned'::text, s.job_id, null::text from private.sweep_orphaned_jobs() s;
  return query select 'job_abandoned'::text, s.job_id, null::text from public.sweep_stale_jobs(v_max_job_age) s;
end;
$$;
comment on function public.sweep(interval) is 'One sweep: silent nodes offline (sweep_stale_nodes()), the running jobs of silent gateways ended (kind job_orphaned), and jobs running longer than p_max_job_age (default: platform_settings.job_deadline_s) ended (kind job_abandoned). Returns a row per node set offline (with its name) and per job ended. Run every second by pg_cron where it is installed, else by the service''s sweeper.';
