-- The map's fleet counts (jobs in the last minute, p50 latency over five minutes) read the newest
-- jobs only; these indexes keep that cheap however long the jobs table grows.
create index jobs_created_at_idx on public.jobs (created_at desc);
create index jobs_finished_at_idx on public.jobs (finished_at desc) where finished_at is not null;
