"""`neuralgrid bench map`, run small: a fleet of 100 (the view's markers) and of 1,000 (clusters) in
headless Chromium, each page's paints, heap and reads, and the page live while statuses change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from neuralgrid.cli import app


def test_bench_map_measures_the_page_at_each_size(db_url: str, tmp_path: Path) -> None:
    if shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (./dev test installs it with apt)")
    out_file = tmp_path / "map.json"
    args = [
        "bench",
        "map",
        "--sizes",
        "100,1000",
        "--rounds",
        "2",
        "--rate",
        "20",
        "--seconds",
        "3",
        "--quiet",
        "1",
    ]
    result = CliRunner().invoke(
        app, [*args, "--out", str(out_file)], env={"DATABASE_URL": db_url, "COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "map ready" in result.stdout and "msgs/s" in result.stdout
    report = json.loads(out_file.read_text())
    assert report["benchmark"] == "map" and report["when"] and report["commit"]
    small, big = report["results"]
    assert (small["nodes"], big["nodes"]) == (100, 1000)
    # A hundred nodes are markers; a thousand are the summary's clusters, and never a row a node.
    assert small["markers"] == 100 and small["clusters"] == 0
    assert big["markers"] == 0 and 0 < big["clusters"] <= 30 and big["rows"] == 50
    for r in report["results"]:
        assert 0 < r["first_paint_ms"] <= r["map_ready_ms"] and r["rounds"] == 2
        assert len(r["map_ready_ms_each"]) == 2 and r["js_heap_mb"] > 0 and r["json_kb"] > 0
        live = r["live"]
        assert live["changes_per_s"] > 10
        # The summary, at most one a second: a message for every change was the map before issue 41.
        assert 0 < live["summaries_per_s"] <= live["messages_per_s"] <= 1.5, live
        assert live["postgres_cpu_ms_per_s"] > 0 and live["gateway_cpu_ms_per_s"] > 0
        assert live["quiet_postgres_cpu_ms_per_s"] > 0 and live["unwatched_postgres_cpu_ms_per_s"] > 0
    assert big["map_ready_over_smallest"] == round(big["map_ready_ms"] / small["map_ready_ms"], 3)
