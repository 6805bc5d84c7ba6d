"""`neuralgrid bench world` runs end to end with tiny counts: a gateway next to the database and two
behind delay proxies, steady and cold requests, a revocation and a node's death. The figures are the
bench's to judge (no timing asserted but what the links themselves impose); this keeps every part
working and honest: each gateway measured, nothing failed, the revocation and the death reached
every gateway, and the far gateway's links delayed what they carry."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from neuralgrid.cli import app


def test_bench_world_measures_far_gateways_against_one_next_to_the_database(
    db_url: str, tmp_path: Path
) -> None:
    out_file = tmp_path / "world.json"
    args = ["--quick", "--rtts", "5,40", "--requests", "2", "--timeout-s", "5", "--out", str(out_file)]
    result = CliRunner().invoke(
        app, ["bench", "world", *args], env={"DATABASE_URL": db_url, "COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "first byte p50" in result.stdout and "dead node: avoided" in result.stdout
    report = json.loads(out_file.read_text())
    assert report["when"] and report["commit"] and report["command"] and report["target"]
    rows = {r["gateway"]: r for r in report["results"]}
    assert list(rows) == ["next to the database", "5 ms", "40 ms"]
    for r in rows.values():
        assert r["failed"] == r["cold_failed"] == 0, r
        assert r["samples"] == 4 and r["cold_samples"] == 2, r  # whole answers and streams
        assert r["whole_p50_ms"] > 0 and r["first_byte_p50_ms"] > 0 and r["cold_whole_p50_ms"] > 0, r
        assert r["revoked_refused_ms"] is not None and r["revoked_admitted_after_refusal"] == 0, r
        assert r["dead_node_share_before"] == 1.0 and r["dead_node_avoided_ms"] is not None, r
        assert r["dead_node_failed"] == 0, r
    assert rows["next to the database"]["whole_added_ms"] == 0
    assert rows["40 ms"]["whole_added_rtt"] is not None
    # A revocation's NOTIFY crosses the 40 ms link: half an RTT at least before a refusal.
    assert rows["40 ms"]["revoked_refused_ms"] >= 20
