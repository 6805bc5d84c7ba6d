-- Grouped claims (issue 16): a gateway places the requests that arrive while its previous placement
-- is in Postgres with one call, as it already ends jobs in batches (complete_jobs()). One statement
-- and one commit for the group instead of one each: less of Postgres's time per request goes to the
-- protocol, the executor's start-up and the commit.
--
-- Each request is placed exactly as place_job() places it, in the order given, each seeing the
-- claims of those before it (a node's slots fill and its score drops, as between separate calls).
-- One that fails (its key's budget spent, a bad parameter) fails alone: its row says how (the
-- SQLSTATE and message place_job() raised) and the others are placed all the same.

create function public.place_jobs(p_gateway text, p_requests jsonb)
returns table (
  ord integer, job_id uuid, node_id uuid, endpoint_url text, node_key bytea, attempt integer,
  fallback_ids uuid[], error text, max_output_tokens integer, busy boolean, tokens_per_s real[],
  refusal text, failure_state text, failure text)
language plpgsql
set search_path = ''
as $$
declare
  r record;
begin
  if jsonb_typeof(p_requests) is distinct from 'array' then
    raise exception 'place_jobs takes a JSON array of requests' using errcode = 'invalid_parameter_value';
  end if;
  -- Each request runs in a subtransaction of its own (so that it can fail alone); past 64 in one
  -- transaction Postgres's per-backend cache of them overflows and every snapshot reads pg_subtrans.
  if jsonb_array_length(p_requests) > 32 then
    raise exception 'place_jobs takes at most 32 requests, not %', jsonb_array_length(p_requests)
      using errcode = 'invalid_parameter_value';
  end if;
  perform set_config('neuralgrid.gateway_id', coalesce(p_gateway, ''), true);  -- stamp_job_gateway()
  for r in
    select * from rows from (jsonb_to_recordset(p_requests) as (
      model text, key uuid, policy text, min_vram real, region text, lat float8, lon float8,
      max_rate numeric, stream boolean, fallbacks integer, prompt_bytes integer, max_out integer,
      wait boolean, route text, end_user text))
    with ordinality as x (model, key, policy, min_vram, region, lat, lon, max_rate, stream, fallbacks,
                          prompt_bytes, max_out, wait, route, end_user, n)
  loop
    begin
      perform set_config('neuralgrid.end_user', coalesce(r.end_user, ''), true);
      return query
      select r.n::integer, p.job_id, p.node_id, p.endpoint_url, p.node_key, p.attempt, p.fallback_ids,
        p.error, p.max_output_tokens, p.busy, p.tokens_per_s, p.refusal, null::text, null::text
      from public.place_job(r.model, r.key, r.policy, r.min_vram, r.region, r.lat, r.lon, r.max_rate,
                            coalesce(r.stream, false), coalesce(r.fallbacks, 0), r.prompt_bytes, r.max_out,
                            coalesce(r.wait, false), r.route) p;
    exception when others then
      return query
      select r.n::integer, null::uuid, null::uuid, null::text, null::bytea, 0, '{}'::uuid[], null::text,
        null::integer, false, '{}'::real[], null::text, sqlstate, sqlerrm;
    end;
  end loop;
end;
$$;

comment on function public.place_jobs(text, jsonb) is
  'The gateway''s placements, grouped: place_job() for each request in the JSON array (at most 32), in '
  'order, as p_gateway; a request that fails gives its SQLSTATE and message and fails alone.';

revoke execute on function public.place_jobs(text, jsonb) from public, anon, authenticated;
grant execute on function public.place_jobs(text, jsonb) to service_role;
