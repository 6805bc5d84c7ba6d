"""Owners' writes to a node's endpoint get the gateway's check, in SQL: the same hosts refused."""

from __future__ import annotations

import contextlib
import ipaddress
import random
import uuid

import psycopg
import pytest

from neuralgrid.gateway.endpoints import NON_PUBLIC, is_public
from tests.conftest import make_node, make_user
from tests.unit.test_endpoints import ENDPOINTS


def test_sql_refuses_exactly_the_hosts_the_gateway_refuses(conn: psycopg.Connection) -> None:
    for url, refused in ENDPOINTS:
        (in_sql,) = conn.execute("select private.endpoint_is_private(%s)", (url,)).fetchone() or (None,)
        assert in_sql is refused, url


def test_sql_and_the_gateway_agree_on_every_address_range(conn: psycopg.Connection) -> None:
    """Random addresses in and around each non-public range, and their IPv4-mapped forms."""
    rng = random.Random(11)
    addresses: list[str] = []
    for network in NON_PUBLIC:
        for _ in range(20):
            inside = network[rng.randrange(network.num_addresses)]
            addresses.append(str(inside))
        with contextlib.suppress(ValueError):  # just past the range (none past the last address)
            addresses.append(str(network.broadcast_address + 1))
    addresses += [str(ipaddress.IPv4Address(rng.randrange(2**32))) for _ in range(500)]
    addresses += [f"::ffff:{a}" for a in addresses if ":" not in a][:300]
    rows = conn.execute(
        "select a, private.address_is_public(a::inet) from unnest(%s::text[]) as a", (addresses,)
    ).fetchall()
    disagree = [a for a, public in rows if public is not is_public(ipaddress.ip_address(a))]
    assert disagree == []


def owner_session(conn: psycopg.Connection, owner: uuid.UUID) -> None:
    """Act as the node's owner does through the Data API (PostgREST: role and JWT claims)."""
    conn.execute(
        "select set_config('request.jwt.claims', %s, true)",
        (f'{{"sub": "{owner}", "role": "authenticated"}}',),
    )
    conn.execute("set local role authenticated")


@pytest.mark.parametrize("url", ["http://0x7f000001:8000", "http://localhost:1", "http://[::ffff:10.0.0.1]"])
def test_an_owner_cannot_point_a_node_at_a_private_address(conn: psycopg.Connection, url: str) -> None:
    owner = make_user(conn)
    node = make_node(conn, "mine", owner_id=owner, endpoint_url="https://gpu.example.com")
    with conn.transaction(force_rollback=True):
        owner_session(conn, owner)
        with pytest.raises(psycopg.errors.CheckViolation, match="endpoint_url must be a public address"):
            conn.execute("update public.nodes set endpoint_url = %s where id = %s", (url, node))
    with conn.transaction(force_rollback=True):
        owner_session(conn, owner)
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url)"
                " values ('new', 'L4', 24, 121, 0.4, 'eu-west', %s)",
                (url,),
            )
    (stored,) = conn.execute("select endpoint_url from public.nodes where id = %s", (node,)).fetchone() or (
        "",
    )
    assert stored == "https://gpu.example.com"  # nothing already stored was lost


def test_an_owner_may_move_a_node_to_another_public_address(conn: psycopg.Connection) -> None:
    owner = make_user(conn)
    node = make_node(conn, "mine", owner_id=owner, endpoint_url="https://gpu.example.com")
    with conn.transaction():
        owner_session(conn, owner)
        conn.execute("update public.nodes set endpoint_url = 'https://8.8.8.8:8443' where id = %s", (node,))
    conn.execute("reset role")
    (stored,) = conn.execute("select endpoint_url from public.nodes where id = %s", (node,)).fetchone() or (
        "",
    )
    assert stored == "https://8.8.8.8:8443"
