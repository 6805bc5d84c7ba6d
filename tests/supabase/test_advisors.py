"""Supabase's Security and Performance Advisor (splinter's lints, as the Supabase CLI runs them with
`supabase db advisors`) on a hosted-shaped database after our migrations: no errors, no warnings.

Measured before (issue 18): 7 warnings, `function_search_path_mutable` on the matcher's helpers.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psycopg

from tests.supabase.shaped import ShapedCluster

ROOT = Path(__file__).resolve().parents[2]
SUPABASE_CLI = ROOT / "node_modules" / ".bin" / "supabase"


def advisors(url: str) -> list[dict[str, object]]:
    command = [str(SUPABASE_CLI), "db", "advisors", f"--remote={url}", "--type", "all", "--level", "info"]
    result = subprocess.run(
        [*command, "--output-format", "json", "--yes"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    found: list[dict[str, object]] = json.loads(result.stdout)["results"]
    return found


def test_the_advisors_find_no_errors_or_warnings(shaped: ShapedCluster, conn: psycopg.Connection) -> None:
    url = f"postgresql://postgres@127.0.0.1:{shaped.server.port}/{conn.info.dbname}"
    found = advisors(url)
    assert found, "the advisors ran (their INFO-level findings at least are expected)"
    serious = [f"{f['level']} {f['name']}: {f['detail']}" for f in found if f["level"] != "INFO"]
    assert serious == []
