-- A key's budget is kept to 4 decimals (api_keys.budget_usd is numeric(12,4)), and a value with more
-- was rounded on its way into the column, silently: create_api_key(p_budget_usd => 0.00001) made a
-- key with a budget of $0. The column's type rounds before any constraint or trigger sees the value,
-- so the function that takes the budget refuses it instead, for every caller (the gateway, the CLI,
-- a signed-in user through the Data API), naming the column at fault.

create or replace function public.create_api_key(
  p_name text,
  p_rpm_limit integer default null,
  p_tpm_limit integer default null,
  p_budget_usd numeric default null
) returns table (id uuid, api_key text, prefix text)
language plpgsql
security invoker
set search_path = ''
as $$
declare
  -- 244 random bits from two v4 UUIDs (core gen_random_uuid uses the server's strong RNG).
  v_key text := 'ng-' || encode(uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()), 'hex');
  v_hash bytea := sha256(convert_to(v_key, 'UTF8'));
  v_owner uuid := auth.uid();
begin
  if auth.role() = 'anon' or (auth.role() = 'authenticated' and v_owner is null) then
    raise exception 'only a signed-in user or the service can create API keys'
      using errcode = 'insufficient_privilege';
  end if;
  if p_budget_usd <> round(p_budget_usd, 4) then
    raise exception 'budget_usd must be given to a hundredth of a cent (4 decimals), as the ledger keeps it'
      using errcode = 'invalid_parameter_value', column = 'budget_usd';
  end if;
  perform set_config('neuralgrid.issued_key_hash', encode(v_hash, 'hex'), true);  -- for the trigger
  return query
    insert into public.api_keys as k (owner_id, name, prefix, key_hash, rpm_limit, tpm_limit, budget_usd)
    values (v_owner, p_name, left(v_key, 11), v_hash, p_rpm_limit, p_tpm_limit, p_budget_usd)
    returning k.id, v_key, k.prefix;
  perform set_config('neuralgrid.issued_key_hash', '', true);  -- this key only, not the rest of the transaction
end;
$$;
