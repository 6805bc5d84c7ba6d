"""`neuralgrid bench gateway`'s peer: SGLang's model gateway (smg, in the dev extras) run beside ours on
the same fake node, in the same interleaved rounds, measured as ours is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from neuralgrid.cli import app


def run(db_url: str, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), env={"DATABASE_URL": db_url, "COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


def ratio(ours: float, theirs: float) -> float | None:
    return round(ours / theirs, 3) if theirs > 0 else None


@pytest.mark.usefixtures("small_ledger")
def test_bench_gateway_runs_smg_beside_the_gateway_and_the_relay(db_url: str, tmp_path: Path) -> None:
    """A handful of requests through smg, the bare relay and the gateway: smg's latency added to the
    direct path, requests/s and CPU per request, and the ratios of ours to it, in the table and the JSON
    (with the commit the run measured)."""
    out_file = tmp_path / "gateway.json"
    args = ["--callers", "1,4", "--requests", "6", "--paths", "relay,gateway,smg", "--warmup", "0.05"]
    args += ["--out", str(out_file)]
    code, out, err = run(db_url, "bench", "gateway", *args)
    assert code == 0, out + err
    assert "smg" in out and "gateway/smg" in out
    report = json.loads(out_file.read_text())
    assert (
        report["smg"]["version"].startswith("smg ")
        and "--disable-tokenizer-autoload" in report["smg"]["launch"]
    )
    assert report["when"] and report["commit"]  # (every bench's)
    assert [(r["stream"], r["callers"]) for r in report["results"]] == [
        (False, 1),
        (False, 4),
        (True, 1),
        (True, 4),
    ]
    for r in report["results"]:
        assert set(r) >= {"direct", "relay", "gateway", "smg"} and "agent" not in r
        s = r["smg"]
        assert s["refused_503"] == s["failed"] == 0 and s["served"] == s["requests"] and s["rps"] > 0
        assert 0 < s["p50_ms"] <= s["p99_ms"]
        assert s["gateway_cpu_ms_per_request"] > 0  # smg's own process, from /proc
        assert "postgres_cpu_ms_per_request" not in s  # it keeps no state in a database
        assert r["smg_added_p50_ms"] == round(s["p50_ms"] - r["direct"]["p50_ms"], 3)
        assert r["smg_added_p99_ms"] == round(s["p99_ms"] - r["direct"]["p99_ms"], 3)
        assert r["gateway_over_smg_added_p50"] == ratio(r["added_p50_ms"], r["smg_added_p50_ms"])
        assert r["relay_over_smg_added_p50"] == ratio(r["relay_added_p50_ms"], r["smg_added_p50_ms"])
        assert r["gateway_over_smg_rps"] == ratio(r["gateway"]["rps"], s["rps"])
        assert r["relay_over_smg_rps"] == ratio(r["relay"]["rps"], s["rps"])
        cpu = ratio(r["gateway"]["gateway_cpu_ms_per_request"], s["gateway_cpu_ms_per_request"])
        assert r["gateway_over_smg_cpu"] == cpu


@pytest.mark.usefixtures("small_ledger")
def test_bench_gateway_without_smg_says_so_and_runs_the_rest(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """smg missing: one line says so, and the other paths are measured all the same."""
    from neuralgrid.bench import peer

    monkeypatch.setattr(peer, "find_smg", lambda: None)
    out_file = tmp_path / "gateway.json"
    args = [
        "--callers",
        "1",
        "--requests",
        "4",
        "--paths",
        "relay,smg",
        "--warmup",
        "0",
        "--out",
        str(out_file),
    ]
    code, out, err = run(db_url, "bench", "gateway", *args)
    assert code == 0, out + err
    assert (out + err).splitlines().count(peer.NOT_INSTALLED) == 1 and "gateway/smg" not in out
    report = json.loads(out_file.read_text())
    assert report["smg"] == {"version": None}
    for r in report["results"]:
        assert "relay" in r and "smg" not in r and "gateway_over_smg_rps" not in r
