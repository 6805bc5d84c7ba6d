-- A node's price and free VRAM are numbers, and its GPU model and region are short.
--
-- Found by a security review of what the Data API lets a signed-in owner write (each reproduced as
-- the authenticated role, as PostgREST calls it):
-- - hourly_rate = 'NaN' passed `hourly_rate >= 0` (NaN is above every number in Postgres). Every
--   score of that node became NaN, which sorts above every score: it took all of its models'
--   requests (12 of 12). A job priced by node time charged its key NaN, for good (spent_usd NaN),
--   and a budgeted key nothing. free_vram_gb had the same hole. Prices now go to 10,000 USD an hour,
--   as a registration's do (protocol/nodes.py).
-- - gpu_model and region had no length limit: a 5 MB GPU model was sent to every map viewer on
--   each update (node-map broadcast, fleet_stats()). They take what a registration takes: 100 and
--   64 characters.
-- The rules' names change with them: a client matching on a constraint's name sees the new rule.

create or replace function private.nodes_check_description() returns trigger
language plpgsql
set search_path = ''
as $$
declare
  v_rule text;  -- the first rule broken, in the order Postgres checks constraints (by name)
begin
  -- The JSON is serialized to be measured: only when it is written.
  if (tg_op = 'INSERT' or new.backend is distinct from old.backend)
     and not (jsonb_typeof(new.backend) = 'object' and octet_length(new.backend::text) <= 4096) then
    v_rule := 'backend must be a JSON object of at most 4 kB';
  elsif not (new.endpoint_url ~ '^(https?://[^\s]+|tunnel:[^\s]*)$') then
    v_rule := 'endpoint_url must be http(s):// or tunnel:';
  elsif not (new.free_vram_gb >= 0 and new.free_vram_gb <> 'NaN') then  -- NaN is above every number
    v_rule := 'free_vram_gb must be a number, not negative';
  elsif not (new.gpu_count between 1 and 64) then
    v_rule := 'gpu_count must be between 1 and 64';
  elsif not (length(trim(new.gpu_model)) between 1 and 100) then
    v_rule := 'gpu_model must be 1 to 100 characters';
  elsif not (new.gpu_utilization between 0 and 1) then
    v_rule := 'gpu_utilization must be between 0 and 1';
  elsif not (new.hourly_rate between 0 and 10000) then  -- not NaN, which no range holds
    v_rule := 'hourly_rate must be between 0 and 10000';
  elsif not ((new.latitude is null) = (new.longitude is null)) then
    v_rule := 'latitude and longitude go together';
  elsif not (new.latitude between -90 and 90) then
    v_rule := 'latitude must be between -90 and 90';
  elsif not (new.longitude between -180 and 180) then
    v_rule := 'longitude must be between -180 and 180';
  elsif not (new.max_concurrency between 1 and 1024) then
    v_rule := 'max_concurrency must be between 1 and 1024';
  elsif not (length(trim(new.name)) between 1 and 100) then
    v_rule := 'node name must be 1 to 100 characters';
  elsif not (new.outside_load >= 0) then
    v_rule := 'outside_load must not be negative';
  elsif not (new.queue_depth >= 0) then
    v_rule := 'queue_depth must not be negative';
  elsif not (length(trim(new.region)) between 1 and 64) then
    v_rule := 'region must be 1 to 64 characters';
  elsif not (cardinality(new.routes) >= 1 and new.routes <@ '{chat/completions,completions,embeddings,responses,rerank,score,audio/transcriptions,audio/translations,audio/speech}'::text[]) then
    v_rule := 'routes must be known route names, at least one';
  elsif not (new.secret_hash is null or length(new.secret_hash) = 32) then
    v_rule := 'secret_hash must be a SHA-256 digest';
  elsif not (new.tflops > 0 and new.tflops <= 100000) then
    v_rule := 'tflops must be positive and at most 100000';
  elsif not (new.vram_gb > 0 and new.vram_gb <= 8192) then
    v_rule := 'vram_gb must be positive and at most 8192';
  end if;
  if v_rule is not null then
    raise exception 'new row for relation "%" violates check constraint "%"', tg_table_name, v_rule
      using errcode = 'check_violation', constraint = v_rule, table = tg_table_name, schema = tg_table_schema;
  end if;
  return new;
end;
$$;
comment on function private.nodes_check_description() is 'Trigger: the rules about what a node is (specs, place, price, address, name, routes, reported load), checked when a statement writes one of those columns; each raises the check_violation its CHECK constraint did. No rule holds NaN.';
