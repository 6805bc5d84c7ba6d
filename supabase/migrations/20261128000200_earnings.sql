-- Earnings for GPU owners (issue 19).
--
-- * A ledger, public.earnings: one row per paid job, written in the transaction that ends the job.
--   A job earns when it succeeds and a key paid for it. Its gross is what its key was charged
--   (jobs.cost_usd, the charge complete_jobs() adds to api_keys.spent_usd); the platform keeps a fee
--   (platform_settings.platform_fee_rate, 15% by default, in [0, 1)) and the node's owner the rest.
--   A failed job earns nothing (its key is still charged for the tokens it received: the platform
--   keeps that), nor do cancelled jobs, jobs the sweeper abandoned, and jobs no key paid for.
-- * The row is written by a row trigger on the job's running -> succeeded transition. Its WHEN
--   clause is evaluated without calling any function, so the other updates of jobs (failover,
--   sweeps) cost nothing more. Timed on a scratch database (docs/earnings.md): a completion took
--   42 us more at p50 (916 to 958 us, batches of one) and 22 us more per job in batches of 32; a
--   statement trigger and an extra step inside complete_jobs() cost the same within the noise. The
--   trigger leaves complete_jobs() alone, so it keeps working whichever migration redefines it.
-- * Exactly once per job: job_id is the key, and a second ending of the same job writes nothing.
-- * Owners read their own rows (RLS on owner_id, the node's owner when the job ran); anon and other
--   owners read nothing; only service_role writes. No foreign keys: a ledger keeps its rows whatever
--   becomes of the node, and a completion locks no user row.
-- * Uptime needs history the platform did not keep: public.node_status_changes records each time a
--   node goes up (online or busy) or down (offline or draining); online <-> busy flips, which every
--   claim can cause, are not recorded. Nodes that exist when this migration runs start with one row.
-- * For an owner: my_earnings() (per day, node and model), my_earnings_totals() and my_node_stats()
--   (uptime over a window, jobs served, reputation, warm models), all read through RLS.

alter table public.platform_settings
  add column platform_fee_rate numeric(5, 4) not null default 0.15,
  add constraint "platform_fee_rate must be in [0, 1)" check (platform_fee_rate >= 0 and platform_fee_rate < 1);
comment on column public.platform_settings.platform_fee_rate is 'The share of each paid job''s charge the platform keeps; the node''s owner earns the rest. Applies to jobs ending after a change; each ledger row keeps the rate it was written with.';

-- The ledger ------------------------------------------------------------------------------------------

create table public.earnings (
  job_id uuid primary key,
  node_id uuid,
  owner_id uuid,
  model_id text not null,
  gross_usd numeric(16, 8) not null,
  fee_rate numeric(5, 4) not null,
  fee_usd numeric(16, 8) not null,
  net_usd numeric(16, 8) not null,
  earned_at timestamptz not null default now(),
  constraint "gross_usd, fee_usd and net_usd must not be negative" check (
    gross_usd >= 0 and fee_usd >= 0 and net_usd >= 0
  ),
  constraint "net_usd is gross_usd less fee_usd" check (net_usd = gross_usd - fee_usd),
  constraint "fee_rate must be in [0, 1)" check (fee_rate >= 0 and fee_rate < 1)
);
comment on table public.earnings is 'The earnings ledger: one row per job that succeeded and was paid for, written as it ended. gross_usd is what the job''s key was charged, fee_usd the platform''s share at fee_rate, net_usd what the node''s owner (owner_id, when the job ran) earns. Rows stay when the node is deleted.';

create index earnings_owner_idx on public.earnings (owner_id, earned_at);

revoke all on table public.earnings from anon, authenticated;
grant select on table public.earnings to authenticated;
grant select, insert, update, delete on table public.earnings to service_role;
alter table public.earnings enable row level security;
create policy "Owners can see the earnings of their own nodes" on public.earnings
  for select to authenticated using (owner_id = (select auth.uid()));

create function private.record_earning() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- One primary-key lookup (the node's owner) and the one-row settings table; a second ending of the
  -- same job (it cannot happen through complete_jobs(), which ends running jobs only) writes nothing.
  insert into public.earnings (job_id, node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd,
                               earned_at)
  select new.id, new.node_id, n.owner_id, new.model_id, new.cost_usd, s.platform_fee_rate, f.fee,
         new.cost_usd - f.fee, new.finished_at
  from public.platform_settings s
  cross join lateral (select round(new.cost_usd * s.platform_fee_rate, 8) as fee) f
  left join public.nodes n on n.id = new.node_id
  on conflict (job_id) do nothing;
  return null;
end;
$$;
comment on function private.record_earning() is 'Trigger: writes the earnings ledger row of a job that has just succeeded and was paid for (gross = its charge, the platform''s fee at platform_settings.platform_fee_rate, the owner''s net); at most once per job.';
revoke execute on function private.record_earning() from public, anon, authenticated, service_role;

create trigger jobs_record_earning after update of status on public.jobs
  for each row when (old.status = 'running' and new.status = 'succeeded' and new.api_key_id is not null)
  execute function private.record_earning();

-- Status history, for uptime -------------------------------------------------------------------------

create table public.node_status_changes (
  id bigint generated always as identity primary key,
  node_id uuid not null references public.nodes (id) on delete cascade,
  status text not null,
  changed_at timestamptz not null default now(),
  constraint "status must be online, busy, offline or draining" check (
    status in ('online', 'busy', 'offline', 'draining')
  )
);
comment on table public.node_status_changes is 'When each node went up (online or busy) or down (offline or draining), and to which status: the history uptime is computed from. Flips between online and busy are not recorded. A node''s history starts when it registered, or at the earnings migration for nodes that existed before it.';

create index node_status_changes_node_idx on public.node_status_changes (node_id, changed_at);

revoke all on table public.node_status_changes from anon, authenticated;
grant select on table public.node_status_changes to authenticated;
grant select, insert, update, delete on table public.node_status_changes to service_role;
alter table public.node_status_changes enable row level security;
create policy "Owners can see the status history of their own nodes" on public.node_status_changes
  for select to authenticated using (
    exists (select 1 from public.nodes n where n.id = node_id and n.owner_id = (select auth.uid()))
  );

create function private.record_node_status() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  -- Definer: owners insert and update their own nodes through the Data API, and may not write history.
  insert into public.node_status_changes (node_id, status) values (new.id, new.status);
  return null;
end;
$$;
comment on function private.record_node_status() is 'Trigger: records a node''s status when it registers and each time it goes up (online, busy) or down (offline, draining).';
revoke execute on function private.record_node_status() from public, anon, authenticated, service_role;

create trigger nodes_record_status_insert after insert on public.nodes
  for each row execute function private.record_node_status();
create trigger nodes_record_status_update after update of status on public.nodes
  for each row when ((old.status in ('online', 'busy')) <> (new.status in ('online', 'busy')))
  execute function private.record_node_status();

insert into public.node_status_changes (node_id, status, changed_at)
select n.id, n.status, now() from public.nodes n;

-- What an owner reads -----------------------------------------------------------------------------------

create function public.my_earnings(p_since timestamptz)
returns table (
  day date, node_id uuid, node_name text, model_id text, jobs bigint, gross_usd numeric, fee_usd numeric,
  net_usd numeric
)
language sql stable
set search_path = ''
as $$
  select (e.earned_at at time zone 'UTC')::date, e.node_id, n.name, e.model_id, count(*), sum(e.gross_usd),
         sum(e.fee_usd), sum(e.net_usd)
  from public.earnings e
  left join public.nodes n on n.id = e.node_id
  where e.owner_id = (select auth.uid()) and e.earned_at >= coalesce(p_since, '-infinity')
  group by 1, 2, 3, 4
  order by 1, 3, 4
$$;
comment on function public.my_earnings(timestamptz) is 'The signed-in owner''s earnings since p_since (null: all), per UTC day, node and model: paid jobs, gross (charged to developers), the platform''s fee and the owner''s net. node_name is null for a node since deleted.';
revoke execute on function public.my_earnings(timestamptz) from public, anon;
grant execute on function public.my_earnings(timestamptz) to authenticated, service_role;

create function public.my_earnings_totals(p_since timestamptz)
returns table (jobs bigint, gross_usd numeric, fee_usd numeric, net_usd numeric)
language sql stable
set search_path = ''
as $$
  select count(*), coalesce(sum(e.gross_usd), 0), coalesce(sum(e.fee_usd), 0), coalesce(sum(e.net_usd), 0)
  from public.earnings e
  where e.owner_id = (select auth.uid()) and e.earned_at >= coalesce(p_since, '-infinity')
$$;
comment on function public.my_earnings_totals(timestamptz) is 'The signed-in owner''s totals since p_since (null: all): paid jobs, gross, the platform''s fee and the owner''s net; one row, zeros when none.';
revoke execute on function public.my_earnings_totals(timestamptz) from public, anon;
grant execute on function public.my_earnings_totals(timestamptz) to authenticated, service_role;

create function public.my_node_stats(p_window interval default interval '7 days')
returns table (
  node_id uuid, name text, status text, gpu_model text, gpu_count integer, region text, hourly_rate numeric,
  uptime double precision, observed_s double precision, jobs_served bigint, failures bigint,
  reputation double precision, warm_models text[], last_heartbeat_at timestamptz
)
language sql stable
set search_path = ''
as $$
  with mine as (
    select n.id, n.name, n.status, n.gpu_model, n.gpu_count, n.region, n.hourly_rate, n.successes, n.failures,
           n.speed_ratio, n.last_heartbeat_at
    from public.nodes n where n.owner_id = (select auth.uid())
  ),
  recorded as (
    -- The changes inside the window, and the last one before it (the status the window starts in).
    select c.node_id, c.status, c.changed_at, c.id
    from mine m join public.node_status_changes c on c.node_id = m.id
    where c.changed_at >= now() - p_window
    union all
    select b.node_id, b.status, b.changed_at, b.id
    from mine m
    cross join lateral (
      select c.node_id, c.status, c.changed_at, c.id from public.node_status_changes c
      where c.node_id = m.id and c.changed_at < now() - p_window
      order by c.changed_at desc, c.id desc limit 1
    ) b
  ),
  spans as (
    select r.node_id, r.status in ('online', 'busy') as up,
           extract(epoch from coalesce(lead(r.changed_at) over w, now())
                              - greatest(r.changed_at, now() - p_window))::float8 as seconds
    from recorded r
    window w as (partition by r.node_id order by r.changed_at, r.id)
  ),
  uptime as (
    select s.node_id, coalesce(sum(s.seconds) filter (where s.up), 0) as up_s, sum(s.seconds) as observed_s
    from spans s group by s.node_id
  )
  select m.id, m.name, m.status, m.gpu_model, m.gpu_count, m.region, m.hourly_rate,
         u.up_s / nullif(u.observed_s, 0), coalesce(u.observed_s, 0), m.successes, m.failures,
         -- The matcher's reputation (private.balanced_components): Laplace-smoothed success rate,
         -- scaled down below a quarter of the claimed speed. A test keeps the two equal.
         (m.successes + 1)::float8 / (m.successes + m.failures + 2)
           * least(1.0, coalesce(m.speed_ratio, 1.0) / 0.25),
         coalesce((select array_agg(nm.model_id order by nm.model_id) from public.node_models nm
                   where nm.node_id = m.id and nm.state = 'loaded'), '{}'),
         m.last_heartbeat_at
  from mine m
  left join uptime u on u.node_id = m.id
  order by m.name, m.id
$$;
comment on function public.my_node_stats(interval) is 'The signed-in owner''s nodes: status, uptime over the last p_window (the share of the recorded part of the window spent online or busy; null when nothing is recorded) with the seconds recorded (observed_s), jobs served and failed, reputation (as the matcher scores it, in [0, 1]), warm models and last heartbeat.';
revoke execute on function public.my_node_stats(interval) from public, anon;
grant execute on function public.my_node_stats(interval) to authenticated, service_role;
