-- A revoked key stays revoked, and a budget is a number.
--
-- Found by a security review and a billing review (reproduced twice each):
-- - A signed-in user could undo a revocation, their own or the platform's: `authenticated` may
--   update revoked_at (to revoke through the Data API), and nothing stopped it going back to null
--   (PATCH /api_keys?id=eq.X {"revoked_at": null}); the key then worked at the gateway again. A
--   trigger now refuses any change to a revoked_at that is set, whoever asks.
-- - create_api_key(p_budget_usd => 'NaN') stored a NaN budget ('NaN' >= 0 holds in Postgres, and
--   'NaN' = round('NaN', 4)): the key's chat requests failed with "cannot convert NaN to bigint",
--   its embeddings ran with no limit, and /v1/usage said it had no budget. A rule refuses it now;
--   a key that has one already keeps its spend and gets a budget of 0 (it could pay for nothing
--   that was checked).

create function private.api_keys_revocation_is_final() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  if old.revoked_at is not null and new.revoked_at is distinct from old.revoked_at then
    raise exception 'API key % is revoked, and a revocation cannot be undone: create a new key', old.prefix
      using errcode = 'check_violation', column = 'revoked_at';
  end if;
  return new;
end;
$$;
comment on function private.api_keys_revocation_is_final() is 'Trigger: a revoked key''s revoked_at never changes again (no role may undo a revocation).';
revoke execute on function private.api_keys_revocation_is_final() from public, anon, authenticated;
create trigger api_keys_revocation_is_final before update of revoked_at on public.api_keys
  for each row execute function private.api_keys_revocation_is_final();

-- The rule joins the others about what a key is, in its description trigger (a CHECK constraint
-- would be prepared for every claim and release: 20261202000100), first, as Postgres would check
-- it by name.
update public.api_keys set budget_usd = 0 where budget_usd = 'NaN';

create or replace function private.api_keys_check_description() returns trigger
language plpgsql
set search_path = ''
as $$
declare
  v_rule text;  -- the first rule broken, in the order Postgres checks constraints (by name)
begin
  if new.budget_usd = 'NaN' then  -- NaN >= 0 holds in Postgres
    v_rule := 'budget_usd must be a number';
  elsif not (new.budget_usd >= 0) then
    v_rule := 'budget_usd must not be negative';
  elsif not (length(trim(new.name)) between 1 and 100) then
    v_rule := 'key name must be 1 to 100 characters';
  elsif not (length(new.key_hash) = 32) then
    v_rule := 'key_hash must be a SHA-256 digest';
  elsif not (new.rpm_limit > 0) then
    v_rule := 'rpm_limit must be positive';
  elsif not (new.tpm_limit > 0) then
    v_rule := 'tpm_limit must be positive';
  end if;
  if v_rule is not null then
    raise exception 'new row for relation "%" violates check constraint "%"', tg_table_name, v_rule
      using errcode = 'check_violation', constraint = v_rule, table = tg_table_name, schema = tg_table_schema;
  end if;
  return new;
end;
$$;
comment on function private.api_keys_check_description() is 'Trigger: the rules about what a key is (name, hash, limits, a budget that is a number and not negative), checked when a statement writes one of those columns; each raises the check_violation its CHECK constraint did.';
