"""A job never outlives its request by long: the sweep ends running jobs older than the platform's
job deadline (15 minutes by default), releasing their node slot and budget hold, charging nothing."""

from __future__ import annotations

import uuid
from decimal import Decimal

import psycopg
import pytest

from neuralgrid.db import queries as q
from neuralgrid.db.matching import MatchRequest, match_job
from neuralgrid.db.store import SyncStore
from tests.conftest import LLAMA8, make_key, make_node


def _job_started_ago(conn: psycopg.Connection, key: uuid.UUID, age: str) -> uuid.UUID:
    job = match_job(conn, MatchRequest(model=LLAMA8), api_key_id=key, reserve_usd=0.25).job_id
    conn.execute("update jobs set created_at = now() - %s::interval where id = %s", (age, job))
    return job


def test_the_sweep_ends_jobs_past_the_deadline_as_a_lost_completion(conn: psycopg.Connection) -> None:
    node = make_node(conn, max_concurrency=4)
    key = make_key(conn, budget_usd=1.0)
    late, recent = _job_started_ago(conn, key, "16 minutes"), _job_started_ago(conn, key, "14 minutes")

    swept = SyncStore(conn).all(q.SWEEP)  # as the gateway's sweeper and pg_cron call it

    assert [(s.kind, s.id) for s in swept] == [("job_abandoned", late)]
    assert conn.execute("select status, error from jobs where id = %s", (late,)).fetchone() == (
        "failed",
        "abandoned: no completion within 00:15:00",
    )
    # The late job's slot and hold are given back, nothing is charged, and the node is not blamed.
    assert conn.execute(
        "select inflight, failures, cooldown_until from nodes where id = %s", (node,)
    ).fetchone() == (1, 0, None)
    assert conn.execute("select reserved_usd, spent_usd from api_keys where id = %s", (key,)).fetchone() == (
        Decimal("0.25"),
        Decimal(0),
    )
    assert conn.execute("select status from jobs where id = %s", (recent,)).fetchone() == ("running",)


def test_the_deadline_is_a_platform_setting(conn: psycopg.Connection) -> None:
    make_node(conn)
    key = make_key(conn)
    conn.execute("update platform_settings set job_deadline_s = 60")
    job = _job_started_ago(conn, key, "2 minutes")
    # An age given to sweep() still wins over the setting.
    assert conn.execute("select id from sweep(interval '1 hour')").fetchall() == []
    assert conn.execute("select id from sweep()").fetchall() == [(job,)]
    with pytest.raises(psycopg.errors.CheckViolation, match="job_deadline_s must be positive"):
        conn.execute("update platform_settings set job_deadline_s = 0")
    assert conn.execute("select job_deadline_s from platform_settings").fetchone() == (60,)
