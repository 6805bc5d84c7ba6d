"""Heartbeats and the sweeper, in SQL and through the async sweeper loop."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import psycopg

from neuralgrid.server.sweeper import sweep_once
from tests.conftest import LLAMA8, make_key, make_node, past_the_restart
from tests.slots import ENDED, record


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


def test_the_sweep_waits_for_no_row_a_gateways_write_holds(conn: psycopg.Connection, db_url: str) -> None:
    """One sweep ends a dead gateway's job (its key's row locked) and later frees that gateway's
    leases (their nodes' rows); a live gateway's record_jobs() locks its nodes, then its keys. The
    sweep had waited for a node that such a write held while holding the key the write waited for:
    a deadlock (a review's stress run: 16 in 150 rounds). It takes no row another transaction
    holds now; what it skips, the next sweep ends."""
    conn.execute("update platform_settings set gateway_timeout_s = 3, job_deadline_s = 60")
    past_the_restart(conn, "gateway_timeout_s")
    nodes = [make_node(conn, max_concurrency=2), make_node(conn, max_concurrency=2)]
    shared, other = make_key(conn), make_key(conn)
    dead, live, late = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    lanes = json.dumps([{"model": LLAMA8, "policy": "balanced", "want": 4, "need": 4, "in_use": {}}])
    leased = conn.execute("select node_id from renew_leases(%s, %s::jsonb) where slots > 0", (dead, lanes))
    assert sorted(row[0] for row in leased.fetchall()) == sorted(nodes)

    def write(gateway: uuid.UUID, *jobs: dict[str, Any], into: psycopg.Connection = conn) -> None:
        into.execute("select * from record_jobs(%s, %s::jsonb)", (gateway, json.dumps(list(jobs))))

    orphan, overdue = uuid.uuid4(), uuid.uuid4()
    write(dead, record(orphan, nodes[0], shared, age_s=1))  # the dead gateway's job, of the shared key
    write(late, record(overdue, nodes[0], other, age_s=120))  # past the job deadline, of the other key
    conn.execute("update private.gateways set seen_at = now() - interval '1 minute' where id = %s", (dead,))
    conn.execute(
        "insert into private.gateways (id) values (%s) on conflict (id) do update set seen_at = now()",
        (late,),
    )

    def locked(query: str) -> bool:
        row = conn.execute(
            "select count(*) from pg_stat_activity where wait_event_type = 'Lock' and query like %s",
            (f"%{query}%",),
        ).fetchone()
        return row is not None and row[0] > 0

    failed: dict[str, BaseException] = {}

    def run(name: str, body: Any) -> threading.Thread:
        def target() -> None:
            try:
                with psycopg.connect(db_url, autocommit=True) as own:
                    body(own)
            except psycopg.Error as err:
                failed[name] = err

        thread = threading.Thread(target=target)
        thread.start()
        return thread

    with psycopg.connect(db_url) as holder:  # holds the other key a moment: the sweep's steps stretch
        holder.execute("select from api_keys where id = %s for no key update", (other,))
        sweeping = run("sweep", lambda own: own.execute("select * from sweep()").fetchall())
        deadline = time.monotonic() + 5
        while sweeping.is_alive() and not locked("sweep()") and time.monotonic() < deadline:
            time.sleep(0.01)
        writing = run(
            "write",
            lambda own: write(live, record(uuid.uuid4(), nodes[1], shared, end=ENDED, age_s=1), into=own),
        )
        while writing.is_alive() and not locked("record_jobs") and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
    sweeping.join(10)
    writing.join(10)
    assert failed == {}
    for _ in range(3):  # what it skipped, the next sweeps end
        conn.execute("select * from sweep()").fetchall()
    statuses: dict[uuid.UUID, str] = dict(
        conn.execute("select id, status from jobs where id = any(%s)", ([orphan, overdue],)).fetchall()
    )
    assert statuses == {orphan: "failed", overdue: "failed"}
    assert conn.execute(
        "select count(*) from private.slot_leases where gateway_id = %s", (dead,)
    ).fetchone() == (0,)


def test_a_running_job_whose_node_was_deleted_is_still_swept(conn: psycopg.Connection) -> None:
    """Its attempt's node is null (the owner deleted the node): no node row to lock, and the sweep
    had left such a job running for good, its key's hold with it (a review's case)."""
    from neuralgrid.db.matching import MatchRequest, match_job

    node = make_node(conn)
    key = make_key(conn, budget_usd=1.0)
    job = match_job(conn, MatchRequest(model=LLAMA8), api_key_id=key, reserve_usd=0.5).job_id
    conn.execute("update jobs set created_at = now() - interval '2 hours' where id = %s", (job,))
    conn.execute("delete from nodes where id = %s", (node,))
    assert conn.execute("select job_id from sweep_stale_jobs('1 hour')").fetchall() == [(job,)]
    assert conn.execute("select reserved_usd::float8 from api_keys where id = %s", (key,)).fetchone() == (
        0.0,
    )
