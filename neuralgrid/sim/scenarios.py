"""The simulated world: scenarios, the fleets and workloads they generate, and fleet and trace files.

A scenario fixes everything but the policy: the fleet, the requests and the churn events are drawn
from its seed, so every policy faces the same ones. Churn is drawn as events (when, how the node is
lost, when it returns) and a victim is picked when the event fires, from the state the policy made:
with probability `busy_bias` among the busy nodes (weighted by requests in flight), else among all.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from neuralgrid.sim import traces
from neuralgrid.sim.physics import (
    BIG_MODEL,
    CALLER_WEIGHTS,
    GPU_BY_NAME,
    GPUS,
    MODELS,
    REGIONS,
)
from neuralgrid.sim.policies import FleetArrays

MODEL_IDS = [m.id for m in MODELS]


@dataclass(frozen=True)
class Scenario:
    name: str = "custom"
    nodes: int = 200
    rps: float = 20.0
    duration_s: float = 600.0
    churn_per_hour: float = 0.10  # share of the fleet lost per hour, spread evenly
    arrivals: str = "bursty"  # bursty (x3 one minute in five) | poisson | azure (traces.py)
    seed: int = 7
    big_node_share: float | None = None  # share of 80 GB nodes, else the GPU table's
    big_model_share: float | None = None  # share of requests for the 70B AWQ model, else MODELS'
    silent_share: float = 0.5  # of nodes lost, the share lost silently (else they crash)
    busy_bias: float = 0.5  # of nodes lost, the share picked among busy nodes
    storm_share: float = 0.0  # a storm: this share of the fleet lost ...
    storm_start_s: float = 120.0  # ... from here ...
    storm_window_s: float = 120.0  # ... within this long
    rejoin_mean_s: float = 600.0  # a lost node returns (cold) after this long on average
    burst_factor: float = 3.0  # bursty arrivals: the rate times this one minute in five
    cold: bool = False  # the fleet starts with no model loaded
    heavy_factor: float | None = None  # the scarcity study's heavy load, times `rps` (scarcity.py)
    description: str = ""

    @property
    def bursty(self) -> bool:
        return self.arrivals != "poisson"


SCENARIOS = {
    "default": Scenario(
        "default", description="The reference world: a mixed fleet and workload, light churn"
    ),
    "scarce-big": Scenario(
        "scarce-big",
        big_node_share=0.10,
        big_model_share=0.20,
        heavy_factor=2.25,  # 45 requests/s
        description="80 GB nodes are 10% of the fleet (20% by default) and 20% of requests are for the"
        " 70B AWQ model (10% by default), which only they can serve",
    ),
    "scarce-burst": Scenario(
        "scarce-burst",
        rps=25.0,
        big_node_share=0.10,
        big_model_share=0.20,
        burst_factor=5.0,
        cold=True,
        heavy_factor=1.5,  # 37.5 requests/s, more than the 80 GB nodes serve of the 70B alone
        description="scarce-big, heavier and burstier, on a fleet that starts cold: 25 requests/s, x5"
        " one minute in five from t = 0, no model loaded anywhere at the start",
    ),
    "churn-storm": Scenario(
        "churn-storm",
        storm_share=0.30,
        silent_share=1.0,
        busy_bias=1.0,
        description="On top of the default churn, 30% of the fleet is lost within 2 minutes from"
        " t = 120 s, the busiest nodes first, all silently: each is noticed at the sweep after its"
        " third missed heartbeat",
    ),
    "trace": Scenario(
        "trace",
        arrivals="azure",
        description="Arrivals and prompt/answer lengths in the shape of the Azure LLM inference trace"
        " 2023, conversation and code (neuralgrid/sim/traces.py)",
    ),
}


@dataclass
class Fleet:
    arrays: FleetArrays
    gpu: list[str]
    bandwidth_gb_s: np.ndarray
    warm: list[list[int]]  # model indexes loaded at the start, per node
    heartbeat_phase: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __len__(self) -> int:
        return len(self.gpu)

    @classmethod
    def at_rest(
        cls,
        *,
        gpu: list[str],
        vram_gb: Sequence[float],
        tflops: Sequence[float],
        hourly_rate: Sequence[float] | np.ndarray,
        region: Sequence[int] | np.ndarray,
        max_concurrency: Sequence[int],
        bandwidth_gb_s: Sequence[float],
        warm: list[list[int]],
        heartbeat_phase: np.ndarray,
        online: Sequence[bool] | None = None,
    ) -> Fleet:
        """A fleet before its first request: nothing in flight, no successes or failures, every node
        online unless `online` says otherwise."""
        n = len(gpu)
        return cls(
            arrays=FleetArrays(
                vram_gb=np.array(vram_gb, dtype=np.float64),
                tflops=np.array(tflops, dtype=np.float64),
                hourly_rate=np.array(hourly_rate, dtype=np.float64),
                region=np.array(region, dtype=np.int64),
                inflight=np.zeros(n, dtype=np.int64),
                max_concurrency=np.array(max_concurrency, dtype=np.int64),
                successes=np.zeros(n),
                failures=np.zeros(n),
                online=np.ones(n, dtype=bool) if online is None else np.array(online, dtype=bool),
            ),
            gpu=gpu,
            bandwidth_gb_s=np.array(bandwidth_gb_s, dtype=np.float64),
            warm=warm,
            heartbeat_phase=heartbeat_phase,
        )


def model_shares(scenario: Scenario) -> np.ndarray:
    shares = np.array([m.share for m in MODELS])
    if scenario.big_model_share is not None:
        big = MODEL_IDS.index(BIG_MODEL)
        rest = np.delete(np.arange(len(MODELS)), big)
        shares[rest] *= (1 - scenario.big_model_share) / shares[rest].sum()
        shares[big] = scenario.big_model_share
    return np.asarray(shares / shares.sum(), dtype=np.float64)


def _gpu_shares(scenario: Scenario) -> np.ndarray:
    shares = np.array([g.fleet_share for g in GPUS])
    if scenario.big_node_share is not None:
        big = np.array([g.vram_gb >= 80 for g in GPUS])
        shares[big] *= scenario.big_node_share / shares[big].sum()
        shares[~big] *= (1 - scenario.big_node_share) / shares[~big].sum()
    return np.asarray(shares / shares.sum(), dtype=np.float64)


def _draw_warm(vram: float, need_gb: np.ndarray, shares: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Models a node has loaded when the simulation starts: drawn by demand, as many as fit."""
    fits = np.flatnonzero(need_gb <= vram)
    warm, used = [], 0.0
    for i in rng.choice(fits, size=len(fits), replace=False, p=shares[fits] / shares[fits].sum()):
        if used + need_gb[i] <= vram:
            warm.append(int(i))
            used += float(need_gb[i])
    return warm


