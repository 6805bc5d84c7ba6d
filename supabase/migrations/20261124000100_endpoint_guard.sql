-- Node endpoints on public addresses only, for owners' own writes too.
--
-- The gateway refuses a registration whose endpoint is not a public address, and checks again for
-- the address it connects to. But owners may also write `nodes.endpoint_url` through the Data API
-- (PostgREST, as `authenticated`): such a write now gets the same check, here. The host is read as
-- the gateway reads it (neuralgrid/gateway/endpoints.py; tests/db/test_endpoints_sql.py holds the two
-- equal): IPv4 in every notation inet_aton(3) accepts (127.1, 0x7f000001, 0177.0.0.1, 2130706433),
-- IPv6 with the IPv4 address it may carry, and localhost. Names cannot be resolved in SQL; the
-- gateway checks what they resolve to each time it connects.

create function private.address_is_public(p_address inet)
returns boolean
language sql immutable strict parallel safe
set search_path = ''
as $$
  select case
    -- IPv6 that routes to an IPv4 address (mapped, NAT64) is as public as that address.
    when family(p_address) = 6 and p_address <<= '::ffff:0:0/96'::inet
      then private.address_is_public('0.0.0.0'::inet + (host(p_address)::inet - '::ffff:0.0.0.0'::inet))
    when family(p_address) = 6 and p_address <<= '64:ff9b::/96'::inet
      then private.address_is_public('0.0.0.0'::inet + (host(p_address)::inet - '64:ff9b::'::inet))
    else not exists (
      select from unnest(array[
        -- IPv4: this network, private, shared (CGNAT), loopback, link-local, private, IETF protocol
        -- assignments, documentation, 6to4 relays, private, benchmarking, documentation (twice),
        -- multicast, reserved and broadcast.
        '0.0.0.0/8', '10.0.0.0/8', '100.64.0.0/10', '127.0.0.0/8', '169.254.0.0/16', '172.16.0.0/12',
        '192.0.0.0/24', '192.0.2.0/24', '192.88.99.0/24', '192.168.0.0/16', '198.18.0.0/15',
        '198.51.100.0/24', '203.0.113.0/24', '224.0.0.0/4', '240.0.0.0/4',
        -- IPv6: unspecified, loopback and IPv4-compatible, discard, IETF (Teredo included),
        -- documentation, 6to4, local NAT64, unique local, link-local, site-local, multicast.
        '::/96', '100::/64', '2001::/23', '2001:db8::/32', '2002::/16', '64:ff9b:1::/48', 'fc00::/7',
        'fe80::/10', 'fec0::/10', 'ff00::/8'
      ]::inet[]) as non_public(network)
      where family(network) = family(p_address) and p_address <<= network
    )
  end
$$;
comment on function private.address_is_public(inet) is 'True for a globally routable unicast address (for IPv4-mapped and NAT64 IPv6, the IPv4 address it carries).';

create function private.parse_ipv4(p_host text)
returns inet
language plpgsql immutable strict parallel safe
set search_path = ''
as $$
declare
  v_parts text[];
  v_part text;
  v_digits text;
  v_value bigint;
  v_values bigint[] := '{}';
  v_count integer;
  v_number bigint := 0;
begin
  if p_host !~ '^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}$' then
    return null;  -- a name
  end if;
  v_parts := string_to_array(p_host, '.');
  foreach v_part in array v_parts loop
    if v_part like '0x%' then
      v_digits := ltrim(substr(v_part, 3), '0');
      if length(v_digits) > 8 then return null; end if;  -- over 32 bits: no address
      v_value := ('x' || lpad(v_digits, 16, '0'))::bit(64)::bigint;
    elsif length(v_part) > 1 and v_part like '0%' then
      if v_part ~ '[89]' then return null; end if;  -- not octal: libc then reads it as a name
      v_digits := ltrim(v_part, '0');
      if length(v_digits) > 11 then return null; end if;
      v_value := 0;
      for i in 1 .. length(v_digits) loop
        v_value := v_value * 8 + substr(v_digits, i, 1)::integer;
      end loop;
    else
      if length(v_part) > 10 then return null; end if;
      v_value := v_part::bigint;
    end if;
    v_values := v_values || v_value;
  end loop;
  -- Each part but the last is one byte; the last fills the bytes that remain.
  v_count := cardinality(v_values);
  for i in 1 .. v_count - 1 loop
    if v_values[i] > 255 then return null; end if;
    v_number := v_number + v_values[i] * (256::bigint ^ (4 - i))::bigint;
  end loop;
  if v_values[v_count] >= (256::bigint ^ (5 - v_count))::bigint then return null; end if;
  return '0.0.0.0'::inet + (v_number + v_values[v_count]);
end
$$;
comment on function private.parse_ipv4(text) is 'An IPv4 address in any notation inet_aton(3) accepts (1 to 4 parts, decimal, octal with a leading 0, or hex), or null for a name.';

create function private.endpoint_is_private(p_url text)
returns boolean
language plpgsql immutable strict parallel safe
set search_path = ''
as $$
declare
  v_host text;
  v_address inet;
begin
  -- The authority of an http(s) URL, less any user info and port; brackets around IPv6 removed.
  v_host := lower(substring(p_url from '^[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)'));
  if v_host is null then
    return false;  -- a tunnel, or no URL at all (the format constraint decides those)
  end if;
  v_host := regexp_replace(v_host, '^.*@', '');
  if v_host like '[%' then
    v_host := split_part(substring(v_host from '^\[([^]]*)\]'), '%', 1);
    begin
      v_address := v_host::inet;
    exception when invalid_text_representation then
      return false;
    end;
  else
    v_host := rtrim(regexp_replace(v_host, ':[^:]*$', ''), '.');
    if v_host = 'localhost' or v_host like '%.localhost' then
      return true;
    end if;
    v_address := private.parse_ipv4(v_host);
  end if;
  return v_address is not null and not private.address_is_public(v_address);
end
$$;
comment on function private.endpoint_is_private(text) is 'True when an endpoint URL''s host is localhost or a non-public address in any notation (names are checked by the gateway when it connects).';

create function private.check_owner_endpoint()
returns trigger
language plpgsql
security definer  -- owners cannot use the private schema; the trigger's WHEN picks who is checked
set search_path = ''
as $$
begin
  if private.endpoint_is_private(new.endpoint_url) then
    raise exception using
      errcode = 'check_violation',
      column = 'endpoint_url',
      message = format('endpoint_url must be a public address, not %s; behind NAT, run the agent with --tunnel', new.endpoint_url);
  end if;
  return new;
end
$$;
comment on function private.check_owner_endpoint() is 'Refuses an owner''s write of a node endpoint on localhost or a non-public address.';

-- The gateway (service role, or the database owner) runs its own check, which also resolves names and
-- may allow private addresses in development; owners writing through the Data API get this one.
create trigger nodes_owner_endpoint_is_public
  before insert or update of endpoint_url on public.nodes
  for each row when (current_user in ('anon', 'authenticated'))
  execute function private.check_owner_endpoint();

revoke execute on function private.address_is_public(inet) from public, anon, authenticated;
revoke execute on function private.parse_ipv4(text) from public, anon, authenticated;
revoke execute on function private.endpoint_is_private(text) from public, anon, authenticated;
revoke execute on function private.check_owner_endpoint() from public, anon, authenticated;
grant execute on function private.address_is_public(inet) to service_role;
grant execute on function private.parse_ipv4(text) to service_role;
grant execute on function private.endpoint_is_private(text) to service_role;
