"""A discrete-event simulation of a heterogeneous fleet serving a mixed workload.

The performance model, kept simple on purpose (every constant is here):
- prefill takes 2 x params x prompt tokens FLOPs at 40% of the node's dense FP16 TFLOPS;
- decode runs at twice the catalog's `tokens_per_s_per_tflop` x TFLOPS for one stream (the catalog
  figure is a deliberate floor), slowed by 10% per other request sharing the GPU;
- a model not loaded on the node costs the catalog's cold start (10-30 s), then stays loaded
  (least recently used models are evicted when VRAM runs out);
- the network adds a round trip by region: 10 ms within, 40 ms within a continent, 150 ms across;
- a request costs one of the node's slots for its duration at the node's hourly rate (as complete_job()
  charges time-priced models);
- churn: each node leaves at `churn_per_hour` (owners reclaiming GPUs, crashes) for an exponential
  10 minutes; requests on it fail and are retried on the next node, up to 3 attempts.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from neuralgrid.sim.policies import FleetArrays, Weights, score

CONTINENT = {
    "us-east": "na",
    "us-west": "na",
    "eu-west": "eu",
    "eu-central": "eu",
    "ap-northeast": "as",
    "ap-southeast": "as",
    "ap-south": "as",
    "sa-east": "sa",
    "oceania": "oc",
    "af-south": "af",
}
REGIONS = list(CONTINENT)
CALLER_WEIGHTS = np.array([0.25, 0.15, 0.2, 0.1, 0.08, 0.06, 0.06, 0.04, 0.03, 0.03])
GPU_CLASSES = [  # model, VRAM GB, dense FP16 TFLOPS, USD/h, slots, share of the fleet
    ("RTX 3090", 24, 71, 0.20, 4, 0.22),
    ("RTX 4090", 24, 165, 0.35, 4, 0.28),
    ("A10", 24, 125, 0.60, 4, 0.1),
    ("L4", 24, 121, 0.45, 4, 0.1),
    ("A100 40GB", 40, 312, 1.10, 8, 0.1),
    ("A100 80GB", 80, 312, 1.50, 8, 0.12),
    ("H100 80GB", 80, 989, 2.50, 16, 0.08),
]
WORKLOAD = [  # model, billions of parameters, share of requests
    ("meta-llama/Llama-3.1-8B-Instruct", 8.0, 0.40),
    ("mistralai/Mistral-7B-Instruct-v0.3", 7.0, 0.15),
    ("Qwen/Qwen2.5-14B-Instruct", 14.0, 0.15),
    ("meta-llama/Llama-3.3-70B-Instruct-AWQ", 70.0, 0.10),
    ("BAAI/bge-large-en-v1.5", 0.335, 0.20),
]
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class CatalogModel:
    min_vram_gb: float
    cold_start_s: float
    tokens_per_s_per_tflop: float | None  # None: an embedding model (no decode)


@dataclass(frozen=True)
class Scenario:
    nodes: int = 200
    rps: float = 20.0
    duration_s: float = 600.0
    churn_per_hour: float = 0.10
    bursty: bool = True
    seed: int = 7


@dataclass
class Result:
    policy: str
    latencies: list[float] = field(default_factory=list)
    served: int = 0
    failed: int = 0
    cold_starts: int = 0
    retries: int = 0
    tokens: int = 0
    cost_usd: float = 0.0
    vram_wasted_gb: list[float] = field(default_factory=list)
    busy_slot_s: dict[str, float] = field(default_factory=dict)
    slot_s: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies) if self.latencies else np.array([np.nan])
        total = self.served + self.failed
        return {
            "policy": self.policy,
            "requests": total,
            "served": self.served,
            "failed": self.failed,
            "served_pct": round(100 * self.served / total, 3) if total else 0.0,
            "p50_s": round(float(np.nanpercentile(lat, 50)), 3),
            "p95_s": round(float(np.nanpercentile(lat, 95)), 3),
            "p99_s": round(float(np.nanpercentile(lat, 99)), 3),
            "cost_per_mtok_usd": round(1e6 * self.cost_usd / max(self.tokens, 1), 4),
            "cold_start_pct": round(100 * self.cold_starts / max(self.served, 1), 3),
            "retries": self.retries,
            "lost_to_churn": self.retries + self.failed,
            "vram_wasted_gb_mean": round(float(np.mean(self.vram_wasted_gb)), 2)
            if self.vram_wasted_gb
            else 0.0,
            "utilization_by_gpu": {
                g: round(self.busy_slot_s.get(g, 0.0) / s, 4) for g, s in self.slot_s.items() if s
            },
        }


def make_fleet(scenario: Scenario, rng: np.random.Generator) -> dict[str, Any]:
    shares = np.array([c[5] for c in GPU_CLASSES])
    kinds = rng.choice(len(GPU_CLASSES), size=scenario.nodes, p=shares / shares.sum())
    regions = rng.choice(len(REGIONS), size=scenario.nodes, p=CALLER_WEIGHTS)
    jitter = rng.uniform(0.8, 1.25, size=scenario.nodes)
    fleet = FleetArrays(
        vram_gb=np.array([GPU_CLASSES[k][1] for k in kinds], dtype=np.float64),
        tflops=np.array([GPU_CLASSES[k][2] for k in kinds], dtype=np.float64),
        hourly_rate=np.round(np.array([GPU_CLASSES[k][3] for k in kinds]) * jitter, 2),
        region=regions.astype(np.int64),
        inflight=np.zeros(scenario.nodes, dtype=np.int64),
        max_concurrency=np.array([GPU_CLASSES[k][4] for k in kinds], dtype=np.int64),
        successes=np.zeros(scenario.nodes),
        failures=np.zeros(scenario.nodes),
        online=np.ones(scenario.nodes, dtype=bool),
    )
    return {"arrays": fleet, "gpu": [GPU_CLASSES[k][0] for k in kinds]}


def fleet_from_specs(specs: list[Any]) -> dict[str, Any]:
    """A fleet from a fleet file's nodes (neuralgrid.admin.fleet.NodeSpec), instead of a generated one."""
    known = {region: i for i, region in enumerate(REGIONS)}
    unknown = sorted({s.region for s in specs} - known.keys())
    if unknown:
        raise ValueError(f"the simulator knows regions {', '.join(REGIONS)}; not {', '.join(unknown)}")
    return {
        "gpu": [s.gpu_model.removeprefix("NVIDIA ").removeprefix("GeForce ") for s in specs],
        "arrays": FleetArrays(
            vram_gb=np.array([s.vram_gb for s in specs], dtype=np.float64),
            tflops=np.array([s.tflops for s in specs], dtype=np.float64),
            hourly_rate=np.array([s.hourly_rate for s in specs], dtype=np.float64),
            region=np.array([known[s.region] for s in specs], dtype=np.int64),
            inflight=np.zeros(len(specs), dtype=np.int64),
            max_concurrency=np.array([s.max_concurrency for s in specs], dtype=np.int64),
            successes=np.zeros(len(specs)),
            failures=np.zeros(len(specs)),
            online=np.ones(len(specs), dtype=bool),
        ),
    }


