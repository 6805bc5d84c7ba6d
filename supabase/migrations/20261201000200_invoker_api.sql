-- Two API functions run as their caller now, not as their owner.
--
-- Supabase's newer advisors warn of every SECURITY DEFINER function that anon or authenticated may
-- execute (lints 0028 and 0029): through /rest/v1/rpc it runs with its owner's rights, past row-level
-- security. Two of ours needed their owner's rights for nothing a grant and a policy cannot give:
--
--   * create_api_key() inserts the caller's own key. A signed-in user may now insert into api_keys
--     the columns a new key has, as its owner only (a policy), and the function does that for them.
--     Keys stay the platform's to make: a trigger takes from a signed-in user only the key hash that
--     create_api_key() made in the same transaction (the Data API sets no such setting), so a key of
--     the user's choosing (a weak one, a prefix that is not its own) is still refused.
--   * fleet_stats() counted every user's jobs, which no API role may read. The sweep now writes
--     those two totals to public.fleet_activity (every 5 seconds), which anyone may read;
--     fleet_stats() reads it with the node columns the map already shows.

-- create_api_key() ------------------------------------------------------------------------------------

grant insert (owner_id, name, prefix, key_hash, rpm_limit, tpm_limit, budget_usd)
  on table public.api_keys to authenticated;
create policy "Users can add keys of their own" on public.api_keys
  for insert to authenticated with check (owner_id = (select auth.uid()));

create function private.api_keys_issued_only() returns trigger
language plpgsql
set search_path = ''
as $$
begin
  if current_user = 'authenticated'
     and new.key_hash is distinct from decode(nullif(current_setting('neuralgrid.issued_key_hash', true), ''), 'hex') then
    raise exception 'API keys are issued by create_api_key(): a key of one''s own choosing is not accepted'
      using errcode = 'insufficient_privilege';
  end if;
  return new;
end;
$$;
comment on function private.api_keys_issued_only() is 'Trigger: a signed-in user''s new key must be the one create_api_key() made in this transaction.';
revoke execute on function private.api_keys_issued_only() from public, anon, authenticated;
create trigger api_keys_issued_only before insert on public.api_keys
  for each row execute function private.api_keys_issued_only();

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
  perform set_config('neuralgrid.issued_key_hash', encode(v_hash, 'hex'), true);  -- for the trigger
  return query
    insert into public.api_keys as k (owner_id, name, prefix, key_hash, rpm_limit, tpm_limit, budget_usd)
    values (v_owner, p_name, left(v_key, 11), v_hash, p_rpm_limit, p_tpm_limit, p_budget_usd)
    returning k.id, v_key, k.prefix;
  perform set_config('neuralgrid.issued_key_hash', '', true);  -- this key only, not the rest of the transaction
end;
$$;

-- fleet_stats() -----------------------------------------------------------------------------------------

create table public.fleet_activity (
  one_row boolean primary key default true,
  jobs_last_minute bigint not null default 0,
  p50_latency_ms double precision,
  measured_at timestamptz not null default now(),
  constraint "fleet_activity has one row" check (one_row)
);
comment on table public.fleet_activity is 'The jobs of the last minute and the median latency of those of the last five, over every user, as the sweep last measured them (every 5 seconds): totals anyone may read, of jobs no API role may read one by one.';
insert into public.fleet_activity (measured_at) values ('-infinity');  -- never measured: the first sweep does
revoke all on table public.fleet_activity from anon, authenticated;
grant select on table public.fleet_activity to anon, authenticated;
grant all on table public.fleet_activity to service_role;
alter table public.fleet_activity enable row level security;
create policy "Anyone can read the fleet's activity" on public.fleet_activity
  for select to anon, authenticated using (true);

create function private.refresh_fleet_activity() returns void
language sql
set search_path = ''
as $$
  -- At most every 5 seconds, whoever sweeps (each gateway, pg_cron): the median sorts five minutes of
  -- jobs, some 100,000 rows at 370 requests/s. The indexes of the fleet_stats migration keep both
  -- counts to the newest rows.
  update public.fleet_activity set
    jobs_last_minute = (select count(*) from public.jobs j where j.created_at > now() - interval '1 minute'),
    p50_latency_ms = (select percentile_cont(0.5) within group (order by j.latency_ms) from public.jobs j
                      where j.finished_at > now() - interval '5 minutes' and j.latency_ms is not null),
    measured_at = now()
  where measured_at <= now() - interval '5 seconds';
$$;
comment on function private.refresh_fleet_activity() is 'Measures public.fleet_activity from every user''s jobs, unless it was measured in the last 5 seconds. Run by sweep() every second.';
revoke execute on function private.refresh_fleet_activity() from public, anon, authenticated;
grant execute on function private.refresh_fleet_activity() to service_role;

create or replace function public.fleet_stats()
returns table (
  online_nodes bigint, online_vram_gb double precision, online_tflops double precision,
  jobs_last_minute bigint, p50_latency_ms double precision, cheapest jsonb
)
language sql stable
security invoker
set search_path = ''
as $$
  -- Nodes as the map shows them (anyone may read these columns); jobs as the sweep last counted them.
  with live as (
    select n.gpu_model, n.vram_gb, n.tflops, n.hourly_rate from public.nodes n
    where n.status in ('online', 'busy')
  )
  select
    (select count(*) from live),
    (select coalesce(sum(l.vram_gb), 0)::float8 from live l),
    (select coalesce(sum(l.tflops), 0)::float8 from live l),
    a.jobs_last_minute,
    a.p50_latency_ms,
    (select coalesce(jsonb_agg(jsonb_build_object('gpu_model', c.gpu_model, 'hourly_rate', c.rate)
                               order by c.rate, c.gpu_model), '[]')
       from (select l.gpu_model, min(l.hourly_rate)::float8 as rate from live l group by l.gpu_model) c)
  from public.fleet_activity a
$$;
comment on function public.fleet_stats() is 'The fleet''s totals for the map: nodes online or busy, their VRAM and TFLOPS, the cheapest hourly rate per GPU model, and the jobs of the last minute with their median latency (as the sweep last measured them, every 5 seconds). Runs as its caller: anon may call it.';

create or replace function public.sweep(p_max_job_age interval default null)
returns table (kind text, id uuid, name text)
language plpgsql
set search_path = ''
as $$
declare
  v_max_job_age interval := coalesce(
    p_max_job_age, (select make_interval(secs => s.job_deadline_s) from public.platform_settings s));
begin
  return query select 'node_offline'::text, s.node_id, s.name from public.sweep_stale_nodes() s;
  return query select 'node_offline'::text, s.node_id, s.name from private.sweep_dead_tunnels() s;
  return query select 'job_orphaned'::text, s.job_id, null::text from private.sweep_orphaned_jobs() s;
  return query select 'job_abandoned'::text, s.job_id, null::text from public.sweep_stale_jobs(v_max_job_age) s;
  perform private.refresh_vram_pressure();
  perform private.refresh_fleet_activity();
end;
$$;
comment on function public.sweep(interval) is 'One sweep: silent nodes offline (sweep_stale_nodes()), tunnel nodes whose gateway fell silent offline (sweep_dead_tunnels(); kind node_offline too), the running jobs of silent gateways ended (kind job_orphaned), and jobs running longer than p_max_job_age (default: platform_settings.job_deadline_s) ended (kind job_abandoned); then the VRAM pressure and the fleet''s activity measured. Returns a row per node set offline (with its name) and per job ended. Run every second by pg_cron where it is installed, else by the service''s sweeper.';
