"""The request path reads the ledger (jobs, their attempts) by key, whatever its size when planned.

Postgres caches a function's plans per connection and plans again only when a table's statistics
change. A gateway's connections plan the request path early, on a new deployment while the ledger
is nearly empty, and the ledger then grows by thousands of jobs a minute before autovacuum analyzes
it. A plan that read a ledger table whole was the cheapest when made and stayed in use: each batch of
endings then cost more the more jobs there were.
"""

from __future__ import annotations

import re
import uuid

import psycopg
from psycopg.types.json import Jsonb

from neuralgrid.db import queries as q
from neuralgrid.db.store import SyncStore
from tests.conftest import LLAMA8, make_key, make_node
from tests.db.matching.test_place_jobs import GATEWAY, request

GROUP = 8
LEDGER = ("jobs", "job_attempts", "earnings")


def _serve(conn: psycopg.Connection, key: uuid.UUID) -> None:
    """One group placed and ended, with the gateway's own statements."""
    store = SyncStore(conn)
    placed = store.all(q.PLACE_JOBS, (str(GATEWAY), Jsonb([request(key, wait=False)] * GROUP)))
    ends = [
        q.JobEnd(row.job_id, prompt_tokens=10, completion_tokens=16, latency_ms=20)
        for row in placed
        if row.job_id
    ]
    assert len(ends) == GROUP
    assert len(store.all(q.COMPLETE_JOBS, q.complete_jobs_params(ends))) == GROUP


def test_plans_made_on_a_small_ledger_read_it_by_key_once_it_has_grown(conn: psycopg.Connection) -> None:
    nodes = [make_node(conn) for _ in range(4)]
    key = make_key(conn, budget_usd=1000)
    for _ in range(10):  # past Postgres's first five runs of each statement: its plans are cached
        _serve(conn, key)

    # Elsewhere, the ledger grows by 40,000 finished jobs; nothing analyzes it.
    with psycopg.connect(conn.info.dsn, autocommit=True) as other:
        other.execute("set session_replication_role = replica")  # history, not requests: no triggers
        other.execute(
            "insert into public.jobs (api_key_id, model_id, policy, status, node_id, attempts, stream,"
            " min_vram_gb, finished_at)"
            " select %s, %s, 'balanced', 'succeeded', (%s::uuid[])[1 + i %% 4], 1, false, 16, now()"
            " from generate_series(1, 40000) i",
            (key, LLAMA8, nodes),
        )
        other.execute(
            "insert into public.job_attempts (job_id, attempt, node_id, status, ended_at)"
            " select j.id, 1, j.node_id, 'succeeded', now() from public.jobs j"
            " where not exists (select from public.job_attempts a where a.job_id = j.id)"
        )

    # Every plan the next group runs, the nested statements of the functions included.
    conn.execute("load 'auto_explain'")
    conn.execute(
        "set auto_explain.log_min_duration = 0; set auto_explain.log_nested_statements = on;"
        " set auto_explain.log_level = notice"
    )
    plans: list[str] = []
    conn.add_notice_handler(lambda notice: plans.append(notice.message_primary or ""))
    _serve(conn, key)
    conn.execute("set auto_explain.log_min_duration = -1")

    assert plans, "auto_explain logged no plan"
    scans = re.findall(rf"Seq Scan on ({'|'.join(LEDGER)})\b", "\n".join(plans))
    assert scans == [], f"the request path read whole ledger tables: {scans}"
