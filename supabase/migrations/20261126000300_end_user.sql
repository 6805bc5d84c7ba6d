-- The `user` a developer sends with a request (OpenAI's field for their own end user), recorded on
-- the job so that usage can be told apart per end user (GET /v1/usage?user=...).

alter table public.jobs add column end_user text;
alter table public.jobs add constraint "end_user is at most 256 characters" check (length(end_user) <= 256);
comment on column public.jobs.end_user is 'The request''s `user` field: the developer''s own name for their end user, as they sent it.';

create index jobs_api_key_end_user_idx on public.jobs (api_key_id, end_user) where end_user is not null;

create or replace function private.stamp_job_gateway()
returns trigger
language plpgsql
set search_path = ''
as $$
begin
  -- The gateway names itself and the request's end user for the statement that places the job
  -- (neuralgrid.gateway_id and neuralgrid.end_user, set local to it), so no function signature
  -- changes and transaction poolers are safe.
  new.gateway_id := coalesce(new.gateway_id, nullif(current_setting('neuralgrid.gateway_id', true), '')::uuid);
  new.end_user := coalesce(new.end_user, nullif(current_setting('neuralgrid.end_user', true), ''));
  return new;
end
$$;
comment on function private.stamp_job_gateway() is 'Trigger: records on a new job the gateway placing it and the request''s end user (the neuralgrid.gateway_id and neuralgrid.end_user settings).';
