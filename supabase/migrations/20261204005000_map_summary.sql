-- The map at 100,000 nodes (issue 41). A map viewer heard every change of every node's row (every
-- heartbeat, as postgres_changes, 2.5 kB with its old row), and the page drew a dot and a table row per
-- node. Now a viewer hears a summary of the fleet, at most one a second however many nodes change:
--
-- * map_summary(): the nodes by status (online, busy, draining, offline) per 15-degree map tile (with
--   where in the tile they stand), per region and per GPU model, the fleet's totals (what
--   fleet_stats() gives), as one small JSON document;
-- * private.send_map_summary(): each gateway calls it every second while it has a map viewer (or,
--   under a hosted project's Realtime, always); between them all one call in 950 ms computes the
--   summary, and when it changed broadcasts it on the public `map:summary` topic with realtime.send()
--   (Broadcast from Database on Supabase) as the changes from the last one sent, numbered, so that a
--   viewer who missed one reads the whole again; public.map_feed keeps the last one sent;
-- * map_view(): what a viewer zoomed in sees, the nodes in its box (up to a few hundred) or clusters
--   of them on a finer grid; node_list(): the table, a page at a time, searched and sorted here.
--
-- The map page is served by a gateway, so wherever a viewer is, a gateway runs to send the summary:
-- it needs no pg_cron job of its own, and the sweep is left as it is.

-- How many tiles there are: without it the planner expects a group per node, and sorts 100,000 rows
-- where a hash of the few hundred tiles does (measured: 150 ms against 40 ms at 100,000 nodes).
create statistics public.nodes_map_tile
  on (width_bucket(latitude, -90, 90, 12) * 100 + width_bucket(longitude, -180, 180, 24)) from public.nodes;
comment on statistics public.nodes_map_tile is 'How many 15-degree map tiles hold nodes: map_summary() groups nodes by tile with a hash, not a sort.';

-- The nodes in a viewer's box (map_view()), read by range instead of a scan of the fleet.
create index nodes_map_location_idx on public.nodes (latitude, longitude);
comment on index public.nodes_map_location_idx is 'The nodes in a box of the map (map_view()). Neither column changes on a claim: claims stay heap-only.';

create table public.map_feed (
  one_row boolean primary key default true,
  seq bigint not null default 0,
  summary jsonb,
  checked_at timestamptz not null default '-infinity',
  sent_at timestamptz,
  constraint "map_feed has one row" check (one_row)
);
comment on table public.map_feed is 'The map''s summary as last broadcast on map:summary (seq: its number), when the gateways last compared it with the fleet (checked_at, at most every 950 ms) and when it was sent. Anyone may read it: what map_summary() answers while the feed runs.';
insert into public.map_feed default values;
revoke all on table public.map_feed from anon, authenticated;
grant select on table public.map_feed to anon, authenticated;
grant all on table public.map_feed to service_role;
alter table public.map_feed enable row level security;
create policy "Anyone can read the map's summary" on public.map_feed
  for select to anon, authenticated using (true);

create or replace function public.map_summary(p_cached boolean default true)
returns jsonb
language plpgsql stable
security invoker
set search_path = ''
as $$
declare
  v_summary jsonb;
begin
  if p_cached then
    select f.summary into v_summary from public.map_feed f
    where f.checked_at > now() - interval '3 seconds' and f.summary is not null;
    if v_summary is not null then
      return v_summary;
    end if;
  end if;
  -- One pass over the fleet, grouped by (tile, status, region, GPU model): a few hundred groups at
  -- 100,000 nodes, which the rest reads.
  with groups as materialized (
    select width_bucket(n.latitude, -90, 90, 12) * 100 + width_bucket(n.longitude, -180, 180, 24) as tile,
           n.status, n.region, n.gpu_model, count(*) as nodes, sum(n.latitude) as lat, sum(n.longitude) as lon,
           sum(n.vram_gb)::float8 as vram_gb, sum(n.tflops)::float8 as tflops, min(n.hourly_rate) as rate
    from public.nodes n
    group by 1, n.status, n.region, n.gpu_model
  ),
  counted as (
    select grouping(g.tile) as by_tile, grouping(g.region) as by_region, grouping(g.gpu_model) as by_gpu,
           g.tile, g.region, g.gpu_model, sum(g.nodes) as nodes,
           jsonb_build_array(
             coalesce(sum(g.nodes) filter (where g.status = 'online'), 0),
             coalesce(sum(g.nodes) filter (where g.status = 'busy'), 0),
             coalesce(sum(g.nodes) filter (where g.status = 'draining'), 0),
             coalesce(sum(g.nodes) filter (where g.status = 'offline'), 0)) as statuses,
           sum(g.lat) as lat, sum(g.lon) as lon,
           coalesce(sum(g.vram_gb) filter (where g.status in ('online', 'busy')), 0) as vram_gb,
           coalesce(sum(g.tflops) filter (where g.status in ('online', 'busy')), 0) as tflops,
           min(g.rate) filter (where g.status in ('online', 'busy'))::float8 as cheapest
    from groups g
    group by grouping sets ((g.tile), (g.region), (g.gpu_model), ())
  )
  select jsonb_build_object(
    'at', now(),
    'tile_deg', 15,
    'total', t.statuses,
    'unplaced', coalesce((select c.statuses from counted c where c.by_tile = 0 and c.tile is null),
                         '[0, 0, 0, 0]'),
    'stats', jsonb_build_object('online_vram_gb', t.vram_gb, 'online_tflops', t.tflops,
                                'jobs_last_minute', a.jobs_last_minute, 'p50_latency_ms', a.p50_latency_ms),
    'tiles', coalesce((select jsonb_object_agg(c.tile::text,
                                jsonb_build_array(round((c.lat / c.nodes)::numeric, 2), round((c.lon / c.nodes)::numeric, 2))
                                || c.statuses)
                       from counted c where c.by_tile = 0 and c.tile is not null), '{}'),
    -- Regions and GPU models are free text: the 100 with most nodes keep the document small.
    'regions', coalesce((select jsonb_object_agg(r.region, r.statuses) from (
                           select c.region, c.statuses from counted c where c.by_region = 0 and c.region is not null
                           order by c.nodes desc, c.region limit 100) r), '{}'),
    'gpus', coalesce((select jsonb_object_agg(r.gpu_model, r.statuses || jsonb_build_array(r.cheapest)) from (
                        select c.gpu_model, c.statuses, c.cheapest from counted c
                        where c.by_gpu = 0 and c.gpu_model is not null
                        order by c.nodes desc, c.gpu_model limit 100) r), '{}'))
  into v_summary
  from counted t, public.fleet_activity a
  where t.by_tile = 1 and t.by_region = 1 and t.by_gpu = 1;
  -- An empty fleet has no groups at all.
  return coalesce(v_summary, jsonb_build_object(
    'at', now(), 'tile_deg', 15, 'total', '[0, 0, 0, 0]'::jsonb, 'unplaced', '[0, 0, 0, 0]'::jsonb,
    'stats', (select jsonb_build_object('online_vram_gb', 0, 'online_tflops', 0,
                                        'jobs_last_minute', a.jobs_last_minute, 'p50_latency_ms', a.p50_latency_ms)
              from public.fleet_activity a),
    'tiles', '{}'::jsonb, 'regions', '{}'::jsonb, 'gpus', '{}'::jsonb));
end;
$$;
comment on function public.map_summary(boolean) is 'The map''s summary of the fleet: at (when computed), tile_deg, total and unplaced (nodes with no location) as [online, busy, draining, offline], stats (VRAM and TFLOPS online or busy, the jobs of the last minute and their median latency), tiles (by width_bucket(latitude, -90, 90, 12) * 100 + width_bucket(longitude, -180, 180, 24): [mean latitude, mean longitude, online, busy, draining, offline]), regions and gpus (the 100 with most nodes: the four counts; gpus add the cheapest hourly rate online). With p_cached (the default), the summary last broadcast on map:summary, with its seq, while the gateways compare it with the fleet every second; else computed now, without a seq. Runs as its caller: anon may call it.';
revoke execute on function public.map_summary(boolean) from public, anon, authenticated, service_role;
grant execute on function public.map_summary(boolean) to anon, authenticated, service_role;

create or replace function private.json_changes(p_old jsonb, p_new jsonb)
returns jsonb
language sql immutable
set search_path = ''
as $$
  -- The keys of p_new whose values differ from p_old's, and p_old's keys that are gone, as null.
  select coalesce(jsonb_object_agg(k.key, p_new -> k.key), '{}')
  from (select jsonb_object_keys(coalesce(p_new, '{}')) as key
        union select jsonb_object_keys(coalesce(p_old, '{}'))) k
  where (p_new -> k.key) is distinct from (p_old -> k.key)
$$;
comment on function private.json_changes(jsonb, jsonb) is 'What changed from one JSON object to another: the keys whose values differ, with the new values, and the keys that are gone, as null.';
revoke execute on function private.json_changes(jsonb, jsonb) from public, anon, authenticated;
grant execute on function private.json_changes(jsonb, jsonb) to service_role;

create or replace function private.send_map_summary()
returns boolean
language plpgsql
set search_path = ''
as $$
declare
  v_last jsonb;
  v_seq bigint;
  v_now jsonb;
  v_message jsonb;
begin
  -- Every gateway calls this every second: one call in 950 ms compares the fleet with the last summary
  -- sent. The row's lock makes a caller at the same moment wait, then find it checked.
  update public.map_feed f set checked_at = now()
  where f.checked_at <= now() - interval '950 milliseconds'
  returning f.summary, f.seq into v_last, v_seq;
  if not found then
    return false;
  end if;
  v_now := public.map_summary(false);
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
comment on function private.send_map_summary() is 'Broadcasts the map''s summary on the public map:summary topic (event summary) when it changed since the last one sent, as the changes to it (full: false; tiles, regions and gpus hold the keys that changed, null for one gone) numbered by seq; unless the gateways compared it in the last 950 ms. Returns whether it sent one. Each gateway calls it every second while it has a map viewer (always under a hosted project''s Realtime).';
revoke execute on function private.send_map_summary() from public, anon, authenticated;
grant execute on function private.send_map_summary() to service_role;

create or replace function public.map_view(
  p_west double precision, p_south double precision, p_east double precision, p_north double precision,
  p_cell_deg double precision default 1, p_max_nodes integer default 300
)
returns jsonb
language plpgsql stable
security invoker
set search_path = ''
as $$
declare
  v_south double precision := greatest(-90, least(p_south, p_north));
  v_north double precision := least(90, greatest(p_south, p_north));
  v_west double precision := greatest(-180, least(p_west, p_east));
  v_east double precision := least(180, greatest(p_west, p_east));
  -- At most some 2,500 cells whatever the caller asks: a box's clusters cost one pass over its nodes.
  v_cell double precision := greatest(coalesce(p_cell_deg, 1), 0.01,
                                      sqrt((v_north - v_south) * (v_east - v_west) / 2500));
  v_max integer := greatest(0, least(coalesce(p_max_nodes, 300), 1000));
  v_clusters jsonb;
  v_count bigint;
  v_ids uuid[];
begin
  if p_west is null or p_south is null or p_east is null or p_north is null then
    raise exception 'map_view() needs a box: west, south, east and north' using errcode = '22023';
  end if;
  select coalesce(jsonb_agg(jsonb_build_array(c.lat, c.lon, c.online, c.busy, c.draining, c.offline)
                            order by c.lat, c.lon), '[]'),
         coalesce(sum(c.online + c.busy + c.draining + c.offline), 0)
  into v_clusters, v_count
  from (
    select round(avg(n.latitude)::numeric, 4) as lat, round(avg(n.longitude)::numeric, 4) as lon,
           count(*) filter (where n.status = 'online') as online, count(*) filter (where n.status = 'busy') as busy,
           count(*) filter (where n.status = 'draining') as draining,
           count(*) filter (where n.status = 'offline') as offline
    from public.nodes n
    where n.latitude between v_south and v_north and n.longitude between v_west and v_east
    group by floor(n.latitude / v_cell), floor(n.longitude / v_cell)
  ) c;
  if v_count > v_max then
    return jsonb_build_object('count', v_count, 'cell_deg', v_cell, 'clusters', v_clusters);
  end if;
  v_ids := array(select n.id from public.nodes n
                 where n.latitude between v_south and v_north and n.longitude between v_west and v_east);
  return jsonb_build_object('count', v_count, 'nodes', coalesce((
    select jsonb_agg(to_jsonb(m) order by m.name, m.id) from public.node_map m where m.id = any(v_ids)), '[]'));
end;
$$;
comment on function public.map_view(double precision, double precision, double precision, double precision, double precision, integer) is 'What a map viewer sees in a box (degrees; p_west <= p_east, no wrap at 180): count, its nodes in view, and nodes (their rows as node_map has them, by name) when they are p_max_nodes or fewer (at most 1,000), else clusters ([mean latitude, mean longitude, online, busy, draining, offline] per cell of p_cell_deg degrees, coarser when the box would hold more than some 2,500 cells) and cell_deg. Runs as its caller: anon may call it.';
revoke execute on function public.map_view(double precision, double precision, double precision, double precision, double precision, integer) from public, anon, authenticated, service_role;
grant execute on function public.map_view(double precision, double precision, double precision, double precision, double precision, integer) to anon, authenticated, service_role;

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
  -- A page of ids first (found and sorted on nodes alone), then their rows as node_map has them.
  with found as (
    select n.id, n.name,
      case coalesce(p_sort, 'name')
        when 'status' then case n.status when 'online' then case when n.inflight >= n.max_concurrency then 1 else 0 end
                                         when 'busy' then 1 when 'draining' then 2 else 3 end
        when 'vram' then n.vram_gb when 'tflops' then n.tflops when 'price' then n.hourly_rate::float8
        when 'load' then n.inflight::float8 / greatest(n.max_concurrency, 1)
        when 'beat' then extract(epoch from n.last_heartbeat_at)::float8
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
comment on function public.node_list(text, text, boolean, integer, integer) is 'The map''s table, a page at a time: total (the nodes found), offset, limit (at most 1,000) and nodes (their rows as node_map has them). p_search finds nodes whose name, GPU model or region holds it (any case), or whose status it is; p_sort is status (online, busy (an online node with every slot taken too), draining, offline), name, gpu, vram, tflops, price, region, load (in flight over slots) or beat (last heartbeat), ties by name. Runs as its caller: anon may call it.';
revoke execute on function public.node_list(text, text, boolean, integer, integer) from public, anon, authenticated, service_role;
grant execute on function public.node_list(text, text, boolean, integer, integer) to anon, authenticated, service_role;