def make_fleet(scenario: Scenario, need_gb: np.ndarray) -> Fleet:
    """A generated fleet; `need_gb` is each model's VRAM need (the catalog's min_vram_gb)."""
    rng = np.random.default_rng(scenario.seed)
    n = scenario.nodes
    kinds = rng.choice(len(GPUS), size=n, p=_gpu_shares(scenario))
    regions = rng.choice(len(REGIONS), size=n, p=CALLER_WEIGHTS)
    jitter = rng.uniform(0.8, 1.25, size=n)
    shares = model_shares(scenario)
    gpus = [GPUS[k] for k in kinds]
    return Fleet.at_rest(
        gpu=[g.name for g in gpus],
        vram_gb=[g.vram_gb for g in gpus],
        tflops=[g.tflops for g in gpus],
        hourly_rate=np.round(np.array([g.usd_per_hour for g in gpus]) * jitter, 2),
        region=regions,
        max_concurrency=[g.slots for g in gpus],
        bandwidth_gb_s=[g.bandwidth_gb_s for g in gpus],
        # Drawn even for a cold fleet, so that the rest of the fleet is the same.
        warm=[
            [] if scenario.cold else w for w in (_draw_warm(g.vram_gb, need_gb, shares, rng) for g in gpus)
        ],
        heartbeat_phase=rng.uniform(0, 1, size=n),
    )


