"""The simulator: its numpy twin ranks as the SQL does, runs are reproducible, nothing is lost."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import psycopg
import pytest
from typer.testing import CliRunner

from neuralgrid.cli import app
from neuralgrid.db.matching import MatchRequest, score_nodes
from neuralgrid.sim.engine import REGIONS, Scenario, Simulation
from neuralgrid.sim.policies import FleetArrays, score
from neuralgrid.sim.report import load_catalog
from tests.conftest import LLAMA8, make_node


def test_the_numpy_twin_ranks_exactly_as_score_nodes(conn: psycopg.Connection) -> None:
    """A thousand random requests over random fleets: same nodes, same order, same scores."""
    catalog, weights = load_catalog(conn)
    rng = random.Random(3)
    cases = 0
    for _fleet in range(8):
        conn.execute("delete from nodes")
        for i in range(40):
            conc = rng.choice([1, 4, 8])
            make_node(
                conn,
                f"n{i}",
                vram_gb=rng.choice([16, 24, 40, 48, 80]),
                tflops=rng.choice([71, 121, 165, 312, 989]),
                hourly_rate=rng.choice([0.0, 0.2, 0.35, 0.6, 1.1, 2.5]),
                region=rng.choice(REGIONS),
                status=rng.choice(["online"] * 6 + ["offline"]),
                max_concurrency=conc,
                inflight=rng.randint(0, conc),
                successes=rng.randint(0, 30),
                failures=rng.randint(0, 5),
                models={LLAMA8: rng.choice(["loaded", "available"])}
                if rng.random() < 0.8
                else {"other/model": "loaded"},
            )
        rows = conn.execute(
            "select n.id, n.vram_gb, n.tflops, n.hourly_rate::float8, n.region, n.inflight, n.max_concurrency,"
            " n.successes, n.failures, n.status = 'online', nm.state from nodes n"
            " left join node_models nm on nm.node_id = n.id and nm.model_id = %s order by n.id",
            (LLAMA8,),
        ).fetchall()
        fleet = FleetArrays(
            vram_gb=np.array([r[1] for r in rows], dtype=np.float64),
            tflops=np.array([r[2] for r in rows], dtype=np.float64),
            hourly_rate=np.array([r[3] for r in rows]),
            region=np.array([REGIONS.index(r[4]) for r in rows]),
            inflight=np.array([r[5] for r in rows]),
            max_concurrency=np.array([r[6] for r in rows]),
            successes=np.array([r[7] for r in rows], dtype=np.float64),
            failures=np.array([r[8] for r in rows], dtype=np.float64),
            online=np.array([r[9] for r in rows]),
        )
        holds = np.array([r[10] is not None for r in rows])
        loaded = np.array([r[10] == "loaded" for r in rows])
        for _ in range(125):
            policy = rng.choice(["balanced", "balanced", "seed"])
            region = rng.choice([None, *REGIONS])
            cap = rng.choice([None, None, 0.5, 1.5])
            sql = [
                r
                for r in score_nodes(
                    conn,
                    MatchRequest(model=LLAMA8, policy=policy, region=region, max_hourly_rate=cap),
                    explain=True,
                )
                if r.rank
            ]
            order, scores = score(
                policy,
                weights.get("balanced"),
                fleet,
                catalog[LLAMA8].min_vram_gb,
                holds,
                loaded,
                None if region is None else REGIONS.index(region),
                cap,
            )
            assert [rows[i][0] for i in order] == [r.node_id for r in sql], (policy, region, cap)
            assert scores == pytest.approx([r.score for r in sql], rel=1e-6)  # weights are float4 in SQL
            cases += 1
    assert cases == 1000


@pytest.fixture
def catalog_and_weights(conn: psycopg.Connection) -> tuple[object, object]:
    return load_catalog(conn)


def run(catalog_and_weights: tuple, policy: str, scenario: Scenario) -> Simulation:  # type: ignore[type-arg]
    catalog, weights = catalog_and_weights
    sim = Simulation(scenario, policy, weights.get("balanced"), catalog)
    sim.run()
    return sim


SMALL = Scenario(nodes=40, rps=5, duration_s=120, churn_per_hour=0.5, seed=11)


def test_the_same_seed_gives_the_same_results(catalog_and_weights: tuple) -> None:  # type: ignore[type-arg]
    for policy in ("balanced", "random"):
        a = run(catalog_and_weights, policy, SMALL).result.summary()
        b = run(catalog_and_weights, policy, SMALL).result.summary()
        assert a == b
    other = run(catalog_and_weights, "balanced", Scenario(**{**SMALL.__dict__, "seed": 12})).result.summary()
    assert other != run(catalog_and_weights, "balanced", SMALL).result.summary()


def test_every_request_ends_once_even_under_heavy_churn(catalog_and_weights: tuple) -> None:  # type: ignore[type-arg]
    heavy = Scenario(nodes=20, rps=10, duration_s=300, churn_per_hour=20.0, seed=5)
    for policy in ("seed", "balanced", "round_robin", "least_loaded", "random"):
        sim = run(catalog_and_weights, policy, heavy)
        assert len(sim.outcomes) == len(sim.workload)  # none lost (a second ending raises)
        assert sim.result.served + sim.result.failed == len(sim.workload)
        assert sim.result.retries > 0  # the churn really hit requests in flight


def test_a_tiny_scenario_with_a_known_outcome(catalog_and_weights: tuple) -> None:  # type: ignore[type-arg]
    """One request from eu-west for Llama 3.1 8B (400 prompt, 100 output tokens) and two nodes:
    a warm RTX 4090 in eu-west and a cold H100 in us-east. Worked by hand from engine.py's model."""

    def fleet() -> dict[str, object]:
        return {
            "gpu": ["RTX 4090", "H100 80GB"],
            "arrays": FleetArrays(
                vram_gb=np.array([24.0, 80.0]),
                tflops=np.array([165.0, 989.0]),
                hourly_rate=np.array([0.35, 2.5]),
                region=np.array([REGIONS.index("eu-west"), REGIONS.index("us-east")]),
                inflight=np.zeros(2, dtype=np.int64),
                max_concurrency=np.array([4, 16]),
                successes=np.zeros(2),
                failures=np.zeros(2),
                online=np.ones(2, dtype=bool),
            ),
        }

    workload = [(0.0, 0, REGIONS.index("eu-west"), 400, 100)]
    scenario = Scenario(nodes=2, rps=1, duration_s=60, churn_per_hour=0.0, seed=1)
    catalog, weights = catalog_and_weights
    results = {}
    for policy in ("balanced", "seed"):
        sim = Simulation(scenario, policy, weights.get("balanced"), catalog, fleet=fleet(), workload=workload)
        sim.loaded[1].clear()  # the H100 has nothing loaded
        sim.run()
        results[policy] = sim.result
    # balanced: the warm, right-sized, cheap, local 4090. 2 x 10 ms + prefill + decode at 2 x 0.35 x 165 tok/s.
    service = 2 * 8e9 * 400 / (165e12 * 0.4) + 100 / (2 * 0.35 * 165)
    assert results["balanced"].latencies == [pytest.approx(0.020 + service)]
    assert results["balanced"].cost_usd == pytest.approx(0.35 * service / 3600 / 4)
    assert results["balanced"].cold_starts == 0
    # seed: the bigger H100 wins the original formula, cold (15 s) and across the Atlantic (2 x 150 ms).
    h100 = 15 + 2 * 8e9 * 400 / (989e12 * 0.4) + 100 / (2 * 0.35 * 989)
    assert results["seed"].latencies == [pytest.approx(0.300 + h100)]
    assert results["seed"].cold_starts == 1


