"""Heartbeats and the sweeper, in SQL and through the async sweeper loop."""

from __future__ import annotations

import psycopg

from neuralgrid.server.sweeper import sweep_once
from tests.conftest import make_node, past_the_restart


def test_silent_nodes_go_offline_after_three_intervals(conn: psycopg.Connection) -> None:
    past_the_restart(conn)  # run alone, the server had been up less than the 15 s of silence
    make_node(conn, "fresh")
    make_node(conn, "late")
    make_node(conn, "silent")
    conn.execute("update nodes set last_heartbeat_at = now() - interval '11 seconds' where name = 'late'")
    conn.execute("update nodes set last_heartbeat_at = now() - interval '16 seconds' where name = 'silent'")
    swept = conn.execute("select name from sweep_stale_nodes()").fetchall()
    assert swept == [("silent",)]
    rows: dict[str, str] = dict(conn.execute("select name, status from nodes").fetchall())
    assert rows == {"fresh": "online", "late": "online", "silent": "offline"}
    missed = conn.execute("select missed_heartbeats from nodes where name = 'silent'").fetchone()
    assert missed == (3,)
    assert conn.execute("select count(*) from sweep_stale_nodes()").fetchone() == (0,)  # idempotent


def test_the_sweep_waits_for_no_node_row_another_transaction_holds(
    conn: psycopg.Connection, db_url: str
) -> None:
    """The sweep had updated silent nodes in no set order, and deadlocked with record_jobs(), which
    locks its nodes in id order (a review's stress run, 1 of 4). Now it takes no row another
    transaction holds: that node goes offline at the next sweep, a second later."""
    make_node(conn, "held")
    make_node(conn, "free")
    conn.execute("update nodes set last_heartbeat_at = now() - interval '1 hour'")
    conn.execute("update platform_settings set heartbeat_interval_s = 0.1")  # however new the server
    with psycopg.connect(db_url) as holder:
        holder.execute("select from nodes where name = 'held' for no key update")
        conn.execute("set lock_timeout = '2s'")
        assert conn.execute("select name from sweep_stale_nodes()").fetchall() == [("free",)]
    assert conn.execute("select name from sweep_stale_nodes()").fetchall() == [("held",)]


def test_operators_can_tighten_the_interval(conn: psycopg.Connection) -> None:
    make_node(conn, "n")
    conn.execute("update nodes set last_heartbeat_at = now() - interval '4 seconds'")
    conn.execute("update platform_settings set heartbeat_interval_s = 1")
    past_the_restart(conn)
    assert conn.execute("select name from sweep_stale_nodes()").fetchall() == [("n",)]


def test_heartbeat_brings_a_node_back_and_syncs_warm_models(conn: psycopg.Connection) -> None:
    node = make_node(conn, "n", status="offline", models={"a": "loaded", "b": "available"})
    status = conn.execute("select node_heartbeat(%s, %s)", (node, ["b", "c"])).fetchone()
    assert status == ("online",)
    models: dict[str, str] = dict(
        conn.execute("select model_id, state from node_models order by 1").fetchall()
    )
    assert models == {"a": "available", "b": "loaded", "c": "loaded"}
    conn.execute("update nodes set status = 'draining' where id = %s", (node,))
    assert conn.execute("select node_heartbeat(%s)", (node,)).fetchone() == ("draining",)


async def test_sweeper_loop_reports_what_it_swept(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        past_the_restart(conn)
        make_node(conn, "gone")
        conn.execute("update nodes set last_heartbeat_at = now() - interval '1 hour'")
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as aconn:
        assert await sweep_once(aconn) == ["gone"]
        assert await sweep_once(aconn) == []


def test_abandoned_jobs_give_back_their_slot_and_budget_hold(conn: psycopg.Connection) -> None:
    from neuralgrid.db.matching import MatchRequest, match_job

    node = make_node(conn)
    key = conn.execute("select id from create_api_key('k', null, null, 10)").fetchone()
    assert key is not None
    fresh = match_job(
        conn, MatchRequest(model="meta-llama/Llama-3.1-8B-Instruct"), api_key_id=key[0], reserve_usd=1
    )
    old = match_job(
        conn, MatchRequest(model="meta-llama/Llama-3.1-8B-Instruct"), api_key_id=key[0], reserve_usd=2
    )
    conn.execute("update jobs set created_at = now() - interval '2 hours' where id = %s", (old.job_id,))
    assert conn.execute("select job_id from sweep_stale_jobs()").fetchall() == [(old.job_id,)]
    assert conn.execute("select status from jobs where id = %s", (old.job_id,)).fetchone() == ("failed",)
    assert conn.execute("select status from jobs where id = %s", (fresh.job_id,)).fetchone() == ("running",)
    assert conn.execute("select inflight, failures from nodes where id = %s", (node,)).fetchone() == (1, 0)
    assert conn.execute("select reserved_usd::float8 from api_keys").fetchone() == (1.0,)
