-- The Edge Functions act as roles of their own where they need a definer function, not as anon or
-- authenticated.
--
-- Two functions must run as their owner. agent_heartbeat_with_secret() checks a node's secret, which
-- no API role may read, and writes the node; score_nodes() reads whole node rows, the private matcher
-- and the scores index. Granted to anon and authenticated, the Data API exposed them (lints 0028 and
-- 0029), though each checks what it needs. Each is now granted to a role that may execute it and
-- nothing else, and that no API key or user token can become: PostgREST takes a request only as a
-- role its JWT names, and only the service can sign one.
--   * neuralgrid_node: the Edge Function `heartbeat` switches to it for each node's heartbeat, as it
--     switched to anon before.
--   * neuralgrid_matcher: the Edge Function `match` verifies its caller first; a signed-in user's
--     ranking runs as neuralgrid_matcher (with the user's claims), the service's as service_role,
--     and anon is refused, as before.

do $$
declare
  v_role text;
begin
  foreach v_role in array array['neuralgrid_node', 'neuralgrid_matcher'] loop
    if not exists (select from pg_catalog.pg_roles where rolname = v_role) then
      execute format('create role %I nologin noinherit', v_role);
    end if;
    -- The Edge Functions connect as postgres (SUPABASE_DB_URL) and `set local role` to these; a
    -- database without that role (no Supabase, no embedded stack) has no Edge Functions to run.
    if exists (select from pg_catalog.pg_roles where rolname = 'postgres') then
      execute format('grant %I to postgres', v_role);
    end if;
  end loop;
end
$$;
comment on role neuralgrid_node is 'What a node may do through Supabase''s Edge Functions: send its heartbeat with its secret (agent_heartbeat_with_secret()), nothing else. Not a Data API role.';
comment on role neuralgrid_matcher is 'What the Edge Function match does for a signed-in user: rank nodes (score_nodes()), nothing else. Not a Data API role.';

revoke execute on function public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) from anon;
grant execute on function public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) to neuralgrid_node;
comment on function public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) is 'A node''s heartbeat proved with its secret (hashed and compared before anything is written), for the Edge Function heartbeat, which runs it as neuralgrid_node: the same checks and effect as the gateway''s agent_heartbeat(). Not callable through the Data API.';

revoke execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) from authenticated;
grant execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) to neuralgrid_matcher;