def fleet_from_specs(specs: list[Any]) -> Fleet:
    """A fleet from a fleet file's nodes (neuralgrid.admin.fleet.NodeSpec): their GPUs, prices,
    slots and loaded models; memory bandwidth from the GPU table (times gpu_count)."""
    known = {region: i for i, region in enumerate(REGIONS)}
    unknown = sorted({s.region for s in specs} - known.keys())
    if unknown:
        raise ValueError(f"the simulator knows regions {', '.join(REGIONS)}; not {', '.join(unknown)}")
    names = [s.gpu_model.removeprefix("NVIDIA ").removeprefix("GeForce ") for s in specs]
    gpus = sorted(set(names) - GPU_BY_NAME.keys())
    if gpus:
        raise ValueError(f"the simulator knows GPUs {', '.join(GPU_BY_NAME)}; not {', '.join(gpus)}")
    return Fleet.at_rest(
        gpu=names,
        vram_gb=[s.vram_gb for s in specs],
        tflops=[s.tflops for s in specs],
        hourly_rate=[s.hourly_rate for s in specs],
        region=[known[s.region] for s in specs],
        max_concurrency=[s.max_concurrency for s in specs],
        bandwidth_gb_s=[
            GPU_BY_NAME[g].bandwidth_gb_s * s.gpu_count for g, s in zip(names, specs, strict=True)
        ],
        warm=[[MODEL_IDS.index(m) for m in s.models if m in MODEL_IDS] for s in specs],
        heartbeat_phase=np.random.default_rng(0).uniform(0, 1, size=len(specs)),
        online=[s.status == "online" for s in specs],
    )


Request = tuple[float, int, int, int, int]  # arrival time, model index, caller region, prompt, output


def read_trace(path: Path) -> list[Request]:
    """A request trace: CSV with header `time_s,model,region,prompt_tokens,output_tokens`."""
    out = []
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                out.append(
                    (
                        float(row["time_s"]),
                        MODEL_IDS.index(row["model"]),
                        REGIONS.index(row["region"]),
                        int(row["prompt_tokens"]),
                        int(row["output_tokens"]),
                    )
                )
            except (KeyError, ValueError, TypeError) as err:
                raise ValueError(
                    f"{path}:{line}: expected time_s,model,region,prompt_tokens,output_tokens"
                    f" with a model of {MODEL_IDS} and a known region ({err})"
                ) from err
    return sorted(out)


def _bursty_intensity(scenario: Scenario) -> tuple[np.ndarray, np.ndarray]:
    """Bursty: the rate times `burst_factor` (3) for one minute in five (a cumulative intensity per
    request/s)."""
    edges = np.append(np.arange(0.0, scenario.duration_s, 60.0), scenario.duration_s)
    factor = np.where(scenario.bursty & (edges[:-1] % 300 < 60), scenario.burst_factor, 1.0)
    return edges, np.concatenate([[0.0], np.cumsum(factor * np.diff(edges))])


