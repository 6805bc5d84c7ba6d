"""A gateway that dies mid-request leaves nothing held for long: its jobs end once it stops checking
in, while a live gateway's jobs are left alone."""

from __future__ import annotations

import asyncio
import functools
import uuid
from decimal import Decimal

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.queries import MatchRequest, match_params
from neuralgrid.db.store import SyncStore
from neuralgrid.server.liveness import check_in
from neuralgrid.server.sweeper import run_sweeper
from tests.conftest import LLAMA8, make_key, make_node


def place(conn: psycopg.Connection, gateway: uuid.UUID, key: uuid.UUID) -> uuid.UUID:
    """A job placed as a gateway places it (PLACE_JOB, naming itself)."""
    params = match_params(
        MatchRequest(model=LLAMA8), key, False, 2, prompt_bytes=400, max_out=100, wait=False
    )
    match = SyncStore(conn).get(q.PLACE_JOB, {**params, "gateway": str(gateway), "end_user": None})
    assert match.node_id is not None
    return match.job_id


def test_the_jobs_of_a_silent_gateway_end_and_a_live_ones_do_not(conn: psycopg.Connection) -> None:
    node = make_node(conn, max_concurrency=8)
    key = make_key(conn, budget_usd=1.0)
    dead, live = uuid.uuid4(), uuid.uuid4()
    store = SyncStore(conn)
    for gateway in (dead, live):
        store.one(q.GATEWAY_ALIVE, (gateway,))
    orphan, kept = place(conn, dead, key), place(conn, live, key)
    assert conn.execute("select gateway_id from jobs where id = %s", (orphan,)).fetchone() == (dead,)
    # The dead gateway last checked in a minute ago; the live one just now.
    conn.execute("update private.gateways set seen_at = now() - interval '1 minute' where id = %s", (dead,))
    conn.execute("update platform_settings set gateway_timeout_s = 0.5")  # the database started long ago

    swept = store.all(q.SWEEP)

    assert [(s.kind, s.id) for s in swept] == [("job_orphaned", orphan)]
    assert conn.execute("select status, error from jobs where id = %s", (orphan,)).fetchone() == (
        "failed",
        "abandoned: its gateway stopped",
    )
    assert conn.execute("select status from jobs where id = %s", (kept,)).fetchone() == ("running",)
    # One slot and one hold are back; the node is not blamed, nothing is charged.
    assert conn.execute("select inflight, failures from nodes where id = %s", (node,)).fetchone() == (1, 0)
    reserved, spent = conn.execute(
        "select reserved_usd, spent_usd from api_keys where id = %s", (key,)
    ).fetchone() or (0, 0)
    assert reserved > 0 and spent == Decimal(0)
    assert store.all(q.SWEEP) == []  # nothing twice


def test_jobs_placed_outside_a_gateway_wait_for_the_deadline(conn: psycopg.Connection) -> None:
    make_node(conn)
    key = make_key(conn)
    job = conn.execute("select job_id from match_job(%s, %s)", (LLAMA8, key)).fetchone()
    assert job is not None
    assert conn.execute("select gateway_id from jobs where id = %s", (job[0],)).fetchone() == (None,)
    conn.execute("update platform_settings set gateway_timeout_s = 0.001")
    assert SyncStore(conn).all(q.SWEEP) == []


async def test_a_gateways_own_sweeper_keeps_its_jobs_while_its_pools_reconnect(
    conn: psycopg.Connection, db_url: str
) -> None:
    """A fault-injection review: after a database outage the sweeper's own connection was back
    before the gateway's pools, and it ended the jobs its gateway was still relaying. A gateway's
    own sweeper checks in for it first: the process that sweeps is alive, and so are its jobs."""
    make_node(conn, max_concurrency=8)
    key = make_key(conn)
    own = uuid.uuid4()
    SyncStore(conn).one(q.GATEWAY_ALIVE, (own,))
    job = place(conn, own, key)
    conn.execute("update private.gateways set seen_at = now() - interval '1 minute' where id = %s", (own,))
    conn.execute("update platform_settings set gateway_timeout_s = 0.5")
    stop = asyncio.Event()
    sweeping = asyncio.create_task(
        run_sweeper(db_url, 0.05, stop, functools.partial(check_in, gateway_id=own))
    )
    await asyncio.sleep(0.5)
    stop.set()
    await sweeping
    assert conn.execute("select status from jobs where id = %s", (job,)).fetchone() == ("running",)


