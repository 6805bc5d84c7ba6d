-- Signed-in users rank nodes through the Edge Function `match`, which acts as a role of its own.
--
-- score_nodes() must run as its owner: it reads whole node rows, the private matcher and the scores
-- index, none of which an API role may read. Granted to authenticated, the Data API exposed it to
-- every signed-in user (lint 0029), though it returns only what the map shows. neuralgrid_matcher
-- may execute score_nodes() and nothing else, and no API key or user token can become it. The
-- function `match` verifies its caller first: a signed-in user's ranking runs as neuralgrid_matcher
-- (with the user's claims), the service's as service_role, and anon is refused, as before.

do $$
begin
  if not exists (select from pg_catalog.pg_roles where rolname = 'neuralgrid_matcher') then
    create role neuralgrid_matcher nologin noinherit;
  end if;
end
$$;
comment on role neuralgrid_matcher is 'What the Edge Function match does for a signed-in user: rank nodes (score_nodes()), nothing else. Not a Data API role.';
-- The Edge Functions connect as postgres (SUPABASE_DB_URL) and `set local role` to it; a database
-- without that role (no Supabase, no embedded stack) has no Edge Functions to run.
do $$
begin
  if exists (select from pg_catalog.pg_roles where rolname = 'postgres') then
    grant neuralgrid_matcher to postgres;
  end if;
end
$$;

revoke execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) from authenticated;
grant execute on function public.score_nodes(text, real, text, text, double precision, double precision, numeric, boolean, integer, text) to neuralgrid_matcher;
