"""Supabase Edge Functions, tested with Deno against a migrated embedded Postgres."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[2]
DENO = ROOT / "node_modules" / ".bin" / "deno"


def test_match_function(pg_server, db_url: str) -> None:  # type: ignore[no-untyped-def]
    assert DENO.exists(), "run the README's setup: Deno comes from package.json"
    info = psycopg.conninfo.conninfo_to_dict(db_url)
    url = f"postgresql://postgres@127.0.0.1:{pg_server.port}/{info['dbname']}"
    result = subprocess.run(
        [
            str(DENO),
            "test",
            "--config",
            "supabase/functions/deno.json",
            "--allow-env",
            "--allow-net",
            "--allow-read",
            "supabase/functions/",
        ],
        cwd=ROOT,
        env={**os.environ, "DB_URL": url, "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_functions_are_lint_clean() -> None:
    """`deno lint` as the Supabase CLI's functions template runs it (dependencies in deno.json)."""
    result = subprocess.run(
        [str(DENO), "lint", "--config", "supabase/functions/deno.json", "supabase/functions/"],
        cwd=ROOT,
        env={**os.environ, "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
