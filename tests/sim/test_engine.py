"""The engine against outcomes worked by hand from physics.py's model: placement, loading, batching,
and losing nodes the way the platform notices them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from neuralgrid.sim.engine import Simulation
from neuralgrid.sim.physics import GPU_BY_NAME, LLAMA_8B, MODELS, REGIONS, Batching
from neuralgrid.sim.report import World
from neuralgrid.sim.scenarios import MODEL_IDS, Fleet, Loss, Request, Scenario
from tests.sim.conftest import fleet_of

EIGHT_B = MODEL_IDS.index(LLAMA_8B)
EU, US = REGIONS.index("eu-west"), REGIONS.index("us-east")
QUIET = Scenario(nodes=2, rps=1, duration_s=60, churn_per_hour=0.0, seed=1)


def simulate(
    world: World, policy: str, fleet: Fleet, workload: list[Request], losses: Sequence[Loss] = ()
) -> Simulation:
    weights = world.weights.get(policy)
    sim = Simulation(
        QUIET, policy, weights, world.catalog, fleet=fleet, workload=workload, platform=world.platform
    )
    sim.losses = list(losses)
    sim.run()
    return sim


def service_s(gpu: str, prompt: int, output: int, streams: int = 1) -> float:
    """Prefill at 40% of the TFLOPS, then `output` decode steps shared by `streams` streams."""
    g, m = GPU_BY_NAME[gpu], MODELS[EIGHT_B]
    prefill = 2 * 8.03e9 * prompt / (g.tflops * 1e12 * 0.4)
    kv = 131072 * (prompt + output / 2)  # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
    step = m.weight_gb / (g.bandwidth_gb_s * 0.7) + streams * (
        kv / (g.bandwidth_gb_s * 1e9 * 0.7) + 2 * 8.03e9 / (g.tflops * 1e12 * 0.4)
    )
    return prefill + output * step


def test_warm_and_near_against_big_and_cold(world: World) -> None:
    """One request from eu-west for Llama 3.1 8B: a warm RTX 4090 in eu-west, a cold H100 in us-east."""

    def fleet() -> Fleet:
        return fleet_of(("RTX 4090", "eu-west", [LLAMA_8B]), ("H100 80GB", "us-east", []))

    workload = [(0.0, EIGHT_B, EU, 400, 100)]
    near = 2 * 0.010 + service_s("RTX 4090", 400, 100)
    for policy in ("balanced", "seed_warm"):  # seed_warm: warm nodes first
        result = simulate(world, policy, fleet(), workload).result
        assert result.latencies == [pytest.approx(near)]
        assert result.load_waits == result.loads == 0
        assert result.supply_usd == pytest.approx(0.35 * (near - 0.020) / 3600 / 4)
    # seed: the biggest, fastest node wins the original formula: cold (16.06 GB at 2 GB/s + 5 s)
    # and across the Atlantic (2 x 150 ms).
    seed = simulate(world, "seed", fleet(), workload).result
    assert seed.latencies == [pytest.approx(0.300 + 16.06 / 2 + 5 + service_s("H100 80GB", 400, 100))]
    assert seed.loads == seed.load_waits == 1
    # Either way the developer pays the catalog's price: 400 x $0.05 + 100 x $0.10 per 1M tokens.
    assert seed.bill_usd == pytest.approx((400 * 0.05 + 100 * 0.10) / 1e6)


def test_a_loading_model_serves_no_one_until_loaded(world: World) -> None:
    """The second request finds the model loading: it waits for that load, and counts as cold."""
    sim = simulate(
        world,
        "seed",
        fleet_of(("H100 80GB", "us-east", [])),
        [(0.0, EIGHT_B, US, 400, 100), (5.0, EIGHT_B, US, 400, 100)],
    )
    loaded = 16.06 / 2 + 5
    both = 0.020 + service_s("H100 80GB", 400, 100, streams=2)
    assert sorted(sim.result.latencies) == [pytest.approx(loaded - 5 + both), pytest.approx(loaded + both)]
    assert sim.result.loads == 1 and sim.result.load_waits == 2
    assert sim.ready[EIGHT_B, 0]


def test_streams_on_one_gpu_share_its_decode_steps(world: World) -> None:
    workload = [(0.0, EIGHT_B, US, 400, 100)] * 8
    sim = simulate(world, "seed", fleet_of(("H100 80GB", "us-east", [LLAMA_8B])), workload)
    batch = 0.020 + service_s("H100 80GB", 400, 100, streams=8)
    alone = 0.020 + service_s("H100 80GB", 400, 100)
    assert sim.result.latencies == [pytest.approx(batch)] * 8
    assert alone < batch < 1.1 * alone  # eight at a time, each nearly as fast as one alone


def two_h100s() -> Fleet:
    # seed prefers node 0, the cheaper one (1 / (rate + 0.01) in the formula).
    return fleet_of(
        ("H100 80GB", "us-east", [LLAMA_8B]), ("H100 80GB", "us-east", [LLAMA_8B]), rate=[2.0, 2.5]
    )


def test_a_silently_lost_node_is_noticed_at_the_sweep(world: World) -> None:
    """Node 0 goes silent at t = 7 s. Its last heartbeat was at 5 s, so the sweeper marks it offline
    at 20 s: until then it keeps its request, and takes new ones that time out on connecting (2 s)
    and cool it down (5 s, then 10 s)."""
    workload = [(0.0, EIGHT_B, US, 400, 2000), (8.0, EIGHT_B, US, 100, 10), (11.0, EIGHT_B, US, 100, 10)]
    workload += [(16.0, EIGHT_B, US, 100, 10), (19.0, EIGHT_B, US, 100, 10)]
    sim = simulate(
        world, "seed", two_h100s(), workload, [Loss(7.0, silent=True, busy=True, pick=0.0, rejoin_s=1e6)]
    )
    on_node_0 = [(p.start, p.end) for p in sim.placements if p.node == 0]
    # The first request until the sweep; one at 8 s (fails at 10 s, cooling to 15 s); 11 s goes to
    # node 1; one at 16 s (fails at 18 s, cooling to 28 s); 19 s goes to node 1.
    assert on_node_0 == [(0.0, 20.0), (8.0, 10.0), (16.0, 18.0)]
    assert not sim.fleet.online[0] and sim.result.retries == 3 and sim.result.served == 5
    assert max(sim.result.latencies) > 20  # the first request started over at 20 s


def test_a_crashed_node_fails_its_requests_at_once(world: World) -> None:
    workload = [(0.0, EIGHT_B, US, 400, 2000), (8.0, EIGHT_B, US, 100, 10), (14.0, EIGHT_B, US, 100, 10)]
    sim = simulate(
        world, "seed", two_h100s(), workload, [Loss(7.0, silent=False, busy=True, pick=0.0, rejoin_s=1e6)]
    )
    on_node_0 = [(p.start, p.end) for p in sim.placements if p.node == 0]
    # Reset at 7 s (cooling to 12 s), refused at 14 s (cooling to 24 s), offline at the 20 s sweep.
    assert on_node_0 == [(0.0, 7.0), (14.0, 14.0)]
    assert sim.result.retries == 2 and sim.result.served == 3


def test_churn_picks_busy_nodes(world: World) -> None:
    """A loss with busy=True takes a node with requests in flight, whichever the policy filled."""
    workload = [(0.0, EIGHT_B, US, 400, 2000)]
    for policy in ("seed", "round_robin"):
        sim = simulate(
            world,
            policy,
            two_h100s(),
            workload,
            [Loss(5.0, silent=False, busy=True, pick=0.99, rejoin_s=1e6)],
        )
        assert sim.result.retries == 1 and sim.result.served == 1


def test_a_measured_batching_curve_sets_the_per_stream_slowdown(world: World) -> None:
    """With a calibration, n streams decode at one stream's speed x per_stream_rel(n)."""
    curve = Batching("a test", (1, 2, 4, 8), (1.0, 0.9, 0.7, 0.5))
    workload = [(0.0, EIGHT_B, US, 400, 100)] * 8
    sim = Simulation(
        QUIET,
        "seed",
        None,
        world.catalog,
        fleet=fleet_of(("H100 80GB", "us-east", [LLAMA_8B])),
        workload=workload,
        batching=curve,
    )
    sim.run()
    prefill = service_s("H100 80GB", 400, 0)
    one_stream_step = (service_s("H100 80GB", 400, 100) - prefill) / 100
    assert sim.result.latencies == [pytest.approx(0.020 + prefill + 100 * one_stream_step / 0.5)] * 8
