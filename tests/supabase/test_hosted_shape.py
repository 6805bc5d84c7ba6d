"""The hosted path on a database shaped like a Supabase project's (issue 18): the migrations pushed
as the non-superuser `postgres`, with and without supautils, and the gateway serving on it.

Every other test runs as a superuser, which hides what a project's `postgres` may not do.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from neuralgrid.db import migrate
from tests.conftest import wait_for
from tests.supabase.shaped import ShapedCluster

POLICIES = (
    "select count(*) from pg_policies where schemaname = 'realtime' and tablename = 'messages'"
    " and policyname like 'Users % their own private topics'"
)
LLAMA8 = "meta-llama/Llama-3.1-8B-Instruct"
ROOT = Path(__file__).resolve().parents[2]
SUPABASE_CLI = ROOT / "node_modules" / ".bin" / "supabase"


def test_the_migrations_apply_as_postgres_on_a_hosted_project(
    conn: psycopg.Connection, hosted_template: str
) -> None:
    assert conn.execute("select rolsuper from pg_roles where rolname = current_user").fetchone() == (False,)
    applied = conn.execute("select count(*) from supabase_migrations.schema_migrations").fetchone()
    assert applied == (len(migrate.discover(migrate.default_migrations_dir())),)
    assert conn.execute(POLICIES).fetchone() == (2,)
    # Supabase's Realtime serves such a database: the embedded server's feed is not installed.
    assert conn.execute("select to_regprocedure('realtime.feed_notify(jsonb)')").fetchone() == (None,)


def test_without_supautils_the_push_succeeds_and_says_what_it_skipped(
    shaped: ShapedCluster, hosted_template: str, caplog: pytest.LogCaptureFixture
) -> None:
    _, url = shaped.database("bare", supautils=False)
    with psycopg.connect(url, autocommit=True) as conn:
        applied = migrate.setup_database(conn)
        assert len(applied) == len(migrate.discover(migrate.default_migrations_dir()))
        assert conn.execute(POLICIES).fetchone() == (0,)
    skipped = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(skipped) == 2 and "20261121000700_realtime.sql" in skipped[0], skipped
    assert "private-topic policies on realtime.messages were skipped" in skipped[0]
    # No pg_cron, and no right to watch for it (an event trigger): the push says what to run later.
    assert skipped[1].startswith("20261129000300_sweep_schedule.sql: pg_cron is not enabled")
    assert "run select public.schedule_sweep();" in skipped[1]
    shaped.database("after_bare", supautils=True)  # the cluster back as hosted, for the tests after


def test_the_gateway_serves_developers_and_owners_as_postgres(
    conn: psycopg.Connection, gateway: str, client: Any, fake_nodes: Any, operator_key: str
) -> None:
    node = fake_nodes("shaped-node")
    reply = client.chat.completions.create(model=LLAMA8, messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content
    streamed = client.chat.completions.create(
        model=LLAMA8, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    # Served from the gateway's lease, the jobs are written behind: in the ledger a moment later.
    ended = "select count(*) filter (where status = 'succeeded'), count(*) from jobs where node_id = %s"
    wait_for(lambda: conn.execute(ended, (node.node_id,)).fetchone() == (2, 2))

    spec = {"name": "owned", "gpu_model": "L4", "vram_gb": 24, "tflops": 121, "hourly_rate": 0.4}
    body = {**spec, "region": "eu", "endpoint_url": "tunnel:owned", "models": [LLAMA8]}
    headers = {"authorization": f"Bearer {operator_key}"}
    registered = httpx.post(f"{gateway}/v1/nodes", json=body, headers=headers)
    assert registered.status_code == 201, registered.text


def test_the_supabase_cli_pushes_as_postgres_without_supautils(
    shaped: ShapedCluster, hosted_template: str
) -> None:
    shaped.database("cli_push", supautils=False)
    url = f"postgresql://postgres@127.0.0.1:{shaped.server.port}/cli_push"
    try:
        pushed = subprocess.run(
            [str(SUPABASE_CLI), "migration", "up", f"--remote={url}", "--yes"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        shaped.database("after_cli_push", supautils=True)  # the cluster back as hosted
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    with psycopg.connect(url) as conn:
        applied = conn.execute("select count(*) from supabase_migrations.schema_migrations").fetchone()
        assert applied == (len(migrate.discover(migrate.default_migrations_dir())),)
        assert conn.execute(POLICIES).fetchone() == (0,)
