-- What moves the map's change mark is a row that changed, not a statement (issue 41).
--
-- bench map at 100,000 nodes, the fleet at rest: the page's feed still counted the fleet every second.
-- The statement trigger of 20261204005100 fired for every UPDATE naming a counted column, and the
-- sweep runs one each second (sweep_stale_nodes() sets status where a node fell silent: mostly no
-- row); a statement that sets a status to what it was fired it too. Now a row trigger moves
-- private.map_changes, on an update only when a counted column's value changed (its WHEN), and on
-- each row inserted or deleted; a truncate still moves it once.

drop trigger nodes_map_changed on public.nodes;

create trigger nodes_map_changed_insert_delete
  after insert or delete on public.nodes
  for each row execute function private.note_map_change();
create trigger nodes_map_changed_update
  after update of status, latitude, longitude, region, gpu_model, vram_gb, tflops, hourly_rate on public.nodes
  for each row
  when (old.status is distinct from new.status or old.latitude is distinct from new.latitude
        or old.longitude is distinct from new.longitude or old.region is distinct from new.region
        or old.gpu_model is distinct from new.gpu_model or old.vram_gb is distinct from new.vram_gb
        or old.tflops is distinct from new.tflops or old.hourly_rate is distinct from new.hourly_rate)
  execute function private.note_map_change();

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
comment on function private.note_map_change() is 'Trigger: a node changed what the map''s summary counts (inserted, deleted, its status, place, region, GPU, VRAM, TFLOPS or price changed; or the nodes truncated); moves private.map_changes. Security definer: writers need no right on the sequence.';
