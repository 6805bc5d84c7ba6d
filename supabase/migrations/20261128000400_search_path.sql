-- Every function pins its search_path (Supabase's advisor, lint 0011 function_search_path_mutable).
--
-- These seven were left unpinned on purpose: the planner inlines a SQL function only when it has no
-- SET clause, and they are the matcher's per-node helpers. Their bodies already name every object
-- with its schema, so a caller's search_path could not redirect them; the lint cannot tell that. So
-- they are pinned too, at a cost measured as nil: `neuralgrid bench matching` at 10,000 nodes, before,
-- after and before again on one database, gave score_nodes p50 1.58, 1.61, 1.56 ms and match_job
-- 2.45, 2.42, 2.50 ms (the fast path reads precomputed scores; the helpers run on few rows).

alter function private.great_circle_km(double precision, double precision, double precision, double precision)
  set search_path = '';
alter function private.cooldown_until(bigint, real, real) set search_path = '';
alter function private.proximity_component(
  public.matching_policies, text, double precision, double precision, text, double precision, double precision
) set search_path = '';
alter function private.gateway_is_live(timestamptz) set search_path = '';
alter function private.node_is_eligible(public.nodes, double precision, timestamptz, numeric, text)
  set search_path = '';
alter function private.balanced_components(
  public.matching_policies, double precision, double precision, double precision, text, integer, integer,
  bigint, bigint, real, double precision
) set search_path = '';
alter function private.reject_reason(public.nodes, text, text, double precision, timestamptz, numeric, boolean, text)
  set search_path = '';
