-- A budget refusal says what it weighed: the hold is an estimate (a token per 4 bytes of the
-- request), and holds of requests under way (gateways' escrows among them) are apart from what is
-- left (a new user read "cannot pay for this request's prompt" of a prompt it could pay for).

CREATE OR REPLACE FUNCTION private.answer_cap(p_model text, p_api_key_id uuid, p_prompt_bytes integer, p_max_output_tokens integer) RETURNS integer
    LANGUAGE plpgsql STABLE
    SET search_path TO ''
    AS $_$
declare
  v_cap integer := p_max_output_tokens;
  v_left numeric;
  v_held numeric;
  v_input_price numeric;
  v_output_price numeric;
begin
  if p_prompt_bytes is null or p_max_output_tokens is null or p_prompt_bytes < 0 or p_max_output_tokens < 0 then
    raise exception 'prompt_bytes and max_output_tokens must be given and must not be negative'
      using errcode = 'invalid_parameter_value';
  end if;
  select k.budget_usd - k.spent_usd - k.reserved_usd, k.reserved_usd into v_left, v_held
  from public.api_keys k where k.id = p_api_key_id and k.budget_usd is not null;
  select m.input_usd_per_mtok, m.output_usd_per_mtok into v_input_price, v_output_price
  from public.models m where m.id = p_model;
  if v_left is not null and coalesce(v_output_price, 0) > 0 then
    v_cap := least(p_max_output_tokens::bigint, floor(greatest(
      v_left - p_prompt_bytes / 4.0 * coalesce(v_input_price, 0) / 1e6, 0) * 1e6 / v_output_price)::bigint);
    if v_cap < least(p_max_output_tokens, 1) then
      -- Says what the hold is: an estimate (a token per 4 bytes of the request), not the prompt's
      -- real price, and that holds of requests under way (gateways' escrows among them) are apart.
      raise exception 'the budget left on this API key ($%, with $% more held for requests under way) cannot cover this request''s hold: its prompt, reckoned at one token per 4 of its % bytes, and one token of answer',
        round(greatest(v_left, 0), 6), round(v_held, 6), p_prompt_bytes using errcode = 'NG402';
    end if;
  end if;
  return v_cap;
end;
$_$;

COMMENT ON FUNCTION private.answer_cap(p_model text, p_api_key_id uuid, p_prompt_bytes integer, p_max_output_tokens integer) IS 'The longest answer (tokens, up to p_max_output_tokens) the key''s remaining budget pays for after a prompt of p_prompt_bytes, at the catalog''s prices; NG402 when not one token. place_job()''s and place_jobs()''s first step.';
