-- Earnings are written once per statement that ends jobs, not once per job (issue 42). The row
-- trigger ran its function, and its insert, for each job a batch ended: in `neuralgrid bench sql
-- --paths leased` (2026-12-04, groups of 16) it was 12% of a leased job's Postgres CPU, and as one
-- insert per statement, from the statement's transition tables, 4%. Transition tables take no
-- column list: the trigger fires on every update of jobs and writes for the rows whose status left
-- 'running' for a paid end, as the row trigger's condition chose them.
drop trigger jobs_record_earning on public.jobs;

create or replace function private.record_earning()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- One insert for the statement's paid endings: each job's node owner (a primary-key lookup) and
  -- the one-row settings. A second ending of the same job (it cannot happen through complete_jobs(),
  -- which ends running jobs only) writes nothing. A job of a (node, model) that has failed
  -- verification (ended after the failure: in flight then, or dispatched on a lease before its
  -- renewal) is forfeited as it is written.
  insert into public.earnings (job_id, node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd,
                               earned_at, settles_at, forfeited_at)
  select e.id, e.node_id, n.owner_id, e.model_id, e.cost_usd, s.platform_fee_rate, f.fee,
         e.cost_usd - f.fee, e.finished_at,
         e.finished_at + make_interval(secs => s.earnings_hold_s),
         case when exists (select 1 from public.model_checks c
                           where c.node_id = e.node_id and c.model_id = e.model_id and c.state = 'failed')
              then now() end
  from ended_now e
  join ended_before b on b.id = e.id
  cross join public.platform_settings s
  cross join lateral (select round(e.cost_usd * s.platform_fee_rate, 8) as fee) f
  left join public.nodes n on n.id = e.node_id
  where b.status = 'running' and e.api_key_id is not null
    and (e.status = 'succeeded' or (e.status = 'cancelled' and e.cost_usd > 0))
  order by e.id
  on conflict (job_id) do nothing;
  return null;
end;
$$;

comment on function private.record_earning() is
  'Trigger, once per statement that updates jobs: writes the earnings ledger rows of the jobs it ended paid for (left running, succeeded, or cancelled by its client after the node had worked): gross = the charge, the platform''s fee at platform_settings.platform_fee_rate, the owner''s net, held until earnings_hold_s after the end (forfeited at once when its (node, model) has failed verification); at most once per job.';

create trigger jobs_record_earning
after update on public.jobs
referencing old table as ended_before new table as ended_now
for each statement execute function private.record_earning();
