"""The simulator: runs are reproducible, nothing is lost, each policy runs alone (its numpy twin is
checked against the SQL in tests/db/matching/test_sim_twin.py)."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from neuralgrid.cli import app
from neuralgrid.sim.engine import Scenario, Simulation
from neuralgrid.sim.report import load_catalog
from neuralgrid.sim.scarcity import SMALL_MODELS
from tests.conftest import LLAMA8


def run(conn: psycopg.Connection, policy: str, scenario: Scenario) -> Simulation:
    catalog, weights = load_catalog(conn)
    sim = Simulation(scenario, policy, weights.get(policy), catalog)
    sim.run()
    return sim


SMALL = Scenario(nodes=40, rps=5, duration_s=120, churn_per_hour=0.5, seed=11)


def test_the_same_seed_gives_the_same_results(conn: psycopg.Connection) -> None:
    for policy in ("balanced", "random"):
        assert run(conn, policy, SMALL).result.summary() == run(conn, policy, SMALL).result.summary()
    other = Scenario(**{**SMALL.__dict__, "seed": 12})
    assert run(conn, "balanced", other).result.summary() != run(conn, "balanced", SMALL).result.summary()


def test_every_request_ends_once_even_under_heavy_churn(conn: psycopg.Connection) -> None:
    heavy = Scenario(nodes=20, rps=10, duration_s=300, churn_per_hour=20.0, seed=5)
    for policy in ("seed", "seed_warm", "balanced", "round_robin", "least_loaded", "random"):
        sim = run(conn, policy, heavy)
        assert len(sim.outcomes) == len(sim.workload)  # none lost (a second ending raises)
        assert sim.result.served + sim.result.failed == len(sim.workload)
        assert sim.result.retries > 0  # the churn really hit requests in flight
        assert all(p.end < float("inf") for p in sim.placements)  # every slot claimed was given back
        assert not sim.fleet.inflight.any()


def simulate_cli(db_url: str, out: Path, *args: str) -> dict:  # type: ignore[type-arg]
    result = CliRunner().invoke(
        app, ["simulate", "--out", str(out), *args], env={"DATABASE_URL": db_url, "COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    return json.loads((out / "results.json").read_text())  # type: ignore[no-any-return]


DEMO_FLEET = Path(__file__).resolve().parents[2] / "neuralgrid" / "data" / "demo_fleet.json"
CALIBRATION = Path(__file__).resolve().parents[2] / "neuralgrid" / "sim" / "data" / "batching.json"


def test_each_policy_runs_on_its_own_copy_of_the_fleet(db_url: str, tmp_path: Path) -> None:
    """A policy's results do not depend on the policies run before it on the same fleet file (they
    did: all shared one fleet state, nodes left offline and all)."""
    args = ["--fleet", str(DEMO_FLEET), "--rps", "3", "--duration", "120", "--churn", "20"]
    alone = simulate_cli(db_url, tmp_path / "alone", *args, "--policies", "seed")
    after = simulate_cli(db_url, tmp_path / "after", *args, "--policies", "round_robin,balanced,seed")
    assert (
        alone["scenarios"]["default"]["policies"]["seed"] == after["scenarios"]["default"]["policies"]["seed"]
    )
    assert after["scenarios"]["default"]["policies"]["seed"]["retries"] > 0


def test_a_custom_policy_is_reported_under_its_own_name(
    conn: psycopg.Connection, db_url: str, tmp_path: Path
) -> None:
    """A matching_policies row runs with its own weights, in its own row (it was reported as
    `balanced`, and the real balanced row dropped)."""
    conn.execute(
        "insert into public.matching_policies (name, description, price, warm) values ('cheap', 'Cheapest.', 1, 0)"
    )
    data = simulate_cli(
        db_url, tmp_path, "--nodes", "40", "--rps", "4", "--duration", "60", "--policies", "balanced,cheap"
    )
    rows = data["scenarios"]["default"]["policies"]
    assert list(rows) == ["balanced", "cheap"]
    assert rows["cheap"]["policy"] == "cheap" and rows["cheap"] != {**rows["balanced"], "policy": "cheap"}


def test_simulate_command_writes_the_report_for_every_scenario(db_url: str, tmp_path: Path) -> None:
    data = simulate_cli(
        db_url, tmp_path, "--scenario", "all", "--nodes", "30", "--rps", "3", "--duration", "30"
    )
    assert set(data["scenarios"]) == {"default", "scarce-big", "scarce-burst", "churn-storm", "trace"}
    report = (tmp_path / "report.md").read_text()
    for name, scenario in data["scenarios"].items():
        assert set(scenario["policies"]) == {
            "seed",
            "seed_warm",
            "balanced",
            "balanced+prewarm",
            "balanced+prewarm+weight-only",  # the reserve as before issue 43
            "round_robin",
            "least_loaded",
            "random",
        }
        for plot in ("latency_cdf.png", "summary.png", "utilization.png"):
            assert (tmp_path / name / plot).stat().st_size > 0
        assert f"## {name}" in report
        # The developer's bill per token is the catalog's, whoever serves: equal up to which
        # requests were served.
        bills = [p["bill_usd_per_mtok"] for p in scenario["policies"].values() if p["served_pct"] == 100]
        assert max(bills) == pytest.approx(min(bills), rel=1e-3)
    assert data["scenarios"]["churn-storm"]["scenario"]["storm_share"] == 0.3
    assert data["scenarios"]["trace"]["scenario"]["arrivals"] == "azure"
    sweep = data["sweep"]
    # At the swept rate seed serves about 90% of 70B requests; every policy is measured there.
    assert sweep["policies"]["seed"]["big_model_served_pct"] >= 90
    assert any(p["seed_big_model_served_pct"] < 90 for p in sweep["probes"] if p["rps"] > sweep["rps"])
    assert set(sweep["policies"]) == set(data["scenarios"]["default"]["policies"])
    assert (tmp_path / "sweep.png").stat().st_size > 0 and "## Load sweep" in report
    # The scarcity study (issue 43): each policy at two loads of both scarce scenarios, and its ceiling.
    cells = data["scarcity"]["cells"]
    assert {(c["scenario"], c["load"]) for c in cells} == {
        (s, load) for s in ("scarce-big", "scarce-burst") for load in ("moderate", "heavy")
    }
    assert len(cells) == 4 * len(data["scenarios"]["default"]["policies"])
    assert all(c["ceiling_pct"] > 0 and set(c["small_pct"]) == set(SMALL_MODELS) for c in cells)
    assert [c["rps"] for c in cells if c["scenario"] == "scarce-burst"][-1] == pytest.approx(3 * 1.5)
    assert len(data["scarcity"]["goals"]) == 8 and "## Scarcity" in report


def test_simulate_refuses_unknown_names(db_url: str) -> None:
    env = {"DATABASE_URL": db_url}
    bad = CliRunner().invoke(app, ["simulate", "--policies", "fastest"], env=env)
    assert bad.exit_code == 1 and "unknown policy 'fastest'" in bad.stderr
    bad = CliRunner().invoke(app, ["simulate", "--scenario", "calm"], env=env)
    assert bad.exit_code == 1 and "unknown scenario 'calm'" in bad.stderr


def test_a_measured_batching_curve_is_taken_only_when_asked(db_url: str, tmp_path: Path) -> None:
    """The committed calibration (a 2-core CPU) slows batched streams far more than the analytic GPU
    model does; the default stays analytic, and a bad file is one line."""
    args = ["--nodes", "30", "--rps", "3", "--duration", "60", "--churn", "0", "--policies", "balanced"]
    analytic = simulate_cli(db_url, tmp_path / "a", *args)
    measured = simulate_cli(db_url, tmp_path / "m", *args, "--batching", str(CALIBRATION))
    assert analytic["model"]["batching"] == "analytic"
    assert measured["model"]["batching"].startswith("measured on")
    p95 = [d["scenarios"]["default"]["policies"]["balanced"]["p95_s"] for d in (analytic, measured)]
    assert p95[1] > p95[0]
    bad = CliRunner().invoke(
        app, ["simulate", "--batching", str(tmp_path / "none.json")], env={"DATABASE_URL": db_url}
    )
    assert bad.exit_code == 1 and "no such batching file" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_simulate_takes_a_fleet_file_and_a_trace(db_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "time_s,model,region,prompt_tokens,output_tokens\n"
        f"0.5,{LLAMA8},eu-west,300,50\n1.0,BAAI/bge-large-en-v1.5,us-east,100,0\n"
    )
    args = [
        "--fleet",
        str(DEMO_FLEET),
        "--trace",
        str(trace),
        "--duration",
        "30",
        "--churn",
        "0",
        "--progress",
    ]
    data = simulate_cli(db_url, tmp_path / "out", *args)
    assert data["scenarios"]["default"]["scenario"]["nodes"] == 24
    assert all(
        p["requests"] == 2 and p["served"] == 2 for p in data["scenarios"]["default"]["policies"].values()
    )
    trace.write_text("time_s,model,region,prompt_tokens,output_tokens\n0.5,no/such-model,eu-west,1,1\n")
    bad = CliRunner().invoke(app, ["simulate", "--trace", str(trace)], env={"DATABASE_URL": db_url})
    assert bad.exit_code == 1 and "trace.csv:2" in bad.stderr
