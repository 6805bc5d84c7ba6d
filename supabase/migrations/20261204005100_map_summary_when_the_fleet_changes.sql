-- The map's summary is computed when the fleet changed what it counts, not every second (issue 41).
--
-- Measured with `neuralgrid bench map` at 100,000 nodes: with a viewer watching and nothing changing,
-- Postgres spent some 40 ms of CPU a second more than with no viewer, each second's summary computed
-- again to find it unchanged. A statement trigger now moves a sequence (no row, no lock) when a
-- statement inserts, deletes or truncates nodes or sets what the summary counts (status, place,
-- region, GPU, VRAM, TFLOPS, price); send_map_summary() computes only when that mark moved in the
-- last 10 seconds (a writer's nextval comes before its commit: a change may become visible a little
-- after the mark moves), when the jobs' totals it carries changed, or when the last summary is 30 s
-- old (a change written without triggers, or a transaction longer than 10 s). Otherwise a second
-- costs one update of map_feed's row.

create sequence private.map_changes;
comment on sequence private.map_changes is 'Moved by every statement that changes what the map''s summary counts (private.note_map_change()): send_map_summary() computes the summary only when it moved lately.';
revoke all on sequence private.map_changes from public, anon, authenticated;
grant select on sequence private.map_changes to service_role;

create or replace function private.note_map_change()
returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  perform pg_catalog.nextval('private.map_changes');
  return null;
end;
$$;
comment on function private.note_map_change() is 'Trigger: a statement changed what the map''s summary counts (nodes inserted, deleted or truncated, or their status, place, region, GPU, VRAM, TFLOPS or price set); moves private.map_changes. Security definer: writers need no right on the sequence.';
revoke all on function private.note_map_change() from public;

create trigger nodes_map_changed
  after insert or delete or update of status, latitude, longitude, region, gpu_model, vram_gb, tflops, hourly_rate
  on public.nodes for each statement execute function private.note_map_change();
create trigger nodes_map_truncated
  after truncate on public.nodes for each statement execute function private.note_map_change();

alter table public.map_feed
  add column changes bigint not null default 0,
  add column changed_at timestamptz not null default '-infinity',
  add column computed_at timestamptz not null default '-infinity';
comment on column public.map_feed.changes is 'private.map_changes as the last check saw it.';
comment on column public.map_feed.changed_at is 'When a check last saw private.map_changes move.';
comment on column public.map_feed.computed_at is 'When the summary was last computed (sent or found unchanged).';

create or replace function private.send_map_summary()
returns boolean
language plpgsql
set search_path = ''
as $$
declare
  v_mark bigint := (select case when s.is_called then s.last_value else 0 end from private.map_changes s);
  v_last jsonb;
  v_seq bigint;
  v_changed_at timestamptz;
  v_computed_at timestamptz;
  v_now jsonb;
  v_message jsonb;
begin
  -- Every gateway calls this every second: one call in 950 ms checks the fleet. The row's lock makes a
  -- caller at the same moment wait, then find it checked.
  update public.map_feed f set checked_at = now(),
    changed_at = case when f.changes is distinct from v_mark then now() else f.changed_at end,
    changes = v_mark
  where f.checked_at <= now() - interval '950 milliseconds'
  returning f.summary, f.seq, f.changed_at, f.computed_at into v_last, v_seq, v_changed_at, v_computed_at;
  if not found then
    return false;
  end if;
  -- Nothing it counts changed lately, nor the jobs' totals it carries: no need to count again.
  if v_last is not null and v_changed_at < now() - interval '10 seconds'
     and v_computed_at > now() - interval '30 seconds'
     and exists (select from public.fleet_activity a
                 where coalesce(to_jsonb(a.jobs_last_minute), 'null') = v_last -> 'stats' -> 'jobs_last_minute'
                   and coalesce(to_jsonb(a.p50_latency_ms), 'null') = v_last -> 'stats' -> 'p50_latency_ms') then
    return false;
  end if;
  v_now := public.map_summary(false);
  update public.map_feed set computed_at = now();
  if v_last is not null and (v_now - 'at') = (v_last - 'at' - 'seq') then
    return false;  -- nothing changed: no message
  end if;
  v_seq := v_seq + 1;
  if v_last is null then
    v_message := v_now || jsonb_build_object('seq', v_seq, 'full', true);
  else
    -- The changes only: a viewer applies message seq to what it holds of seq - 1, or reads the whole.
    v_message := v_now || jsonb_build_object(
      'seq', v_seq, 'full', false,
      'tiles', private.json_changes(v_last -> 'tiles', v_now -> 'tiles'),
      'regions', private.json_changes(v_last -> 'regions', v_now -> 'regions'),
      'gpus', private.json_changes(v_last -> 'gpus', v_now -> 'gpus'));
  end if;
  perform realtime.send(v_message, 'summary', 'map:summary', false);
  update public.map_feed set seq = v_seq, summary = v_now || jsonb_build_object('seq', v_seq), sent_at = now();
  return true;
end;
$$;
comment on function private.send_map_summary() is 'Broadcasts the map''s summary on the public map:summary topic (event summary) when it changed since the last one sent, as the changes to it (full: false; tiles, regions and gpus hold the keys that changed, null for one gone) numbered by seq; unless the gateways checked in the last 950 ms. Counts the fleet only when private.map_changes moved in the last 10 s, the jobs'' totals changed, or the last count is 30 s old. Returns whether it sent one. Each gateway calls it every second while it has a map viewer (always under a hosted project''s Realtime).';
