-- A job's ending is a heap-only update.
--
-- Ending a job sets its status and finished_at. Three indexes of jobs named them: the two partial
-- indexes of running jobs (by node, by gateway: a partial index's condition counts as an indexed
-- column) and finished_at's. So no ending was heap-only, and each wrote a new entry into every
-- other index of the ledger too (its key, by key and time, by owner, by time): five B-tree
-- insertions per job into the platform's largest indexes, and as many dead entries for vacuum.
--
-- The running set is found through the attempts now: a running job has exactly one running
-- attempt (private.end_attempt() ends it, or raises), and job_attempts is the narrow table. Its
-- ending was heap-only and no longer is, but it has two indexes, not five. finished_at keeps a
-- BRIN index: a summarizing index, which Postgres (16 and later) keeps up to date without taking
-- the update off the heap-only path; endings come in time order, so the block ranges of the last
-- five minutes are the table's last ones.
--
-- Measured in SQL on 16 nodes and a ledger of 50,000 jobs, analyzed (a placement and its ending in a
-- procedure, alternating twice with the code before): 1.84, 1.71 -> 1.73, 1.56 ms per job one at a
-- time; 0.77, 0.73 -> 0.71, 0.71 ms in groups of 8. The price: the VRAM pressure's refresh reads
-- 2,000 running jobs in 5.1 to 5.3 ms, against 2.9 from the partial index on jobs.

drop index public.jobs_node_idx;
drop index public.jobs_running_by_gateway;
drop index public.jobs_finished_at_idx;

create index job_attempts_running_idx on public.job_attempts (job_id) where status = 'running';
create index jobs_finished_at_brin on public.jobs using brin (finished_at) with (autosummarize = on);

-- The sweeps and the VRAM pressure read running jobs through their running attempts: the ids from
-- the attempts' index, once (an array of a subquery), then each job by its key. A join left the
-- planner free to scan the ledger instead, and it did once a few percent of a small ledger was
-- running: 18 ms against 3.4 for the pressure's refresh.

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
    where j.id = any (array(select a.job_id from public.job_attempts a where a.status = 'running'))
      and j.status = 'running' and j.created_at < now() - p_max_age
    for update of j skip locked
  loop
    perform private.abandon_job(v_job, 'abandoned: no completion within ' || p_max_age::text);
    job_id := v_job;
    return next;
  end loop;
end;
$$;

create or replace function private.sweep_orphaned_jobs()
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
    where j.id = any (array(select a.job_id from public.job_attempts a where a.status = 'running'))
      and j.status = 'running' and greatest(g.seen_at, pg_postmaster_start_time()) < now() - v_timeout
    for update of j skip locked
  loop
    perform private.abandon_job(v_job, 'abandoned: its gateway stopped');
    job_id := v_job;
    return next;
  end loop;
  -- Gateways gone a day, with nothing left running, are forgotten.
  delete from private.gateways g where g.seen_at < now() - interval '1 day'
    and not exists (select from public.jobs j
                    where j.id = any (array(select a.job_id from public.job_attempts a where a.status = 'running'))
                      and j.gateway_id = g.id and j.status = 'running');
end;
$$;

create or replace function private.refresh_vram_pressure() returns void
language sql
set search_path = ''
as $$
  with levels as (
    select distinct m.min_vram_gb as level_gb from public.models m
  ),
  -- Each running job at its level: the biggest level it needs at least (the smallest, for a job
  -- needing less than any).
  running as materialized (
    select coalesce((select max(l.level_gb) from levels l where l.level_gb <= j.min_vram_gb),
                    (select min(l.level_gb) from levels l)) as level_gb
    from public.jobs j
    where j.id = any (array(select a.job_id from public.job_attempts a where a.status = 'running')) and j.status = 'running'
  ),
  -- Slots by VRAM size first (a handful of sizes), so that nodes are read once, not once per level
  -- (materialized: a correlated subquery would otherwise read them again for each level).
  sizes as materialized (
    select n.vram_gb, sum(n.max_concurrency) as slots
    from public.nodes n where n.status in ('online', 'busy')
    group by n.vram_gb
  ),
  measured as (
    select l.level_gb,
           (select count(*) from running r where r.level_gb = l.level_gb)::float8 as busy_now,
           coalesce((select sum(s.slots) from sizes s where s.vram_gb >= l.level_gb), 0)::integer as slots,
           -- The share of the last sample to keep: exp(-elapsed / window).
           exp(-least(extract(epoch from now() - p.updated_at)::float8, 1e6) / st.reserve_window_s) as keep,
           p.busy as busy_before
    from levels l
    left join private.vram_pressure p on p.level_gb = l.level_gb
    cross join public.platform_settings st
  ),
  smoothed as (
    select m.level_gb, m.slots,
           case when m.busy_before is null then m.busy_now
                else m.busy_before * m.keep + m.busy_now * (1 - m.keep) end as busy
    from measured m
  ),
  -- A level's jobs can use every node that has it, except the slots that bigger jobs, which can
  -- use nothing smaller, take first.
  pressed as (
    select s.level_gb, s.busy, s.slots,
           s.slots - coalesce(sum(s.busy) over (order by s.level_gb desc
                                                rows between unbounded preceding and 1 preceding), 0) as left_over
    from smoothed s
  ),
  upserted as (
    insert into private.vram_pressure as p (level_gb, busy, slots, pressure, updated_at)
    select s.level_gb, s.busy, s.slots,
           case when s.busy = 0 then 0 when s.left_over <= 0 then 1 else least(1.0, s.busy / s.left_over) end,
           now()
    from pressed s
    on conflict (level_gb) do update
    set busy = excluded.busy, slots = excluded.slots, pressure = excluded.pressure,
        updated_at = excluded.updated_at
    returning p.level_gb
  )
  -- Levels no model in the catalog needs any more.
  delete from private.vram_pressure p where p.level_gb not in (select l.level_gb from levels l)
$$;
revoke execute on function public.sweep_stale_jobs(interval) from public, anon, authenticated;
grant execute on function public.sweep_stale_jobs(interval) to service_role;
revoke execute on function private.sweep_orphaned_jobs() from public, anon, authenticated;
grant execute on function private.sweep_orphaned_jobs() to service_role;
revoke execute on function private.refresh_vram_pressure() from public, anon, authenticated;
grant execute on function private.refresh_vram_pressure() to service_role;
