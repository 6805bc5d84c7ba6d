"""`neuralgrid bench heartbeats` runs end to end on a small fleet: a gateway process written to per beat
and batching, the code before issue 41 in SQL, and the fleet at scale in SQL. The figures are the
bench's to judge (no timing in tests); this keeps every part of it working and honest: each beat
offered was written, each part measured its CPU and WAL, the matcher ran."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from neuralgrid.cli import app


def test_bench_heartbeats_measures_batched_against_per_beat(db_url: str, tmp_path: Path) -> None:
    out_file = tmp_path / "heartbeats.json"
    args = ["--nodes", "40", "--fleet", "120", "--seconds", "1", "--interval", "0.5", "--out", str(out_file)]
    result = CliRunner().invoke(
        app, ["bench", "heartbeats", *args], env={"DATABASE_URL": db_url, "COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "pg us/beat" in result.stdout and "batched_over_per_beat_cpu_sql" in result.stdout
    report = json.loads(out_file.read_text())
    assert report["when"] and report["commit"] and report["command"]
    cases = [(r["path"], r["code"], r["nodes"]) for r in report["results"]]
    assert cases == [
        ("gateway", "per-beat", 40),
        ("gateway", "batched", 40),
        ("sql", "per-beat", 40),
        ("sql", "batched", 40),
        ("sql", "per-beat, before issue 41", 40),
        ("sql", "batched", 120),
    ]
    for r in report["results"]:
        assert r["beats_per_s"] > 0 and r["postgres_cpu_us_per_beat"] > 0 and r["wal_bytes_per_beat"] > 0, r
        assert r["match_p99_ms"] > 0 and r["quiet_match_p99_ms"] > 0, r
        # match_job()'s own time in Postgres, from the caller's process: within what the caller saw.
        assert 0 < r["match_pg_p99_ms"] <= r["match_p99_ms"], r
        if r["path"] == "gateway":
            assert r["failed"] == 0 and r["gateway_cpu_us_per_beat"] > 0, r
            assert r["agents_nice"] == 10, r  # the agents stand for machines of their own
    assert set(report["summary"]) == {
        "batched_over_per_beat_cpu_gateway",
        "batched_over_per_beat_cpu_sql",
        "batched_over_before_cpu_sql",
        "delivered_over_offered",
        "match_p99_under_beats_over_quiet_gateway",
        "match_p99_under_beats_over_quiet_sql",
        "match_p99_under_beats_over_quiet_at_scale",
        "match_pg_p99_under_beats_over_quiet_gateway",
        "match_pg_p99_under_beats_over_quiet_at_scale",
    }
    assert all(value is not None and value > 0 for value in report["summary"].values()), report["summary"]
