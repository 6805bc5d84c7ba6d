-- complete_jobs() is planned once per connection, not on every call.
--
-- Found: once autovacuum had analyzed the ledger, every call of complete_jobs() planned its large
-- statement (the CTE that ends the attempts, jobs, nodes and keys) and its node-locking read again
-- for the call's own values. Postgres compares the plan it would cache, made for arrays of unknown
-- length, with plans made for each call's values; the cached one looked dearer (a bitmap scan sized
-- for ten jobs against one index probe), so it kept planning afresh, and planning that statement
-- costs more than running it. Measured on a 16-node fleet with about 35,000 jobs analyzed, one job at a
-- time (a sequential caller): 1.61 ms per call, 0.71 ms with the cached plan (a placement and its
-- ending, 2.64 ms and 1.72 ms); groups of 8, 0.93 and 0.89 ms per job. A fresh deployment ran
-- the cached plan until its first analyze, so benchmarks on new databases saw it only part of the time.
-- The cached plan reads every table by key (tests/db/test_ledger_plans.py); it is made again
-- whenever the tables' statistics change, as any cached plan is.

alter function public.complete_jobs(uuid[], text[], integer[], integer[], real[], real[], text[])
  set plan_cache_mode = force_generic_plan;