def test_simulate_command_writes_the_report(db_url: str, tmp_path: Path) -> None:
    args = ["simulate", "--nodes", "30", "--rps", "4", "--duration", "90", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args, env={"DATABASE_URL": db_url, "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in ("report.md", "results.json", "latency_cdf.png", "summary.png", "utilization.png"):
        assert (tmp_path / name).stat().st_size > 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["policies"]) == {"seed", "balanced", "round_robin", "least_loaded", "random"}
    assert len(data["goals"]) == 4 and "| balanced |" in (tmp_path / "report.md").read_text()
    bad = CliRunner().invoke(app, ["simulate", "--policies", "fastest"], env={"DATABASE_URL": db_url})
    assert bad.exit_code == 1 and "unknown policy 'fastest'" in bad.stderr


def test_simulate_takes_a_fleet_file_and_a_trace(db_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "time_s,model,region,prompt_tokens,output_tokens\n"
        f"0.5,{LLAMA8},eu-west,300,50\n1.0,BAAI/bge-large-en-v1.5,us-east,100,0\n"
    )
    fleet_file = Path(__file__).resolve().parents[2] / "neuralgrid" / "data" / "demo_fleet.json"
    args = [
        "simulate",
        "--fleet",
        str(fleet_file),
        "--trace",
        str(trace),
        "--duration",
        "30",
        "--churn",
        "0",
        "--out",
        str(tmp_path / "out"),
        "--progress",
    ]
    result = CliRunner().invoke(app, args, env={"DATABASE_URL": db_url, "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["scenario"]["nodes"] == 24
    assert all(p["requests"] == 2 and p["served"] == 2 for p in data["policies"].values())
    trace.write_text("time_s,model,region,prompt_tokens,output_tokens\n0.5,no/such-model,eu-west,1,1\n")
    bad = CliRunner().invoke(app, ["simulate", "--trace", str(trace)], env={"DATABASE_URL": db_url})
    assert bad.exit_code == 1 and "trace.csv:2" in bad.stderr
