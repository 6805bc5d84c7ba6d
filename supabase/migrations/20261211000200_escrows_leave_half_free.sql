-- An escrow leaves half of a key's free budget free (issue 42). An escrow was capped by
-- platform_settings.escrow_usd ($1) and by what the key had free, so a key with less than that free
-- was locked up whole by the first gateway that asked: in bench chaos the gateway next to the
-- database held all of a $0.002 key's last money for 15 s and served its callers, while the other
-- three answered theirs 429 ("the budget of this API key is spent") from the first second. Now an
-- escrow is at most half what the key has free (its own escrow counted): the rest stays free for
-- the other gateways' escrows and for placements in SQL, and each renewal recomputes it.

create or replace function public.renew_escrows(p_gateway uuid, p_keys jsonb) RETURNS TABLE(api_key_id uuid, usd numeric, free_usd numeric)
    LANGUAGE plpgsql
    SET search_path TO ''
    AS $_$
declare
  v_uuid constant text := '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$';
  v_usd constant text := '^\d{1,8}(\.\d{1,20})?([eE][-+]?\d{1,2})?$';  -- also as Python's str(Decimal) writes it
  v_bad record;
  v_keys uuid[];
  v_wants numeric[];
begin
  if p_gateway is null then
    raise exception 'renew_escrows needs the gateway''s id' using errcode = 'invalid_parameter_value';
  end if;
  if jsonb_typeof(p_keys) is distinct from 'array' then
    raise exception 'renew_escrows takes a JSON array of keys' using errcode = 'invalid_parameter_value';
  end if;
  select x.n, x.fault into v_bad
  from (
    select k.n, case
      when jsonb_typeof(k.e) is distinct from 'object' then 'each key is a JSON object'
      when jsonb_typeof(k.e -> 'key') is distinct from 'string' or k.e ->> 'key' !~ v_uuid
        then '"key" must be an API key''s id (a UUID)'
      when coalesce(jsonb_typeof(k.e -> 'want_usd'), 'null') not in ('number', 'string') or k.e ->> 'want_usd' !~ v_usd
        then '"want_usd" must be an amount in USD, 0 or more'
      when count(*) over (partition by k.e ->> 'key') > 1 then format('key %s is named twice', k.e ->> 'key')
    end as fault
    from jsonb_array_elements(p_keys) with ordinality as k (e, n)
  ) x
  where x.fault is not null
  order by x.n
  limit 1;
  if found then
    raise exception 'key %: %', v_bad.n, v_bad.fault using errcode = 'invalid_parameter_value';
  end if;
  begin
    select coalesce(array_agg((k.e ->> 'key')::uuid order by k.n), '{}'),
           coalesce(array_agg((k.e ->> 'want_usd')::numeric order by k.n), '{}')
      into v_keys, v_wants
    from jsonb_array_elements(p_keys) with ordinality as k (e, n);
  exception when data_exception then
    raise exception 'a key''s escrow could not be read: %', sqlerrm using errcode = 'invalid_parameter_value';
  end;
  select u.n, u.key into v_bad
  from unnest(v_keys) with ordinality as u (key, n)
  where not exists (select from public.api_keys k where k.id = u.key)
  order by u.n limit 1;
  if found then
    raise exception 'key %: no API key with id %', v_bad.n, v_bad.key using errcode = 'foreign_key_violation';
  end if;

  -- The keys (those named and those the gateway holds an escrow for) by id, then the escrows: the
  -- order record_jobs() takes them in, after the nodes.
  perform from public.api_keys k
  where k.id = any (v_keys) or k.id in (select e.api_key_id from private.key_escrows e where e.gateway_id = p_gateway)
  order by k.id for no key update;
  perform from private.key_escrows e where e.gateway_id = p_gateway order by e.api_key_id for update;

  return query
  with wanted as (
    select u.key, u.want, u.n from unnest(v_keys, v_wants) with ordinality as u (key, want, n)
  ),
  planned as (
    select coalesce(w.key, e.api_key_id) as key, w.n, coalesce(e.usd, 0) as had,
           k.budget_usd is not null as budgeted,
           -- The escrow now: what is wanted, capped by the setting and by half what the key has free
           -- (its escrow here counted as free), so that a small budget is never locked up whole at
           -- one gateway, refused as spent at every other; none for a key not named, revoked or
           -- without a budget.
           case when w.key is null or k.budget_usd is null or k.revoked_at is not null then 0::numeric
                else greatest(trunc(least(w.want, s.escrow_usd,
                                          (k.budget_usd - k.spent_usd - k.reserved_usd + coalesce(e.usd, 0)) / 2), 8), 0)
           end as usd
    from wanted w
    full join (select x.api_key_id, x.usd from private.key_escrows x where x.gateway_id = p_gateway) e
      on e.api_key_id = w.key
    join public.api_keys k on k.id = coalesce(w.key, e.api_key_id)
    cross join public.platform_settings s
  ),
  keys_moved as (
    update public.api_keys k
    set reserved_usd = greatest(k.reserved_usd + p.usd - p.had, 0)
    from planned p
    where k.id = p.key and p.usd <> p.had
    returning k.id, k.budget_usd - k.spent_usd - k.reserved_usd as free_usd
  ),
  returned as (
    delete from private.key_escrows e
    using planned p
    where e.gateway_id = p_gateway and e.api_key_id = p.key and p.usd = 0
  ),
  kept as (
    insert into private.key_escrows as e (gateway_id, api_key_id, usd, renewed_at)
    select p_gateway, p.key, p.usd, now() from planned p where p.usd > 0
    on conflict on constraint key_escrows_pkey do update set usd = excluded.usd, renewed_at = excluded.renewed_at
  )
  select p.key, case when p.budgeted then p.usd end,
         case when p.budgeted then coalesce(m.free_usd, k.budget_usd - k.spent_usd - k.reserved_usd) end
  from planned p
  join public.api_keys k on k.id = p.key
  left join keys_moved m on m.id = p.key
  where p.n is not null
  order by p.n;
end;
$_$;
comment on function public.renew_escrows(uuid, jsonb) is 'A gateway''s escrows for the keys it serves from its leases. p_keys: a JSON array, [{"key": API key id, "want_usd": amount}]. For each key with a budget the escrow becomes what is wanted, at most platform_settings.escrow_usd and half what the key has free (its budget less what is spent and held, this escrow counted as free: the rest stays free for the other gateways and for placements in SQL), api_keys.reserved_usd moving by the difference; a revoked key''s escrow is returned, and so is every escrow of the gateway for a key it no longer names. Returns, per key named in order, the escrow now (null for a key without a budget, which needs none) and what the key has free beyond it. Bad input raises invalid_parameter_value (foreign_key_violation for an unknown key) and changes nothing.';
