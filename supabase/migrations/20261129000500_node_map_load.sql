-- The public map's view carries each node's load too (missed heartbeats, GPU utilization, free VRAM,
-- queue depth): the columns the map shows, which the gateway's /api/nodes joined in from nodes.
-- With them node_map is the one definition of the map, read the same way by the gateway and, on a
-- hosted project, by the page itself through the Data API (`select *`, as anon).
-- Columns are only added, at the end: CREATE OR REPLACE VIEW keeps the view's grants.

create or replace view public.node_map with (security_invoker = true) as
select
  n.id, n.name, n.gpu_model, n.gpu_count, n.vram_gb, n.tflops, n.hourly_rate, n.region,
  n.latitude, n.longitude, n.status, n.max_concurrency, n.inflight, n.last_heartbeat_at,
  n.successes, n.failures, n.ewma_latency_ms, n.ewma_tokens_per_s, n.cooldown_until,
  coalesce(array_agg(m.model_id order by m.model_id) filter (where m.state = 'loaded'), '{}') as warm_models,
  coalesce(array_agg(m.model_id order by m.model_id) filter (where m.state = 'available'), '{}') as available_models,
  n.missed_heartbeats, n.gpu_utilization, n.free_vram_gb, n.queue_depth
from public.nodes n
left join public.node_models m on m.node_id = n.id
group by n.id;
comment on view public.node_map is 'The public node map: what anyone may see of each node (no endpoint, no owner), with its models and its load. `select *` works for anon and authenticated.';
