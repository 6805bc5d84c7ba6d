"""The gateway's pools hand out the connection returned last, and check one that rested long."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection
from psycopg.rows import scalar_row

from neuralgrid.bench.delay import DelayProxy
from neuralgrid.db.pool import LastInFirstOut
from neuralgrid.db.queries import PING, Query
from neuralgrid.db.store import Store


async def backend(conn: AsyncConnection[Any]) -> int:
    row = await (await conn.execute("select pg_backend_pid()")).fetchone()
    assert row is not None
    return int(row[0])


async def test_the_connection_returned_last_is_handed_out_first(db_url: str) -> None:
    async with LastInFirstOut(db_url, min_size=3, max_size=3, open=False) as pool:
        await pool.open(wait=True)
        first, second, third = [await pool.getconn() for _ in range(3)]
        for conn in (first, second, third):
            await pool.putconn(conn)
        for _ in range(3):  # in turn (first in, first out), these would be first, second, third
            conn = await pool.getconn()
            assert conn is third
            await pool.putconn(conn)
        held = await pool.getconn()  # while it is out, the one returned before it
        assert held is third and (await pool.getconn()) is second


async def test_one_request_at_a_time_keeps_to_one_backend(db_url: str) -> None:
    """What the request path does sequentially: each statement on the Postgres backend that ran the
    last one, not on each of the pool's backends in turn."""
    async with LastInFirstOut(
        db_url, min_size=4, max_size=4, kwargs={"autocommit": True}, open=False
    ) as pool:
        await pool.open(wait=True)
        store = Store(pool)
        pids = set()
        for _ in range(12):
            await store.get(PING)
            async with pool.connection() as conn:
                pids.add(await backend(conn))
        assert len(pids) == 1


async def test_every_statement_is_one_round_trip_however_often_it_runs(db_url: str) -> None:
    """Counted at a proxy in front of Postgres: psycopg on its own prepares a statement at its
    sixth run on a connection, a round trip of its own (a far gateway's request paid an RTT more)."""
    info = psycopg.conninfo.conninfo_to_dict(db_url)
    async with DelayProxy("127.0.0.1", int(str(info["port"])), 0.0) as proxy:
        through_proxy = psycopg.conninfo.make_conninfo(
            user=info["user"], dbname=info["dbname"], host="127.0.0.1", port=proxy.port
        )
        async with LastInFirstOut(
            through_proxy, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
        ) as pool:
            await pool.open(wait=True)
            store = Store(pool)
            trips = []
            for _ in range(12):
                before = proxy.round_trips
                assert await store.get(PING) == 1
                trips.append(proxy.round_trips - before)
    assert trips == [1] * 12


async def test_a_connection_closed_while_it_rested_is_replaced_before_use(db_url: str) -> None:
    async with LastInFirstOut(
        db_url, min_size=1, max_size=1, idle_check_s=0.2, kwargs={"autocommit": True}, open=False
    ) as pool:
        await pool.open(wait=True)
        async with pool.connection() as conn:
            closed = await backend(conn)
        with psycopg.connect(db_url, autocommit=True) as admin:  # as a firewall or pooler would
            admin.execute("select pg_terminate_backend(%s, 5000)", (closed,))  # gone on return
        await asyncio.sleep(0.3)
        async with pool.connection() as conn:  # checked, found closed, replaced
            assert await backend(conn) != closed


async def test_a_connection_in_use_is_not_checked(db_url: str) -> None:
    """No round trip is added while connections are busy: the check runs only after a rest."""
    async with LastInFirstOut(
        db_url, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
    ) as pool:
        await pool.open(wait=True)
        async with pool.connection() as conn:
            before = await backend(conn)
        with psycopg.connect(db_url, autocommit=True) as admin:
            admin.execute("select pg_terminate_backend(%s, 5000)", (before,))
        with pytest.raises(psycopg.OperationalError):  # not checked: the statement meets the closed one
            async with pool.connection() as conn:
                await backend(conn)


async def test_a_connection_never_handed_out_is_checked_after_resting(db_url: str) -> None:
    """One opened with the pool and left at the far end by a light load rests too: when a burst
    first needs it, it is checked (and replaced, closed meanwhile)."""
    async with LastInFirstOut(
        db_url, min_size=2, max_size=2, idle_check_s=0.2, kwargs={"autocommit": True}, open=False
    ) as pool:
        await pool.open(wait=True)
        for _ in range(3):  # a light load: one connection, handed out again and again
            async with pool.connection() as conn:
                await backend(conn)
        with psycopg.connect(db_url, autocommit=True) as admin:  # both closed, as a middlebox would
            others = "select pid from pg_stat_activity where datname = current_database() and pid <> pg_backend_pid()"
            closed = [row[0] for row in admin.execute(others)]
            for pid in closed:
                admin.execute("select pg_terminate_backend(%s, 5000)", (pid,))
        await asyncio.sleep(0.3)
        async with pool.connection() as first, pool.connection() as second:  # a burst: both
            assert {await backend(first), await backend(second)}.isdisjoint(closed)


@pytest.mark.parametrize("autocommit", [True, False])
async def test_a_store_keeps_what_it_wrote_and_a_failure_leaves_its_connection_usable(
    db_url: str, autocommit: bool
) -> None:
    """The store hands pooled connections back itself (not through pool.connection(), whose commit
    on the way out is all lock and no work for the gateway's autocommit pools): what a statement
    wrote stays written, on a pool of either kind, and a failed one leaves nothing open."""
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute("create table if not exists kept (n int)")
        admin.execute("truncate kept")
    async with LastInFirstOut(
        db_url, min_size=1, max_size=1, kwargs={"autocommit": autocommit}, open=False
    ) as pool:
        await pool.open(wait=True)
        store = Store(pool)
        await store.all(Query("keep", "insert into kept values (1)", scalar_row))
        with pytest.raises(psycopg.errors.DivisionByZero):
            await store.all(Query("fail", "select 1 / 0", scalar_row))
        assert await store.get(PING) == 1
    with psycopg.connect(db_url) as admin:
        assert admin.execute("select count(*) from kept").fetchone() == (1,)