def read_trace(path: Any) -> list[tuple[float, int, int, int, int]]:
    """A request trace: CSV with header `time_s,model,region,prompt_tokens,output_tokens`."""
    import csv

    models = [m for m, _, _ in WORKLOAD]
    out = []
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                out.append(
                    (
                        float(row["time_s"]),
                        models.index(row["model"]),
                        REGIONS.index(row["region"]),
                        int(row["prompt_tokens"]),
                        int(row["output_tokens"]),
                    )
                )
            except (KeyError, ValueError, TypeError) as err:
                raise ValueError(
                    f"{path}:{line}: expected time_s,model,region,prompt_tokens,output_tokens"
                    f" with a model of {models} and a known region ({err})"
                ) from err
    return sorted(out)


def make_workload(scenario: Scenario, rng: np.random.Generator) -> list[tuple[float, int, int, int, int]]:
    """(arrival time, model index, caller region, prompt tokens, output tokens), in time order."""
    t, out = 0.0, []
    shares = np.array([w[2] for w in WORKLOAD])
    while t < scenario.duration_s:
        # Bursty: the rate triples for one minute in five.
        rate = scenario.rps * (3.0 if scenario.bursty and (t % 300) < 60 else 1.0)
        t += rng.exponential(1.0 / rate)
        model = int(rng.choice(len(WORKLOAD), p=shares / shares.sum()))
        embed = WORKLOAD[model][0].startswith("BAAI")
        prompt = int(min(8000, rng.lognormal(np.log(200 if embed else 400), 0.6)))
        output = 0 if embed else int(min(2000, rng.lognormal(np.log(200), 0.7)))
        out.append((t, model, int(rng.choice(len(REGIONS), p=CALLER_WEIGHTS)), max(prompt, 1), output))
    return out


