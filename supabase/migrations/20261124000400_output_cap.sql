-- A budget hold never smaller than what the node may produce.
--
-- match_job() admitted one request whatever its size when the key held nothing (a $0.01 key asking
-- for 1,000,000 tokens was charged $0.10). The sized overload now caps the answer at what is left of
-- the key's budget after the prompt, holds exactly that, and returns the cap: the gateway tells the
-- node (max_tokens), so the charge can never pass the hold. A budget that cannot pay for the prompt
-- and one token of answer is refused (NG402). Keys without a budget, and models the catalog does not
-- price, are not capped here.

drop function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer);

-- No defaults: a call with fewer than twelve arguments can only mean the overload that takes USD.
create function public.match_job(
  p_model text,
  p_api_key_id uuid,
  p_policy text,
  p_min_vram_gb real,
  p_region text,
  p_latitude double precision,
  p_longitude double precision,
  p_max_hourly_rate numeric,
  p_stream boolean,
  p_fallbacks integer,
  p_prompt_bytes integer,
  p_max_output_tokens integer
) returns table (
  job_id uuid,
  node_id uuid,
  endpoint_url text,
  node_key bytea,
  attempt integer,
  fallback_ids uuid[],
  error text,
  max_output_tokens integer
)
language plpgsql
set search_path = ''
as $$
declare
  v_cap integer := p_max_output_tokens;
  v_left numeric;
  v_input_price numeric;
  v_output_price numeric;
begin
  if p_prompt_bytes is null or p_max_output_tokens is null or p_prompt_bytes < 0 or p_max_output_tokens < 0 then
    raise exception 'prompt_bytes and max_output_tokens must be given and must not be negative'
      using errcode = 'invalid_parameter_value';
  end if;
  select k.budget_usd - k.spent_usd - k.reserved_usd into v_left
  from public.api_keys k where k.id = p_api_key_id and k.budget_usd is not null;
  select m.input_usd_per_mtok, m.output_usd_per_mtok into v_input_price, v_output_price
  from public.models m where m.id = p_model;
  if v_left is not null and coalesce(v_output_price, 0) > 0 then
    -- Read without a lock: the hold below is checked again, atomically, when match_job() takes it.
    v_cap := least(p_max_output_tokens::bigint, floor(greatest(
      v_left - p_prompt_bytes / 4.0 * coalesce(v_input_price, 0) / 1e6, 0) * 1e6 / v_output_price)::bigint);
    if v_cap < least(p_max_output_tokens, 1) then
      raise exception 'the budget left on this API key ($%) cannot pay for this request''s prompt and one token of answer',
        round(greatest(v_left, 0), 6) using errcode = 'NG402';
    end if;
  end if;
  return query
  select m.*, v_cap
  from public.match_job(p_model, p_api_key_id, p_policy, p_min_vram_gb, p_region, p_latitude, p_longitude,
                        p_max_hourly_rate, p_stream, p_fallbacks,
                        private.budget_hold(p_model, p_prompt_bytes, v_cap)) m;
end;
$$;
comment on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer) is 'match_job() with the budget hold priced in SQL: p_prompt_bytes (about four bytes a token) and up to p_max_output_tokens of answer (0 for an embedding) at the catalog''s per-token prices, as complete_jobs() charges. The answer is capped at what the key''s remaining budget pays for (returned as max_output_tokens, for the node to be told); NG402 when that is not one token. Every argument is required.';
revoke execute on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer) from public, anon, authenticated;
grant execute on function public.match_job(text, uuid, text, real, text, double precision, double precision, numeric, boolean, integer, integer, integer) to service_role;
