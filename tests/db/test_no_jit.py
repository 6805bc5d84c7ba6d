"""The platform's functions never JIT-compile: each call is a short transaction, and LLVM's compile
of one statement costs more than the whole call (on Debian's PostgreSQL 15, whose JIT is on as in
most packaged builds, each sweep compiled for 1.6 to 2.0 s, every second). The embedded default has
no JIT, so the rule is checked on every function the platform calls, and shown on a real JIT."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg

from neuralgrid.db import migrate
from neuralgrid.db import queries as q
from neuralgrid.db.queries.query import Query
from neuralgrid.realtime import sql as realtime_sql
from tests.db.debian_postgres import pg15_with_pg_cron

ROOT = Path(__file__).resolve().parents[2]
CALLED = re.compile(r"\b(public|private|realtime)\.([a-z_0-9]+)\s*\(")
RPC = re.compile(r"""\brpc\(\s*["']([a-z_0-9]+)["']""")
OURS = "select p.oid::regprocedure::text, coalesce(p.proconfig, '{}') from pg_proc p join pg_namespace n on n.oid = p.pronamespace where n.nspname || '.' || p.proname = any(%s)"


def called_functions() -> set[str]:
    """What the platform calls: the seam's statements, the Data API's RPCs (web pages, the hosted
    CLI), the Edge Functions' SQL, and pg_cron's job (public.sweep(), scheduled in SQL)."""
    statements = [v.sql for m in (q, realtime_sql) for v in vars(m).values() if isinstance(v, Query)]
    edge = [p.read_text() for p in (ROOT / "supabase/functions").glob("*/index.ts")]
    names = {f"{schema}.{name}" for text in statements + edge for schema, name in CALLED.findall(text)}
    for client in [ROOT / "neuralgrid/hosted.py", *(ROOT / "neuralgrid/web/static/js").glob("*.js")]:
        names |= {f"public.{name}" for name in RPC.findall(client.read_text())}
    return names | {"public.sweep"}


def test_every_function_the_platform_calls_runs_without_jit(conn: psycopg.Connection) -> None:
    called = called_functions()
    assert {"public.place_jobs", "public.renew_leases", "public.map_view", "public.my_nodes"} <= called
    functions = conn.execute(OURS, (sorted(called),)).fetchall()
    assert len(functions) >= 40  # tables named like calls (realtime.messages (...)) are not functions
    compiled = [signature for signature, config in functions if "jit=off" not in config]
    assert not compiled, f"set jit off on these (a migration, and the schema file): {compiled}"


def test_a_sweep_on_a_postgres_with_jit_compiles_nothing() -> None:
    with pg15_with_pg_cron() as url, psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("select pg_jit_available()").fetchone() == (True,)
        migrate.setup_database(conn)
        plans: list[str] = []
        conn.add_notice_handler(lambda notice: plans.append(notice.message_primary or ""))
        conn.execute("load 'auto_explain'")
        for setting in ("log_min_duration = 0", "log_nested_statements = on", "log_level = notice"):
            conn.execute(f"set auto_explain.{setting}")
        conn.execute("select public.sweep()")
        assert len(plans) > 5  # each of the sweep's statements, explained
        compiled = [plan for plan in plans if "JIT:" in plan]
        assert not compiled, compiled[0][:600]
