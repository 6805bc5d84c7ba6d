-- record_jobs() plans its statements once (issue 42). Its statements take arrays, which Postgres
-- re-plans for each call while a custom plan looks cheaper than the generic one, and so it did: in
-- `neuralgrid bench sql` (2026-12-02) a job recorded alone, start then end, cost 3.3 ms of Postgres
-- CPU, of which planning was half (1.5 ms with generic plans), and a group of 14 cost 0.42 ms a job
-- (0.29). complete_jobs(), which it calls, has planned so since it was written.
alter function public.record_jobs(uuid, jsonb) set plan_cache_mode = force_generic_plan;
