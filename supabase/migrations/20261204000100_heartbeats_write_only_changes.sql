-- A heartbeat that changes nothing runs no trigger it does not need (issue 41).
--
-- Measured on 2,000 nodes, one agent_heartbeat() a beat (2026-12-04): 3.8 to 4.0 ms of Postgres CPU a
-- beat, 3.2 ms of it in private.refresh_node_scores(). The warm-model sync changes no row in steady
-- state, yet its two statements (an INSERT .. ON CONFLICT DO UPDATE, which fires the INSERT and the
-- UPDATE statement triggers, and an UPDATE) fired three statement-level triggers, each calling
-- refresh_node_scores() on an empty set of nodes; a call planned afresh each time (1.1 ms, against
-- some 0.02 ms with a cached plan). And the nodes UPDATE names the description columns in every beat,
-- so the full validation trigger ran though no column it checks had changed.
--
-- - sync_warm_models() looks before it writes: no statement runs (and no trigger fires) when the
--   node's warm models are already what the beat says.
-- - The rescoring trigger on node_models returns at once when its statement changed no row (a
--   writer elsewhere that changes nothing).
-- - The description rules run on an UPDATE only when a column they check changed (a WHEN on the
--   trigger; an INSERT has its own trigger, since a WHEN may not name OLD there). Both are named to
--   run after the BEFORE triggers that derive columns (outside_load, routes), as before.

create or replace function private.sync_warm_models(p_node_id uuid, p_loaded_models text[])
returns void
language plpgsql
set search_path = ''
as $$
begin
  -- Looked at first (two index probes): in steady state the rows already say so, and writing
  -- nothing fires none of node_models' statement triggers.
  if not exists (
       select from unnest(p_loaded_models) as m
       where not exists (select from public.node_models nm
                         where nm.node_id = p_node_id and nm.model_id = m and nm.state = 'loaded'))
     and not exists (
       select from public.node_models nm
       where nm.node_id = p_node_id and nm.state = 'loaded' and nm.model_id <> all (p_loaded_models)) then
    return;
  end if;
  insert into public.node_models (node_id, model_id, state)
  select p_node_id, m, 'loaded' from unnest(p_loaded_models) as m
  on conflict (node_id, model_id) do update set state = 'loaded' where public.node_models.state <> 'loaded';
  update public.node_models nm set state = 'available'
  where nm.node_id = p_node_id and nm.state = 'loaded' and nm.model_id <> all (p_loaded_models);
end;
$$;
comment on function private.sync_warm_models(p_node_id uuid, p_loaded_models text[]) is 'A heartbeat''s warm models: the node''s models in p_loaded_models are loaded, its other loaded ones available (still on disk, a cold start away). Rows change only where their state does; when none would, nothing is written (and no trigger fires).';

create or replace function private.node_scores_after_node_models_change() returns trigger
language plpgsql
security definer
set search_path = ''
as $$
begin
  -- A statement that changed no row (an upsert whose rows were all there) has nothing to rescore.
  if not exists (select from new_rows) then
    return null;
  end if;
  perform private.refresh_node_scores(array(select distinct node_id from new_rows));
  return null;
end;
$$;
comment on function private.node_scores_after_node_models_change() is 'Trigger: refreshes node_scores for nodes whose models were added or changed state (nothing when the statement changed no row).';

drop trigger nodes_validate on public.nodes;
create trigger nodes_validate before update of
  backend, endpoint_url, free_vram_gb, gpu_count, gpu_model, gpu_utilization, hourly_rate, latitude,
  longitude, max_concurrency, name, outside_load, queue_depth, region, routes, secret_hash, tflops, vram_gb
  on public.nodes for each row
  -- (Written out: a row comparison would be dumped as nested ORs, not read back the same.)
  when (old.backend is distinct from new.backend
        or old.endpoint_url is distinct from new.endpoint_url
        or old.free_vram_gb is distinct from new.free_vram_gb
        or old.gpu_count is distinct from new.gpu_count
        or old.gpu_model is distinct from new.gpu_model
        or old.gpu_utilization is distinct from new.gpu_utilization
        or old.hourly_rate is distinct from new.hourly_rate
        or old.latitude is distinct from new.latitude
        or old.longitude is distinct from new.longitude
        or old.max_concurrency is distinct from new.max_concurrency
        or old.name is distinct from new.name
        or old.outside_load is distinct from new.outside_load
        or old.queue_depth is distinct from new.queue_depth
        or old.region is distinct from new.region
        or old.routes is distinct from new.routes
        or old.secret_hash is distinct from new.secret_hash
        or old.tflops is distinct from new.tflops
        or old.vram_gb is distinct from new.vram_gb)
  execute function private.nodes_check_description();
create trigger nodes_validate_insert before insert on public.nodes
  for each row execute function private.nodes_check_description();
