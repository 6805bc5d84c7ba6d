-- The map's table sorts by a node's last heartbeat where the batches write it (issue 41).
--
-- Since 20261204000200 a beat that changes nothing writes node_liveness, not nodes, and node_map gives
-- the later of the two; node_list() still sorted by nodes.last_heartbeat_at, so a node beating through
-- a gateway's batches sorted as silent since its last change. It sorts by the later of the two now.

create or replace function public.node_list(
  p_search text default '', p_sort text default 'name', p_descending boolean default false,
  p_offset integer default 0, p_limit integer default 50
)
returns jsonb
language plpgsql stable
security invoker
set search_path = ''
as $$
declare
  v_search text := lower(coalesce(p_search, ''));
  v_limit integer := greatest(0, least(coalesce(p_limit, 50), 1000));
  v_offset integer := greatest(0, coalesce(p_offset, 0));
  v_total bigint;
  v_ids uuid[];
  v_nodes jsonb;
begin
  if coalesce(p_sort, 'name') not in ('status', 'name', 'gpu', 'vram', 'tflops', 'price', 'region', 'load', 'beat') then
    raise exception 'node_list() sorts by status, name, gpu, vram, tflops, price, region, load or beat, not %', p_sort
      using errcode = '22023';
  end if;
  if v_search = '' and coalesce(p_sort, 'name') = 'name' then
    -- The map's first page, and any unsearched one by name: read in order from nodes_name_idx.
    v_total := (select count(*) from public.nodes);
    v_ids := case
      when p_descending then array(select n.id from public.nodes n order by lower(n.name) desc, n.id desc
                                   offset v_offset limit v_limit)
      else array(select n.id from public.nodes n order by lower(n.name), n.id offset v_offset limit v_limit)
    end;
    select coalesce(jsonb_agg(to_jsonb(m) order by array_position(v_ids, m.id)), '[]') into v_nodes
    from public.node_map m where m.id = any(v_ids);
    return jsonb_build_object('total', v_total, 'offset', v_offset, 'limit', v_limit, 'nodes', v_nodes);
  end if;
  -- A page of ids first (found and sorted on nodes alone), then their rows as node_map has them.
  with found as (
    select n.id, n.name,
      case coalesce(p_sort, 'name')
        when 'status' then case n.status when 'online' then case when n.inflight >= n.max_concurrency then 1 else 0 end
                                         when 'busy' then 1 when 'draining' then 2 else 3 end
        when 'vram' then n.vram_gb when 'tflops' then n.tflops when 'price' then n.hourly_rate::float8
        when 'load' then n.inflight::float8 / greatest(n.max_concurrency, 1)
        when 'beat' then extract(epoch from greatest(
          n.last_heartbeat_at, (select l.last_heartbeat_at from public.node_liveness l where l.node_id = n.id)))::float8
      end as by_number,
      case coalesce(p_sort, 'name')
        when 'name' then lower(n.name) when 'gpu' then n.gpu_model || ' ' || n.gpu_count
        when 'region' then n.region
      end as by_text
    from public.nodes n
    where v_search = '' or strpos(lower(n.name), v_search) > 0 or strpos(lower(n.gpu_model), v_search) > 0
       or strpos(lower(n.region), v_search) > 0 or n.status = v_search
  )
  select (select count(*) from found),
         array(select f.id from found f
               order by case when p_descending then null else f.by_number end nulls last,
                        case when p_descending then f.by_number end desc nulls last,
                        case when p_descending then null else f.by_text end,
                        case when p_descending then f.by_text end desc,
                        lower(f.name), f.id
               offset v_offset limit v_limit)
  into v_total, v_ids;
  -- By `= any` of an array: a condition on node_map's grouping column, which Postgres applies before
  -- grouping (a join or `in` with a subquery would group every node first).
  select coalesce(jsonb_agg(to_jsonb(m) order by array_position(v_ids, m.id)), '[]') into v_nodes
  from public.node_map m where m.id = any(v_ids);
  return jsonb_build_object('total', v_total, 'offset', v_offset, 'limit', v_limit, 'nodes', v_nodes);
end;
$$;
comment on function public.node_list(text, text, boolean, integer, integer) is 'The map''s table, a page at a time: total (the nodes found), offset, limit (at most 1,000) and nodes (their rows as node_map has them). p_search finds nodes whose name, GPU model or region holds it (any case), or whose status it is; p_sort is status (online, busy (an online node with every slot taken too), draining, offline), name, gpu, vram, tflops, price, region, load (in flight over slots) or beat (last heartbeat: the later of the row''s and node_liveness''s, as node_map gives it), ties by name (unsearched pages by name are read in order from nodes_name_idx). Runs as its caller: anon may call it.';
