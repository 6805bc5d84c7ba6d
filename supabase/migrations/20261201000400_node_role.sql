-- A node's heartbeat through Supabase alone runs as a role of its own, not as anon.
--
-- agent_heartbeat_with_secret() must run as its owner: it checks a node's secret, which no API role
-- may read, and writes the node. Granted to anon, the Data API exposed it to anyone (lint 0028),
-- though the secret was the whole proof. neuralgrid_node may execute that function and nothing
-- else, and no API key or user token can become it: PostgREST takes a request only as a role its
-- JWT names, and only the service can sign one. The Edge Function `heartbeat` connects as postgres
-- and switches to neuralgrid_node for each heartbeat, as it switched to anon before.

do $$
begin
  if not exists (select from pg_catalog.pg_roles where rolname = 'neuralgrid_node') then
    create role neuralgrid_node nologin noinherit;
  end if;
end
$$;
comment on role neuralgrid_node is 'What a node may do through Supabase''s Edge Functions: send its heartbeat with its secret (agent_heartbeat_with_secret()), nothing else. Not a Data API role.';
-- The Edge Functions connect as postgres (SUPABASE_DB_URL) and `set local role` to it; a database
-- without that role (no Supabase, no embedded stack) has no Edge Functions to run.
do $$
begin
  if exists (select from pg_catalog.pg_roles where rolname = 'postgres') then
    grant neuralgrid_node to postgres;
  end if;
end
$$;

revoke execute on function public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) from anon;
grant execute on function public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) to neuralgrid_node;
comment on function public.agent_heartbeat_with_secret(uuid, text, text, integer, real, real, text[], jsonb, boolean, jsonb, text[], text[], jsonb) is 'A node''s heartbeat proved with its secret (hashed and compared before anything is written), for the Edge Function heartbeat, which runs it as neuralgrid_node: the same checks and effect as the gateway''s agent_heartbeat(). Not callable through the Data API.';
