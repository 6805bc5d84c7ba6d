"""Pre-warm in the simulator: the platform's rule (migration 20261127000200_prewarm.sql), and what it
does in a run: a cold placement makes an idle node of the region load the model, and the next
request there finds it warm."""

from __future__ import annotations

from neuralgrid.sim.engine import Simulation
from neuralgrid.sim.physics import LLAMA_8B, REGIONS
from neuralgrid.sim.prewarm import Job, Prewarm, PrewarmSettings
from neuralgrid.sim.report import World
from neuralgrid.sim.scenarios import MODEL_IDS, Loss, Request, Scenario
from tests.sim.conftest import fleet_of

EIGHT_B = MODEL_IDS.index(LLAMA_8B)
EU, US = REGIONS.index("eu-west"), REGIONS.index("us-east")


def test_unmet_demand_asks_one_node_per_interval_in_its_region() -> None:
    pw = Prewarm(PrewarmSettings())
    pw.record(Job(EIGHT_B, EU, created=1.0, unmet=True, ended=20.0))
    pw.refresh(30.0, warm_slots={(EIGHT_B, EU): 4})
    assert pw.demand[(EIGHT_B, EU)].wanted
    assert pw.pick(31.0, US, {EIGHT_B}) is None  # another region's demand
    assert pw.pick(31.0, EU, set()) is None  # a node that cannot load it
    assert pw.pick(31.0, EU, {EIGHT_B}) == EIGHT_B
    assert pw.pick(32.0, EU, {EIGHT_B}) is None  # once per interval
    # What it asked for answers the unmet demand: only newer cold placements count again.
    pw.refresh(40.0, warm_slots={(EIGHT_B, EU): 4})
    assert not pw.demand[(EIGHT_B, EU)].wanted


def test_load_near_the_warm_slots_wants_more_and_old_jobs_drop_out() -> None:
    pw = Prewarm(PrewarmSettings(window_s=100, busy_ratio=0.75))
    for i in range(4):  # 4 jobs busy for the whole window: a load of 3.2 against 4 warm slots
        pw.record(Job(EIGHT_B, EU, created=10.0 + i, unmet=False))
    pw.refresh(100.0, warm_slots={(EIGHT_B, EU): 4})
    assert pw.demand[(EIGHT_B, EU)].wanted
    pw.refresh(100.0, warm_slots={(EIGHT_B, EU): 8})
    assert not pw.demand[(EIGHT_B, EU)].wanted
    pw.refresh(500.0, warm_slots={})
    assert pw.demand == {}


def test_a_cold_placement_warms_an_idle_node_for_the_next_request(world: World) -> None:
    # Two RTX 3090s in eu-west, neither with the 8B loaded; one request at 0 s, one at 120 s, and
    # the node that served the first crashes at 60 s.
    fleet = fleet_of(("RTX 3090", "eu-west", []), ("RTX 3090", "eu-west", []))
    workload: list[Request] = [(0.0, EIGHT_B, EU, 200, 50), (120.0, EIGHT_B, EU, 200, 50)]
    scenario = Scenario(nodes=2, rps=1, duration_s=200, churn_per_hour=0.0, seed=1)

    def run(prewarm: PrewarmSettings | None) -> Simulation:
        sim = Simulation(
            scenario,
            "balanced",
            world.weights["balanced"],
            world.catalog,
            fleet=fleet,
            workload=workload,
            platform=world.platform,
            prewarm=prewarm,
        )
        sim.losses = [Loss(60.0, silent=False, busy=False, pick=0.0, rejoin_s=1e6)]
        sim.run()
        return sim

    without, with_prewarm = run(None), run(PrewarmSettings())
    assert without.result.summary()["cold_start_pct"] == 100.0  # each request loads on a cold node
    assert [p.node for p in without.placements] == [0, 1]
    summary = with_prewarm.result.summary()
    assert summary["prewarm_loads"] == 1
    assert summary["cold_start_pct"] == 50.0  # only the first
    assert summary["prewarm_used_pct"] == 100.0
    assert summary["prewarm_unused_gb_s"] > 0
