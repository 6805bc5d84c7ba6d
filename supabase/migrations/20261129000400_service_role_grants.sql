-- What the service role was granted and could not do (found by the pgTAP tests,
-- supabase/tests/database/): 20261127000100_reserve.sql left it out of two things its functions use.
--
-- * node_base_scores.tier_gb calls private.vram_tier(): service_role could read the view's other
--   columns but not that one, nor call private.refresh_node_scores().
-- * sweep() refreshes private.vram_pressure, which service_role could read but not write: a sweep
--   with the service key (through the Data API, say) failed. Gateways and pg_cron sweep as postgres.

grant execute on function private.vram_tier(double precision) to service_role;
grant insert, update, delete on table private.vram_pressure to service_role;
