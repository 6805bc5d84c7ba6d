-- The model catalog, the platform's operating settings and the matching policies' weights.
-- Operators change settings and weights with plain UPDATEs: no migration, no restart.

create table public.models (
  id text primary key,
  min_vram_gb real not null,
  context_length integer not null default 8192,
  kind text not null default 'chat',
  input_usd_per_mtok numeric(10, 4),
  output_usd_per_mtok numeric(10, 4),
  cold_start_s real not null default 20,
  tokens_per_s_per_tflop real,
  created_at timestamptz not null default now(),
  constraint "model id must not be empty" check (length(trim(id)) > 0),
  constraint "min_vram_gb must be positive" check (min_vram_gb > 0),
  constraint "context_length must be positive" check (context_length > 0),
  constraint "kind must be chat, completion or embedding" check (kind in ('chat', 'completion', 'embedding')),
  constraint "prices must not be negative" check (
    coalesce(input_usd_per_mtok, 0) >= 0 and coalesce(output_usd_per_mtok, 0) >= 0
  ),
  constraint "cold_start_s must not be negative" check (cold_start_s >= 0),
  constraint "tokens_per_s_per_tflop must be positive" check (tokens_per_s_per_tflop > 0)
);
comment on table public.models is 'The model catalog: VRAM a model needs, its context length and price hints (USD per million tokens).';
comment on column public.models.tokens_per_s_per_tflop is 'Decode speed (one stream) a node should reach per claimed dense FP16 TFLOP; set low on purpose, it only has to catch gross overclaims.';

revoke all on table public.models from anon, authenticated;
grant select on table public.models to anon, authenticated;
grant all on table public.models to service_role;
alter table public.models enable row level security;
create policy "Anyone can read the model catalog" on public.models
  for select to anon, authenticated using (true);

insert into public.models (id, min_vram_gb, context_length, kind, input_usd_per_mtok, output_usd_per_mtok,
                           cold_start_s, tokens_per_s_per_tflop) values
  ('BAAI/bge-large-en-v1.5', 2, 512, 'embedding', 0.01, 0, 5, null),
  ('Qwen/Qwen2.5-0.5B-Instruct', 2, 32768, 'chat', 0.02, 0.02, 8, 2.0),
  ('meta-llama/Llama-3.2-3B-Instruct', 8, 131072, 'chat', 0.03, 0.05, 10, 0.8),
  ('mistralai/Mistral-7B-Instruct-v0.3', 16, 32768, 'chat', 0.05, 0.10, 15, 0.4),
  ('meta-llama/Llama-3.1-8B-Instruct', 18, 131072, 'chat', 0.05, 0.10, 15, 0.35),
  ('Qwen/Qwen2.5-14B-Instruct', 32, 32768, 'chat', 0.10, 0.20, 20, 0.2),
  ('Qwen/Qwen2.5-32B-Instruct-AWQ', 24, 32768, 'chat', 0.15, 0.30, 22, 0.15),
  ('meta-llama/Llama-3.3-70B-Instruct-AWQ', 42, 131072, 'chat', 0.35, 0.60, 30, 0.06),
  ('meta-llama/Llama-3.3-70B-Instruct', 148, 131072, 'chat', 0.60, 0.90, 30, 0.03);

create table public.platform_settings (
  id boolean primary key default true,
  heartbeat_interval_s real not null default 5,
  missed_heartbeats_offline integer not null default 3,
  cooldown_base_s real not null default 5,
  cooldown_max_s real not null default 300,
  constraint "platform_settings has exactly one row" check (id),
  constraint "heartbeat_interval_s must be positive" check (heartbeat_interval_s > 0),
  constraint "missed_heartbeats_offline must be at least 1" check (missed_heartbeats_offline >= 1),
  constraint "cooldowns must be positive and base <= max" check (
    cooldown_base_s > 0 and cooldown_max_s >= cooldown_base_s
  )
);
comment on table public.platform_settings is 'One row of operating settings: heartbeat interval, misses before offline, failure cooldowns.';

revoke all on table public.platform_settings from anon, authenticated;
grant select on table public.platform_settings to anon, authenticated;
grant all on table public.platform_settings to service_role;
alter table public.platform_settings enable row level security;
create policy "Anyone can read the platform settings" on public.platform_settings
  for select to anon, authenticated using (true);

insert into public.platform_settings default values;

create table public.matching_policies (
  name text primary key,
  description text not null,
  fit real not null default 0,
  compute real not null default 0,
  price real not null default 0,
  warm real not null default 0,
  capacity real not null default 0,
  reputation real not null default 0,
  proximity real not null default 0,
  compute_half_tflops real not null default 100,
  price_half_usd_per_tflop_hour real not null default 0.003,
  distance_half_km real not null default 1000,
  constraint "policy name must be a lowercase word" check (name ~ '^[a-z][a-z0-9_]*$'),
  constraint "weights must not be negative" check (
    least(fit, compute, price, warm, capacity, reputation, proximity) >= 0
  ),
  constraint "at least one weight must be positive" check (
    fit + compute + price + warm + capacity + reputation + proximity > 0
  ),
  constraint "half-points must be positive" check (
    compute_half_tflops > 0 and price_half_usd_per_tflop_hour > 0 and distance_half_km > 0
  )
);
comment on table public.matching_policies is 'Weights of the normalized score components per policy; `seed` is the original formula and is not listed here.';

revoke all on table public.matching_policies from anon, authenticated;
grant select on table public.matching_policies to anon, authenticated;
grant all on table public.matching_policies to service_role;
alter table public.matching_policies enable row level security;
create policy "Anyone can read the matching policies" on public.matching_policies
  for select to anon, authenticated using (true);

-- Default weights tuned with `neuralgrid simulate` (README, "Matching quality, simulated"): on the
-- default scenario and on the light-load demo fleet, these beat or match every other set tried.
-- Proximity weighs nothing by default: a cross-ocean round trip is small next to generation time;
-- operators serving short, latency-critical requests can raise it.
insert into public.matching_policies (name, description, fit, compute, price, warm, capacity, reputation, proximity) values
  ('balanced', 'Right-sized, fast, cheap per unit of work, warm, free and reliable, each normalized to [0,1].',
   0.02, 0.40, 0.18, 0.25, 0.10, 0.05, 0.00);
