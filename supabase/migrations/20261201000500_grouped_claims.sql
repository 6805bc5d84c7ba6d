-- Grouped claims (issue 16): a gateway places the requests that arrive while its previous placement
-- is in Postgres with one call, as it already ends jobs in batches (complete_jobs()). One statement
-- and one commit for the group instead of one each: less of Postgres's time per request goes to the
-- protocol, the executor's start-up and the commit.
--
-- Each request is placed exactly as place_job() places it, in the order given, each seeing the
-- claims of those before it (a node's slots fill and its score drops, as between separate calls).
-- One that fails (its key's budget spent, a bad parameter) fails alone: its row says how (the
-- SQLSTATE and message place_job() raised) and the others are placed all the same.
--
-- Locks: the group holds the rows of the nodes (and budgeted keys) it has claimed until it commits,
-- and it claims in ranking order, not in the id order completions lock in. A later request of the
-- group that waited for a row a completion holds could deadlock with it (measured: a 1 s stall at
-- 64 callers, Postgres's deadlock_timeout). So only the first request to place waits for locks as
-- place_job() does; the others wait at most 10 ms and then fail with lock_not_available
-- (55P03), and the gateway asks again for them in its next call, where one of them goes first.

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
  v_placed record;
  v_lock_timeout text := current_setting('lock_timeout');
  v_holding boolean := false;  -- whether an earlier request of the group holds row locks
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
      perform set_config('neuralgrid.end_user', coalesce(r.end_user, ''), true),
              set_config('lock_timeout', case when v_holding then '10ms' else v_lock_timeout end, true);
      select * into v_placed
      from public.place_job(r.model, r.key, r.policy, r.min_vram, r.region, r.lat, r.lon, r.max_rate,
                            coalesce(r.stream, false), coalesce(r.fallbacks, 0), r.prompt_bytes, r.max_out,
                            coalesce(r.wait, false), r.route) p;
      v_holding := v_holding or v_placed.job_id is not null;
      return query
      select r.n::integer, v_placed.job_id, v_placed.node_id, v_placed.endpoint_url, v_placed.node_key,
        v_placed.attempt, v_placed.fallback_ids, v_placed.error, v_placed.max_output_tokens, v_placed.busy,
        v_placed.tokens_per_s, v_placed.refusal, null::text, null::text;
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
  'order, as p_gateway; a request that fails gives its SQLSTATE and message and fails alone (55P03: '
  'it would have waited for a row lock behind the group''s own; ask again).';

revoke execute on function public.place_jobs(text, jsonb) from public, anon, authenticated;
grant execute on function public.place_jobs(text, jsonb) to service_role;
