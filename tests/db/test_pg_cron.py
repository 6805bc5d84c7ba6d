"""The sweep on a real pg_cron (Debian's 1.4, on its PostgreSQL 15): scheduled whenever pg_cron is
enabled, before the push or after it, and a clear line where it is not. pg_cron 1.4 schedules in
minutes only; the migrations once asked it for '1 seconds' and failed the whole push.

(pg_cron 1.5 and later, as on hosted Supabase, take the schedule in seconds: there is none to run
here, so that branch of schedule_sweep() is chosen by the version it reads, untested by a server.)
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from neuralgrid.db import migrate
from tests.conftest import make_node, wait_for
from tests.db.debian_postgres import pg15_with_pg_cron

EACH_MINUTE = ("neuralgrid-sweep", "* * * * *")


@pytest.fixture
def url() -> Iterator[str]:
    with pg15_with_pg_cron() as url:
        yield url


def jobs(conn: psycopg.Connection) -> list[tuple[str, str]]:
    return conn.execute("select jobname, schedule from cron.job order by jobid").fetchall()


def run_until_cancelled(conn: psycopg.Connection, command: str) -> None:
    with contextlib.suppress(psycopg.errors.QueryCanceled):
        conn.execute(command.encode())  # bytes: its text as pg_cron sends it, no parameters


def test_pg_cron_enabled_before_the_push_sweeps_every_second_through_a_job_each_minute(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("create extension pg_cron")
        migrate.setup_database(conn)  # failed on '1 seconds' before
        assert jobs(conn) == [EACH_MINUTE]
        assert migrate.schedule_sweep(conn).startswith("pg_cron 1.4-1 schedules in minutes only")
        assert jobs(conn) == [EACH_MINUTE]  # again: the same job, not a second one
        (command,) = conn.execute("select command from cron.job").fetchone() or ("",)
        # The job's command, run as pg_cron runs it: a node that falls silent while it runs is seen
        # offline within a couple of seconds, long before the command ends (each sweep committed).
        with psycopg.connect(url, autocommit=True) as cron:
            runner = threading.Thread(target=run_until_cancelled, args=(cron, command))
            runner.start()
            try:
                # Silence counts from the database's start too, moments ago: beats of 0.2 s here.
                conn.execute("update platform_settings set heartbeat_interval_s = 0.2")
                silent = make_node(conn, "silent")
                stale = "update public.nodes set last_heartbeat_at = now() - interval '1 hour' where id = %s"
                conn.execute(stale, (silent,))
                status = "select status from public.nodes where id = %s"
                wait_for(lambda: conn.execute(status, (silent,)).fetchone() == ("offline",), timeout=5)
                assert runner.is_alive()
            finally:
                conn.execute("select pg_cancel_backend(%s)", (cron.info.backend_pid,))
                runner.join(timeout=10)


def test_pg_cron_enabled_after_the_push_is_scheduled_then(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        migrate.setup_database(conn)
        assert migrate.schedule_sweep(conn).startswith("pg_cron is not enabled: the gateways sweep")
        assert conn.execute("select to_regclass('cron.job')").fetchone() == (None,)
        conn.execute("create extension pg_cron")
        assert jobs(conn) == [EACH_MINUTE]


def test_db_migrate_says_whether_the_database_sweeps(url: str, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "neuralgrid.cli", "db", "migrate"]
    env = {"DATABASE_URL": url, "NEURALGRID_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    first = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "sweeper: pg_cron is not enabled: the gateways sweep" in first.stdout
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("create extension pg_cron")
    again = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "database is up to date" in again.stdout
    assert "sweeper: pg_cron 1.4-1 schedules in minutes only" in again.stdout
