-- Every inference request (a job) and each attempt to serve it on a node.

create table public.jobs (
  id uuid primary key default gen_random_uuid(),
  api_key_id uuid references public.api_keys (id) on delete set null,
  owner_id uuid references auth.users (id) on delete set null,
  model_id text not null,
  policy text not null,
  status text not null default 'running',
  node_id uuid references public.nodes (id) on delete set null,
  attempts integer not null default 0,
  stream boolean not null default false,
  region text,
  min_vram_gb real not null,
  prompt_tokens integer not null default 0,
  completion_tokens integer not null default 0,
  cost_usd numeric(16, 8) not null default 0,
  reserved_usd numeric(16, 8) not null default 0,
  ttft_ms real,
  latency_ms real,
  error text,
  created_at timestamptz not null default now(),
  finished_at timestamptz,
  constraint "job status must be running, succeeded, failed or cancelled" check (
    status in ('running', 'succeeded', 'failed', 'cancelled')
  ),
  constraint "a finished job has finished_at" check ((status = 'running') = (finished_at is null)),
  constraint "token counts must not be negative" check (prompt_tokens >= 0 and completion_tokens >= 0),
  constraint "cost_usd must not be negative" check (cost_usd >= 0)
);
comment on table public.jobs is 'One row per inference request: the model, the policy, the node that served it, usage, cost and timings.';

create index jobs_owner_idx on public.jobs (owner_id, created_at desc);
create index jobs_api_key_idx on public.jobs (api_key_id, created_at desc);
create index jobs_node_idx on public.jobs (node_id) where status = 'running';

revoke all on table public.jobs from anon, authenticated;
grant select on table public.jobs to authenticated;
grant all on table public.jobs to service_role;
alter table public.jobs enable row level security;
create policy "Users can see their own jobs" on public.jobs
  for select to authenticated using (owner_id = (select auth.uid()));

create table public.job_attempts (
  job_id uuid not null references public.jobs (id) on delete cascade,
  attempt integer not null,
  node_id uuid references public.nodes (id) on delete set null,
  status text not null default 'running',
  http_status integer,
  error text,
  ttft_ms real,
  latency_ms real,
  started_at timestamptz not null default clock_timestamp(),
  ended_at timestamptz,
  primary key (job_id, attempt),
  constraint "attempt numbers start at 1" check (attempt >= 1),
  constraint "attempt status must be running, succeeded, failed or cancelled" check (
    status in ('running', 'succeeded', 'failed', 'cancelled')
  )
);
comment on table public.job_attempts is 'Each try at serving a job on one node, with its outcome; failed attempts feed cooldown and reputation.';

create index job_attempts_node_idx on public.job_attempts (node_id, started_at desc);

revoke all on table public.job_attempts from anon, authenticated;
grant select on table public.job_attempts to authenticated;
grant all on table public.job_attempts to service_role;
alter table public.job_attempts enable row level security;
create policy "Users can see the attempts of their own jobs" on public.job_attempts
  for select to authenticated using (
    exists (select 1 from public.jobs j where j.id = job_id and j.owner_id = (select auth.uid()))
  );
