"""The request path's statements are planned once per connection, and read the ledger by key.

Postgres caches a function's plans per connection and plans again only when a table's statistics
change. A gateway's connections plan the request path early, on a new deployment while the ledger
is nearly empty, and the ledger then grows by thousands of jobs a minute before autovacuum analyzes
it. A plan that read a ledger table whole was the cheapest when made and stayed in use: each batch of
endings then cost more the more jobs there were.

Once the ledger is analyzed the opposite can happen: for a statement that takes parameters, Postgres
compares the plan it would cache with plans made for each call's values, and if the cached one looks
dearer it plans every call afresh. Planning complete_jobs()'s one large statement took longer than
running it (about 0.9 ms a call).
"""

from __future__ import annotations

import re
import uuid

import psycopg
from psycopg.types.json import Jsonb

from neuralgrid.bench import ledger_history
from neuralgrid.db import queries as q
from neuralgrid.db.store import SyncStore
from tests.conftest import LLAMA8, make_key, make_node
from tests.db.matching.test_place_jobs import GATEWAY, request
from tests.db.plans import logged_plans

GROUP = 8
LEDGER = ("jobs", "job_attempts", "earnings")


def _serve(conn: psycopg.Connection, key: uuid.UUID, group: int = GROUP) -> list[uuid.UUID]:
    """One group placed and ended, with the gateway's own statements; the jobs' ids."""
    store = SyncStore(conn)
    placed = store.all(q.PLACE_JOBS, (str(GATEWAY), Jsonb([request(key, wait=False)] * group)))
    ends = [
        q.JobEnd(row.job_id, prompt_tokens=10, completion_tokens=16, latency_ms=20)
        for row in placed
        if row.job_id
    ]
    assert len(ends) == group
    assert len(store.all(q.COMPLETE_JOBS, q.complete_jobs_params(ends))) == group
    return [end.job_id for end in ends]


def _grow_ledger(conn: psycopg.Connection, key: uuid.UUID) -> None:
    """Elsewhere, the ledger grows by 40,000 finished jobs."""
    with psycopg.connect(conn.info.dsn, autocommit=True) as other:
        assert ledger_history(other, key, LLAMA8, 40_000) == 40_000


def test_plans_made_on_a_small_ledger_read_it_by_key_once_it_has_grown(conn: psycopg.Connection) -> None:
    for _ in range(4):
        make_node(conn)
    key = make_key(conn, budget_usd=1000)
    for _ in range(10):  # past Postgres's first five runs of each statement: its plans are cached
        _serve(conn, key)
    _grow_ledger(conn, key)  # and nothing analyzes it

    with logged_plans(conn) as plans:
        _serve(conn, key)

    scans = re.findall(rf"Seq Scan on ({'|'.join(LEDGER)})\b", "\n".join(plans))
    assert scans == [], f"the request path read whole ledger tables: {scans}"


def test_ending_a_job_runs_a_cached_plan_once_the_ledger_is_analyzed(conn: psycopg.Connection) -> None:
    for _ in range(4):
        make_node(conn)
    key = make_key(conn, budget_usd=1000)
    _grow_ledger(conn, key)
    conn.execute("analyze public.jobs, public.job_attempts")
    for _ in range(10):  # a sequential caller: one job at a time, past the first five runs
        _serve(conn, key, group=1)

    with logged_plans(conn) as plans:
        (job,) = _serve(conn, key, group=1)

    # A plan made for this call's values has the job's id written into it; a cached one has $n.
    # (auto_explain also logs each statement's parameters; they are not the plan.)
    bodies = [
        "\n".join(line for line in plan.splitlines() if "Query Parameters:" not in line) for plan in plans
    ]
    planned_for_this_call = [body.split("Query Text: ")[-1][:60] for body in bodies if str(job) in body]
    assert planned_for_this_call == [], f"planned again for one job: {planned_for_this_call}"


def _updates(conn: psycopg.Connection, table: str) -> tuple[int, int]:
    """The table's updated rows so far, and how many of them were heap-only."""
    conn.execute("select pg_stat_force_next_flush()")
    query = "select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables where relname = %s"
    row = conn.execute(query, (table,)).fetchone()
    assert row is not None
    return row[0], row[1]


def test_ending_a_job_is_a_heap_only_update_of_jobs(conn: psycopg.Connection) -> None:
    """An ending sets the job's status and finished_at. Had an index named either (a partial
    index's condition counts), every ending would write a new entry into each of the ledger's
    indexes; the running set is found through the attempts instead, and finished_at's index
    summarizes (BRIN), which keeps an update heap-only."""
    for _ in range(4):
        make_node(conn)
    key = make_key(conn, budget_usd=1000)
    before = _updates(conn, "jobs")
    for _ in range(5):
        _serve(conn, key, group=1)
    updated, heap_only = (now - then for now, then in zip(_updates(conn, "jobs"), before, strict=True))
    assert updated >= 5 and heap_only == updated, f"{heap_only} of {updated} updates of jobs were heap-only"


def test_the_sweeps_find_running_jobs_without_reading_the_ledger(conn: psycopg.Connection) -> None:
    """Stale and orphaned jobs and the VRAM pressure start from the running attempts, by index:
    never from the whole ledger."""
    for _ in range(4):
        make_node(conn)
    key = make_key(conn, budget_usd=1000)
    _grow_ledger(conn, key)
    SyncStore(conn).all(q.PLACE_JOBS, (str(GATEWAY), Jsonb([request(key, wait=False)] * 3)))  # running
    # A busy fleet's share of a young ledger: at a few percent running, a join of jobs and their
    # attempts was planned as a scan of every job.
    conn.execute(
        "with j as (insert into jobs (model_id, policy, min_vram_gb) select %s, 'balanced', 18"
        " from generate_series(1, 1500) returning id)"
        " insert into job_attempts (job_id, attempt) select id, 1 from j",
        (LLAMA8,),
    )
    conn.execute("analyze public.jobs, public.job_attempts")

    with logged_plans(conn) as plans:
        conn.execute("select * from public.sweep()")
        conn.execute("select private.refresh_vram_pressure()")

    text = "\n".join(plans)
    assert "job_attempts_running_idx" in text
    scans = re.findall(rf"Seq Scan on ({'|'.join(LEDGER)})\b", text)
    assert scans == [], f"a sweep read whole ledger tables: {scans}"