def test_a_late_gateway_gets_back_the_tunnels_no_one_else_took(conn: psycopg.Connection) -> None:
    """restore_tunnels(): a tunnel no route names is recorded as the gateway's again (its node online);
    one another gateway holds now keeps its route; a node given another endpoint since (its owner
    may, through the Data API) is left out without failing the others (a diff review's case)."""
    gateway, other = uuid.uuid4(), uuid.uuid4()
    store = SyncStore(conn)
    nodes = [make_node(conn, name, endpoint_url=f"tunnel:{name}") for name in ("a", "b", "moved")]
    sockets = [uuid.uuid4() for _ in nodes]
    for gw in (gateway, other):
        store.one(q.GATEWAY_ALIVE, (gw,))
    conn.execute("select public.attach_tunnel(%s, %s, %s)", (nodes[1], other, uuid.uuid4()))
    conn.execute("update nodes set status = 'offline' where id in (%s, %s)", (nodes[0], nodes[2]))
    conn.execute("update nodes set endpoint_url = 'https://moved.example.com' where id = %s", (nodes[2],))
    restored = store.all(q.RESTORE_TUNNELS, (gateway, nodes, sockets))
    assert restored == [nodes[0]]
    routes: dict[uuid.UUID, uuid.UUID] = dict(
        conn.execute("select node_id, gateway_id from private.tunnel_routes").fetchall()
    )
    assert routes == {nodes[0]: gateway, nodes[1]: other}
    assert conn.execute("select status from nodes where id = %s", (nodes[0],)).fetchone() == ("online",)


def test_a_tunnel_node_moved_to_a_direct_endpoint_loses_its_route_and_stops_no_sweep(
    conn: psycopg.Connection,
) -> None:
    """Its owner gave it a direct endpoint while a gateway held its tunnel. set_tunnel() refuses a
    node that is no tunnel: detach_tunnel() kept the route, and once that gateway fell silent every
    sweep failed whole, every second (a review's case). The route goes; the node stays as it is."""
    live, dead = uuid.uuid4(), uuid.uuid4()
    store = SyncStore(conn)
    moved, other = (make_node(conn, name, endpoint_url=f"tunnel:{name}") for name in ("moved", "other"))
    sockets = {node: uuid.uuid4() for node in (moved, other)}
    store.one(q.GATEWAY_ALIVE, (live,))
    store.one(q.GATEWAY_ALIVE, (dead,))
    conn.execute("select public.attach_tunnel(%s, %s, %s)", (moved, live, sockets[moved]))
    conn.execute("select public.attach_tunnel(%s, %s, %s)", (other, dead, sockets[other]))
    conn.execute("update nodes set endpoint_url = 'https://moved.example.com' where id = %s", (moved,))
    assert conn.execute("select public.detach_tunnel(%s, %s)", (moved, sockets[moved])).fetchone() == (
        "online",
    )
    conn.execute("select public.attach_tunnel(%s, %s, %s)", (other, dead, sockets[other]))
    conn.execute("update nodes set endpoint_url = 'https://other.example.com' where id = %s", (other,))
    conn.execute("update private.gateways set seen_at = now() - interval '1 minute' where id = %s", (dead,))
    swept = conn.execute("select kind, name from sweep()").fetchall()
    assert ("node_offline", "other") not in swept
    assert conn.execute("select count(*) from private.tunnel_routes").fetchone() == (0,)
    assert conn.execute("select status from nodes where id = %s", (other,)).fetchone() == ("online",)