def rtt_s(a: int, b: int) -> float:
    if a == b:
        return 0.010
    return 0.040 if CONTINENT[REGIONS[a]] == CONTINENT[REGIONS[b]] else 0.150


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        policy: str,
        weights: Weights | None,
        catalog: dict[str, CatalogModel],
        fleet: dict[str, Any] | None = None,
        workload: list[tuple[float, int, int, int, int]] | None = None,
    ) -> None:
        self.scenario, self.policy, self.weights, self.catalog = scenario, policy, weights, catalog
        rng = np.random.default_rng(scenario.seed)  # the same fleet, workload and churn for every policy
        built = make_fleet(scenario, rng)  # always drawn, so the churn draws stay the same
        generated = make_workload(scenario, rng)
        built = fleet or built
        self.fleet: FleetArrays = built["arrays"]
        self.gpu: list[str] = built["gpu"]
        self.workload = generated if workload is None else workload
        self.outcomes: dict[int, str] = {}  # request id -> served | failed, each exactly once
        self.churn_rng = np.random.default_rng(scenario.seed + 1)
        self.pick_rng = np.random.default_rng(scenario.seed + 2)
        n = len(self.gpu)
        self.models = [m for m, _, _ in WORKLOAD]
        self.min_vram = np.array([catalog[m].min_vram_gb for m in self.models])
        self.holds = np.ones((len(self.models), n), dtype=bool)
        for i, need in enumerate(self.min_vram):
            self.holds[i] &= self.fleet.vram_gb >= need
        self.loaded: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]
        for node in range(n):  # each node starts with its most popular model that fits warm
            for i in range(len(self.models)):
                if self.holds[i, node]:
                    self.loaded[node][i] = None
                    break
        self.running: dict[int, dict[int, Any]] = {node: {} for node in range(n)}
        self.rr = 0
        self.result = Result(policy)
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()

    def push(self, t: float, kind: str, data: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, data))

    def run(self, progress: Any = None) -> Result:
        """Run to the end; `progress(simulated_seconds)` is called as time passes, if given."""
        for req_id, (t, *_rest) in enumerate(self.workload):
            self.push(t, "arrive", {"id": req_id, "start": t, "attempt": 1, "tried": set()})
        rate = self.scenario.churn_per_hour / 3600
        if rate > 0:
            for node in range(len(self.gpu)):
                self.push(float(self.churn_rng.exponential(1 / rate)), "leave", node)
        online_since = np.zeros(len(self.gpu))
        reported = 0.0
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            if progress is not None and t - reported >= 10:
                progress(min(t, self.scenario.duration_s))
                reported = t
            if t > self.scenario.duration_s * 2:
                break
            if kind == "arrive":
                self.arrive(t, data)
            elif kind == "done":
                self.done(t, data)
            elif kind == "leave":
                self._slot_time(data, t - online_since[data])
                self.leave(t, data)
            elif kind == "join":
                self.fleet.online[data] = True
                online_since[data] = t
                if rate > 0:
                    self.push(t + float(self.churn_rng.exponential(1 / rate)), "leave", data)
        end = self.scenario.duration_s
        for node in range(len(self.gpu)):
            if self.fleet.online[node]:
                self._slot_time(node, max(0.0, end - online_since[node]))
        return self.result

    def _slot_time(self, node: int, seconds: float) -> None:
        gpu = self.gpu[node]
        self.result.slot_s[gpu] = self.result.slot_s.get(gpu, 0.0) + seconds * int(
            self.fleet.max_concurrency[node]
        )

    def choose(self, model: int, caller: int, tried: set[int]) -> int | None:
        f = self.fleet
        if self.policy in ("seed", "balanced"):
            loaded = np.array([model in self.loaded[n] for n in range(len(self.loaded))])
            order, _ = score(
                self.policy, self.weights, f, float(self.min_vram[model]), self.holds[model], loaded, caller
            )
            for node in order:  # match_job claims the first candidate with a free slot
                if (
                    node not in tried
                    and f.inflight[node] < f.max_concurrency[node]
                    and self.holds[model, node]
                ):
                    return int(node)
            return None
        ok = f.online & self.holds[model] & (f.inflight < f.max_concurrency)
        ok[list(tried)] = False
        candidates = np.flatnonzero(ok)
        if not len(candidates):
            return None
        if self.policy == "random":
            return int(self.pick_rng.choice(candidates))
        if self.policy == "least_loaded":
            load = f.inflight[candidates] / f.max_concurrency[candidates]
            return int(candidates[np.argmin(load)])
        self.rr = (self.rr + 1) % len(f.online)  # round_robin over the capable nodes
        after = candidates[candidates >= self.rr]
        return int(after[0] if len(after) else candidates[0])

    def arrive(self, t: float, req: dict[str, Any]) -> None:
        _, model, caller, prompt, output = self.workload[req["id"]]
        node = self.choose(model, caller, req["tried"])
        if node is None:
            self._end(req["id"], "failed")
            return
        f, name = self.fleet, self.models[model]
        cat = self.catalog[name]
        params_b = WORKLOAD[model][1]
        cold = model not in self.loaded[node]
        if cold:
            self.result.cold_starts += 1
            self._load(node, model)
        else:
            self.loaded[node].move_to_end(model)
        sharing = int(f.inflight[node])
        f.inflight[node] += 1
        prefill = 2 * params_b * 1e9 * prompt / (f.tflops[node] * 1e12 * 0.4)
        decode = 0.0
        if cat.tokens_per_s_per_tflop:
            tps = 2 * cat.tokens_per_s_per_tflop * f.tflops[node] / (1 + 0.1 * sharing)
            decode = output / tps
        service = (cat.cold_start_s if cold else 0.0) + prefill + decode
        finish = t + 2 * rtt_s(caller, int(f.region[node])) + service
        req = {**req, "node": node, "service": service, "began": t}
        self.running[node][req["id"]] = req
        self.result.vram_wasted_gb.append(float(f.vram_gb[node] - self.min_vram[model]))
        self.push(finish, "done", req)

    def _end(self, request_id: int, outcome: str) -> None:
        if request_id in self.outcomes:
            raise AssertionError(f"request {request_id} ended twice")
        self.outcomes[request_id] = outcome
        if outcome == "served":
            self.result.served += 1
        else:
            self.result.failed += 1

    def _load(self, node: int, model: int) -> None:
        loaded = self.loaded[node]
        while (
            loaded and sum(self.min_vram[m] for m in loaded) + self.min_vram[model] > self.fleet.vram_gb[node]
        ):
            loaded.popitem(last=False)
        loaded[model] = None

    def done(self, t: float, req: dict[str, Any]) -> None:
        node = req["node"]
        if self.running[node].pop(req["id"], None) is None:
            return  # the node left while this ran; the request was retried
        f = self.fleet
        f.inflight[node] -= 1
        f.successes[node] += 1
        _, _, _, prompt, output = self.workload[req["id"]]
        self._end(req["id"], "served")
        self.result.latencies.append(t - req["start"])
        self.result.tokens += prompt + output
        self.result.cost_usd += (
            float(f.hourly_rate[node]) * req["service"] / 3600 / int(f.max_concurrency[node])
        )
        gpu = self.gpu[node]
        self.result.busy_slot_s[gpu] = self.result.busy_slot_s.get(gpu, 0.0) + req["service"]

    def leave(self, t: float, node: int) -> None:
        f = self.fleet
        f.online[node] = False
        f.inflight[node] = 0
        for req in self.running[node].values():  # the owner took the GPU back: retry elsewhere
            f.failures[node] += 1
            if req["attempt"] >= MAX_ATTEMPTS:
                self._end(req["id"], "failed")
                continue
            self.result.retries += 1
            self.push(t, "arrive", {**req, "attempt": req["attempt"] + 1, "tried": req["tried"] | {node}})
        self.running[node] = {}
        self.loaded[node].clear()  # a GPU that comes back comes back cold
        self.push(t + float(self.churn_rng.exponential(600)), "join", node)
