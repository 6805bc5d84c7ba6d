-- Developer API keys: stored as SHA-256 hashes, shown in clear exactly once, at creation.

create table public.api_keys (
  id uuid primary key default gen_random_uuid(),
  owner_id uuid references auth.users (id) on delete cascade default auth.uid(),
  name text not null,
  prefix text not null,
  key_hash bytea not null unique,
  rpm_limit integer,
  tpm_limit integer,
  budget_usd numeric(12, 4),
  spent_usd numeric(16, 8) not null default 0,
  reserved_usd numeric(16, 8) not null default 0,
  created_at timestamptz not null default now(),
  last_used_at timestamptz,
  revoked_at timestamptz,
  constraint "key name must be 1 to 100 characters" check (length(trim(name)) between 1 and 100),
  constraint "key_hash must be a SHA-256 digest" check (length(key_hash) = 32),
  constraint "rpm_limit must be positive" check (rpm_limit > 0),
  constraint "tpm_limit must be positive" check (tpm_limit > 0),
  constraint "budget_usd must not be negative" check (budget_usd >= 0),
  constraint "spent_usd must not be negative" check (spent_usd >= 0),
  constraint "reserved_usd must not be negative" check (reserved_usd >= 0)
);
comment on table public.api_keys is 'Developer API keys (hash only), with per-key rate limits and a USD budget.';

create index api_keys_owner_idx on public.api_keys (owner_id);

revoke all on table public.api_keys from anon, authenticated;
grant select (id, owner_id, name, prefix, rpm_limit, tpm_limit, budget_usd, spent_usd, reserved_usd,
  created_at, last_used_at, revoked_at) on table public.api_keys to authenticated;
grant update (name, revoked_at) on table public.api_keys to authenticated;
grant all on table public.api_keys to service_role;
alter table public.api_keys enable row level security;

create policy "Users can see their own keys" on public.api_keys
  for select to authenticated using (owner_id = (select auth.uid()));
create policy "Users can rename or revoke their own keys" on public.api_keys
  for update to authenticated using (owner_id = (select auth.uid()))
  with check (owner_id = (select auth.uid()));

create function public.create_api_key(
  p_name text,
  p_rpm_limit integer default null,
  p_tpm_limit integer default null,
  p_budget_usd numeric default null
) returns table (id uuid, api_key text, prefix text)
language plpgsql
security definer
set search_path = ''
as $$
declare
  -- 244 random bits from two v4 UUIDs (core gen_random_uuid uses the server's strong RNG).
  v_key text := 'ng-' || encode(uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()), 'hex');
  v_owner uuid := auth.uid();
begin
  if auth.role() = 'anon' or (auth.role() = 'authenticated' and v_owner is null) then
    raise exception 'only a signed-in user or the service can create API keys'
      using errcode = 'insufficient_privilege';
  end if;
  return query
    insert into public.api_keys as k (owner_id, name, prefix, key_hash, rpm_limit, tpm_limit, budget_usd)
    values (v_owner, p_name, left(v_key, 11), sha256(convert_to(v_key, 'UTF8')), p_rpm_limit,
            p_tpm_limit, p_budget_usd)
    returning k.id, v_key, k.prefix;
end;
$$;
comment on function public.create_api_key(text, integer, integer, numeric) is 'Creates an API key owned by the caller and returns it in clear, the only time it is ever shown.';
revoke execute on function public.create_api_key(text, integer, integer, numeric) from public, anon;
grant execute on function public.create_api_key(text, integer, integer, numeric) to authenticated, service_role;

create function public.notify_api_key_change() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- Gateways cache keys; this tells every instance (LISTEN neuralgrid_api_keys) to forget one.
  perform pg_notify('neuralgrid_api_keys', new.id::text);
  return null;
end;
$$;
comment on function public.notify_api_key_change() is 'Trigger: announces a revoked or re-limited key on channel neuralgrid_api_keys.';
revoke execute on function public.notify_api_key_change() from public, anon, authenticated;

create trigger api_keys_notify_change
  after update of revoked_at, rpm_limit, tpm_limit, budget_usd on public.api_keys
  for each row execute function public.notify_api_key_change();