def poisson_times(times: np.ndarray, cum: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrivals of a Poisson process with cumulative intensity `rate` x `cum` at `times`: a unit-rate
    process mapped through it. The same draws serve every rate, so a higher rate adds requests
    without reshuffling the others (the load sweep compares rates on common random numbers)."""
    total = rate * float(cum[-1])
    units = np.cumsum(rng.exponential(1.0, int(total + 10 * np.sqrt(total) + 20)))
    while units[-1] < total:
        units = np.concatenate([units, units[-1] + np.cumsum(rng.exponential(1.0, len(units)))])
    return np.asarray(np.interp(units[units < total] / rate, cum, times))


def make_workload(scenario: Scenario) -> list[Request]:
    """The requests, in time order. Each stream (the trace's conversation and code, else one) has
    its own random generators for arrivals and for each attribute, drawn in arrival order."""
    streams: list[tuple[tuple[np.ndarray, np.ndarray], float, traces.TraceShape | None]] = []
    if scenario.arrivals == "azure":
        for i, trace in enumerate(traces.SHAPES):
            rng = np.random.default_rng([scenario.seed, 150 + i])
            streams.append(
                (traces.intensity(trace, scenario.duration_s, rng), scenario.rps * trace.share, trace)
            )
    else:
        streams.append((_bursty_intensity(scenario), scenario.rps, None))
    embed = np.array([m.kv_bytes_per_token == 0 for m in MODELS])
    parts = []
    for i, ((times, cum), rate, shape) in enumerate(streams):
        arrivals, models, callers, prompts, outputs = (
            np.random.default_rng([scenario.seed, 100 + i, k]) for k in range(5)
        )
        at = poisson_times(times, cum, rate, arrivals)
        n = len(at)
        model = models.choice(len(MODELS), size=n, p=model_shares(scenario))
        caller = callers.choice(len(REGIONS), size=n, p=CALLER_WEIGHTS)
        if shape is None:
            prompt = np.minimum(8000, prompts.lognormal(np.log(400), 0.6, n)).astype(np.int64)
            output = np.minimum(2000, outputs.lognormal(np.log(200), 0.7, n)).astype(np.int64)
        else:
            prompt = traces.draw_lengths(shape.prompt_tokens, prompts, n)
            output = traces.draw_lengths(shape.output_tokens, outputs, n)
        is_embed = embed[model]
        prompt = np.where(is_embed, np.minimum(prompt // 2, 512), prompt)  # bge reads at most 512 tokens
        output = np.where(is_embed, 0, output)
        parts.append(np.column_stack([at, model, caller, np.maximum(1, prompt), output]))
    rows = np.concatenate(parts)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    return [(float(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows]


@dataclass(frozen=True)
class Loss:
    """A churn event: at t, some node is lost (silently or by a crash); it returns after rejoin_s."""

    t: float
    silent: bool
    busy: bool  # picked among busy nodes
    pick: float  # a uniform draw that picks the node
    rejoin_s: float

    def strikes(self, candidates: np.ndarray, inflight: np.ndarray) -> int:
        """The node lost among `candidates` (node indices; `inflight`: every node's running
        requests): by `pick`, weighted by running requests when the loss picks a busy node."""
        weights = inflight[candidates].astype(np.float64)
        if self.busy and weights.sum() > 0:
            cumulative = np.cumsum(weights) / weights.sum()
            return int(candidates[min(int(np.searchsorted(cumulative, self.pick)), len(candidates) - 1)])
        return int(candidates[min(int(self.pick * len(candidates)), len(candidates) - 1)])


def make_losses(scenario: Scenario, nodes: int) -> list[Loss]:
    rng = np.random.default_rng(scenario.seed + 200)
    rate = scenario.churn_per_hour * nodes / 3600
    times = list(rng.random(rng.poisson(rate * scenario.duration_s)) * scenario.duration_s) if rate else []
    storm = round(scenario.storm_share * nodes)
    times += list(scenario.storm_start_s + rng.random(storm) * scenario.storm_window_s)
    return [
        Loss(
            float(t),
            bool(rng.random() < scenario.silent_share),
            bool(rng.random() < scenario.busy_bias),
            float(rng.random()),
            float(rng.exponential(scenario.rejoin_mean_s)),
        )
        for t in sorted(times)
    ]


def with_overrides(scenario: Scenario, **overrides: Any) -> Scenario:
    """The scenario with the given fields replaced (None leaves a field as it is)."""
    return replace(scenario, **{k: v for k, v in overrides.items() if v is not None})
