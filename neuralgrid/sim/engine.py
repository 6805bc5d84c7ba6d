"""A discrete-event simulation of a heterogeneous fleet serving a mixed workload under one policy.

The performance model (every constant and its source is in physics.py; docs/simulation.md walks
through it):
- a request holds one of the node's slots from its claim to its last token;
- a model not loaded on the node is loaded first (weights / disk bandwidth + init), evicting models
  no request is using; requests for a model still loading wait for it, and the node reports the
  model loaded to the scorer only once it is;
- prefill is bound by compute, decode by memory bandwidth: all streams decoding on a GPU share each
  step, which reads the weights once plus each stream's KV cache, so a step serves the whole batch;
- the network adds two round trips by region (connection and request, answer);
- the platform: a request that finds every capable node busy waits in a per-model line (30 s, 256
  deep); a failed attempt fails over to the next free node not yet tried (3 fallbacks), and cools its
  node down (5 s, doubling);
- churn: a crashed node resets its connections at once; a silently lost node holds its requests,
  and takes new ones (each failing at the connect timeout), until the sweeper marks it offline,
  3 missed 5 s heartbeats after its last one. Either way the scorer sees it online, with its models
  warm, until then. A lost node comes back later, cold.

What a policy is charged: supply cost, the slot-seconds it used x the node's hourly rate / slots
(what the capacity used costs its owners). What the developer pays is the catalog's per-token
price, the same whichever node serves, so the bill per 1M tokens differs between policies only
through which requests they serve.

This module is the event loop and the platform's rules; the rest is in its neighbours: the fleet,
workload and churn in scenarios.py, the constants in physics.py, ranking in policies.py, pre-warm in
prewarm.py, a request's state in inflight.py, and what a run measured in result.py.
"""

from __future__ import annotations

import copy
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from neuralgrid.sim import physics
from neuralgrid.sim.inflight import Placement, Req
from neuralgrid.sim.physics import MODELS, REGIONS, Batching, Platform
from neuralgrid.sim.policies import FleetArrays, VramPressure, Weights, placement_order
from neuralgrid.sim.prewarm import Job, Prewarm, PrewarmSettings
from neuralgrid.sim.result import Result
from neuralgrid.sim.scenarios import (
    MODEL_IDS,
    Fleet,
    Request,
    Scenario,
    make_fleet,
    make_losses,
    make_workload,
)

__all__ = ["BASELINES", "REGIONS", "CatalogModel", "Scenario", "Simulation"]

BASELINES = ("seed", "seed_warm", "round_robin", "least_loaded", "random")


@dataclass(frozen=True)
class CatalogModel:
    """A model as public.models describes it."""

    min_vram_gb: float
    cold_start_s: float
    tokens_per_s_per_tflop: float | None  # None: an embedding model (no decode)
    input_usd_per_mtok: float = 0.0
    output_usd_per_mtok: float = 0.0


# Event kinds, in the heap as small ints.
ARRIVE, PREFILLED, DECODED, LOADED, EXPIRE, LOSE, DETECT, JOIN, ATTEMPT_FAILED, SWEEP = range(10)


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        policy: str,
        weights: Weights | None,
        catalog: dict[str, CatalogModel],
        fleet: Fleet | None = None,
        workload: list[Request] | None = None,
        platform: Platform | None = None,
        batching: Batching | None = None,
        prewarm: PrewarmSettings | None = None,
    ) -> None:
        """`policy` is a baseline (BASELINES) or a matching_policies row, whose `weights` rank;
        with `prewarm` (enabled), idle nodes pre-load models in demand as the platform asks them."""
        if policy not in BASELINES and weights is None:
            raise ValueError(f"policy {policy!r} is no baseline and has no weights")
        self.scenario, self.policy, self.weights, self.catalog = scenario, policy, weights, catalog
        self.platform = platform or Platform()
        self.batching = batching
        self.need = np.array([catalog[m].min_vram_gb for m in MODEL_IDS])
        # Every policy runs on its own copy: a run changes the fleet's state as it goes.
        built = copy.deepcopy(fleet) if fleet is not None else make_fleet(scenario, self.need)
        self.heartbeat_phase = built.heartbeat_phase  # each node's, as a share of the interval
        self.fleet: FleetArrays = built.arrays
        self.gpu = built.gpu
        self.workload = make_workload(scenario) if workload is None else workload
        self.end = max(scenario.duration_s, self.workload[-1][0] if self.workload else 0.0)
        self.losses = make_losses(scenario, len(built))
        self.pick_rng = np.random.default_rng(scenario.seed + 2)
        n, m = len(built), len(MODELS)
        f = self.fleet
        self.holds = f.vram_gb[None, :] >= self.need[:, None]  # every node can load what fits
        self.load_s = np.array([physics.load_s(s.weight_gb) for s in MODELS])
        bw = built.bandwidth_gb_s
        self.weights_s = np.array([[physics.weights_s(s.weight_gb, b) for b in bw] for s in MODELS])
        self.flops_s = np.array(
            [
                [physics.stream_cost_s(s.params_b, 0, b, t) for b, t in zip(bw, f.tflops, strict=True)]
                for s in MODELS
            ]
        )
        self.kv_s_per_byte = 1 / (bw * 1e9 * physics.BANDWIDTH_EFFICIENCY)
        # Node state. `resident` (loading or loaded) and `ready` (loaded: what the scorer sees).
        self.alive = np.ones(n, dtype=bool)  # the truth; fleet.online is what the platform knows
        self.silent = np.zeros(n, dtype=bool)
        self.epoch = [0] * n  # bumped when a node is lost: its pending events no longer apply
        self.models_on: list[dict[int, float]] = [{} for _ in range(n)]  # model -> ready at, LRU order
        self.resident = np.zeros((m, n), dtype=bool)
        self.ready = np.zeros((m, n), dtype=bool)
        self.users = np.zeros((m, n), dtype=np.int64)
        self.resident_gb = np.zeros(n)
        self.busy_gb = np.zeros(n)  # VRAM of models some request is using: what cannot be evicted
        self.running: list[dict[int, Req]] = [{} for _ in range(n)]
        self.waiting_load: list[dict[int, list[Req]]] = [{} for _ in range(n)]
        self.decoding: list[list[Req]] = [[] for _ in range(n)]
        self.decode_since = np.zeros(n)
        self.step_s = np.zeros(n)
        self.decode_version = [0] * n
        self.cool_until = np.zeros(n)
        self.consecutive_failures = np.zeros(n, dtype=np.int64)
        self.online_since = np.zeros(n)
        for node, warm in enumerate(built.warm):
            for model in warm:
                self.models_on[node][model] = 0.0
                self.resident[model, node] = self.ready[model, node] = True
                self.resident_gb[node] += self.need[model]
        self.queues: list[deque[Req]] = [deque() for _ in range(m)]
        # The demand on each VRAM level, as the sweeper measures it every second (the reserve).
        self.pressure = VramPressure(self.need.tolist(), self.platform.reserve_window_s)
        self.prewarm = Prewarm(prewarm) if prewarm is not None and prewarm.enabled else None
        self.prewarmed: dict[tuple[int, int], float] = {}  # (node, model) -> pre-load started, unused yet
        self.placements: list[Placement] = []
        self.outcomes: dict[int, str] = {}  # request id -> served | failed, each exactly once
        self.rr = 0
        self.result = Result(policy)
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()

    # The event loop.

    def push(self, t: float, kind: int, data: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, data))

    def run(self, progress: Callable[[float], None] | None = None) -> Result:
        """Run to the end; `progress(simulated_seconds)` is called each simulated 10 s, if given."""
        for rid, request in enumerate(self.workload):
            shape = MODELS[request[1]]
            kv = shape.kv_bytes_per_token * (request[3] + request[4] / 2)
            self.push(request[0], ARRIVE, Req(rid, request, kv))
        for i, loss in enumerate(self.losses):
            self.push(loss.t, LOSE, i)
        end = self.end
        if self.prewarm is not None or (self.weights is not None and self.weights.reserve > 0):
            self.push(0.0, SWEEP, None)
        handlers: dict[int, Callable[[float, Any], None]] = {
            ARRIVE: self._arrive,
            PREFILLED: self._prefilled,
            DECODED: self._decoded,
            LOADED: self._loaded,
            EXPIRE: self._expire,
            LOSE: self._lose,
            DETECT: self._detect,
            JOIN: self._join,
            ATTEMPT_FAILED: self._attempt_failed,
            SWEEP: self._sweep,
        }
        reported = 0.0
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            if kind == JOIN and t > end:
                continue  # nodes coming back after the end change nothing
            if progress is not None and t - reported >= 10:
                progress(min(t, end))
                reported = t
            handlers[kind](t, data)
        for node in range(len(self.gpu)):
            if self.fleet.online[node]:
                self._slot_time(node, max(0.0, end - self.online_since[node]))
        return self.result

    def _sweep(self, t: float, _: Any) -> None:
        """Each second: the sweeper's refresh_vram_pressure() (running and waiting jobs by VRAM need,
        against the slots), and the pre-warm asks of the nodes that heartbeat in that second."""
        needs = [float(self.need[req.model]) for running in self.running for req in running.values()]
        lines = self.queues if self.platform.waiting_demand else []
        waiting = [float(self.need[m]) for m, queue in enumerate(lines) for _ in queue]
        self.pressure.refresh(t, needs, self.fleet, waiting)
        if self.prewarm is not None:
            self._prewarm(t)
        if t + self.platform.sweep_interval_s <= self.end:
            self.push(t + self.platform.sweep_interval_s, SWEEP, None)

    def _prewarm(self, t: float) -> None:
        f, pw = self.fleet, self.prewarm
        assert pw is not None
        if pw.due(t):
            warm: dict[tuple[int, int], int] = {}
            usable = f.online & (self.cool_until <= t)
            for model, node in zip(*np.nonzero(self.ready & usable[None, :]), strict=True):
                key = (int(model), int(f.region[node]))
                warm[key] = warm.get(key, 0) + int(f.max_concurrency[node])
            pw.refresh(t, warm)
        # The nodes whose heartbeat fell in the last second, idle and with no load under way.
        interval, step = self.platform.heartbeat_interval_s, self.platform.sweep_interval_s
        beat = ((t / interval - self.heartbeat_phase) % 1.0) * interval < step
        idle = beat & f.online & self.alive & (f.inflight == 0) & (self.cool_until <= t)
        for node in np.flatnonzero(idle).tolist():
            models = self.models_on[node]
            if any(ready_at > t for ready_at in models.values()):
                continue
            can_load = {int(m) for m in np.flatnonzero(self.holds[:, node] & ~self.resident[:, node])}
            model = pw.pick(t, int(f.region[node]), can_load)
            if model is not None and self._load(node, model, t) is not None:
                self.result.prewarm_loads += 1
                self.prewarmed[(int(node), model)] = t

    def _prewarm_ended(self, node: int, model: int, t: float, used: bool) -> None:
        """A pre-loaded model was used, evicted or lost: the VRAM it held unused until then."""
        started = self.prewarmed.pop((node, model), None)
        if started is not None:
            self.result.prewarm_unused_gb_s += float(self.need[model]) * (min(t, self.end) - started)
            self.result.prewarm_used += used

    # Placing a request.

    def choose(self, req: Req, t: float, wait: bool = True) -> int | None:
        """The node the policy gives the request, or None when no capable node can take it now;
        while it may `wait` (place_job's p_wait), not a node kept for bigger jobs."""
        f, model = self.fleet, req.model
        need = float(self.need[model])
        # What claim_node() checks (online, a free slot, not cooling down), and that the model is
        # loaded there or fits beside the models in use (a node cannot evict a model it is serving).
        ok = (
            f.online
            & (f.inflight < f.max_concurrency)
            & (self.cool_until <= t)
            & self.holds[model]
            & (self.resident[model] | (self.busy_gb + need <= f.vram_gb))
        )
        if req.tried:
            ok[list(req.tried)] = False
        if not ok.any():
            return None
        if self.policy not in ("round_robin", "least_loaded", "random"):
            # The one place the SQL policies rank (the numpy twin of score_nodes() and place()).
            kept_gb = self.pressure.kept_level(need, self.platform.reserve_threshold)
            order = placement_order(
                self.policy, self.weights, f, need, self.holds[model], self.ready[model], req.caller,
                self.pressure.pairs(), kept_gb, wait,
            )  # fmt: skip
            hits = order[ok[order]]
            return int(hits[0]) if len(hits) else None
        candidates = np.flatnonzero(ok)
        if self.policy == "random":
            return int(self.pick_rng.choice(candidates))
        if self.policy == "least_loaded":
            load = f.inflight[candidates] / f.max_concurrency[candidates]
            return int(candidates[np.argmin(load)])
        self.rr = (self.rr + 1) % len(f.online)  # round_robin over the capable nodes
        after = candidates[candidates >= self.rr]
        return int(after[0] if len(after) else candidates[0])

    def _arrive(self, t: float, req: Req) -> None:
        node = self.choose(req, t)
        if node is not None:
            self._claim(node, req, t)
            return
        capable = (self.fleet.online & self.holds[req.model]).any()
        queue = self.queues[req.model]
        if req.attempt > 1 or not capable or len(queue) >= self.platform.queue_max_waiting:
            # failover_job() finds no free candidate, or place_job() has nothing to wait for.
            if self.prewarm is not None and req.attempt == 1:  # a refused job: unmet demand
                self.prewarm.record(Job(req.model, req.caller, t, True, ended=t))
            self._end(req, "failed", lost=req.attempt > 1)
            return
        req.state = "queued"
        queue.append(req)
        self.push(req.arrival + self.platform.queue_timeout_s, EXPIRE, req)

    def _expire(self, t: float, req: Req) -> None:
        if req.state == "queued":  # the gateway's last ask, which may take a node kept for others
            self.queues[req.model].remove(req)
            node = self.choose(req, t, wait=False)
            self._claim(node, req, t) if node is not None else self._end(req, "failed")

    def _retry_queued(self, t: float, node: int) -> None:
        """A slot freed on `node` (or it came online): waiting requests ask again, oldest first."""
        if not any(self.queues):
            return
        for model in np.flatnonzero(self.holds[:, node]):
            queue = self.queues[model]
            while queue:
                node_for = self.choose(queue[0], t)
                if node_for is None:
                    break
                self._claim(node_for, queue.popleft(), t)

    def _claim(self, node: int, req: Req, t: float) -> None:
        f, model = self.fleet, req.model
        f.inflight[node] += 1
        req.node, req.claimed, req.tried = node, t, req.tried | {node}
        self.running[node][req.id] = req
        req.placement = Placement(node, float(self.need[model]), t)
        self.placements.append(req.placement)
        if not self.alive[node]:
            # The platform does not know yet: a crashed node refuses the connection at once, a
            # silent one lets it time out.
            req.state = "doomed"
            delay = self.platform.connect_timeout_s if self.silent[node] else 0.0
            self.push(t + delay, ATTEMPT_FAILED, (req, req.attempt))
            return
        self.result.vram_idle_gb.append(float(f.vram_gb[node] - self.need[model]))
        if self.users[model, node] == 0:
            self.busy_gb[node] += self.need[model]
        self.users[model, node] += 1
        models = self.models_on[node]
        self._prewarm_ended(node, model, t, used=True)
        if self.prewarm is not None:
            cold = model not in models or models[model] > t
            req.job = self.prewarm.record(Job(model, req.caller, t, cold))
        ready_at = models.pop(model) if model in models else self._load(node, model, t)
        if ready_at is None:
            raise AssertionError("choose() gave a node the model does not fit on")
        models[model] = ready_at  # most recently used last
        if ready_at > t:
            req.state, req.waited_load = "loading", True
            self.waiting_load[node].setdefault(model, []).append(req)
        else:
            self._prefill(node, req, t)

    def _load(self, node: int, model: int, t: float) -> float | None:
        """Start loading `model` on `node`, evicting the least recently used models no request is
        using; None if it does not fit. The node serves it, and reports it loaded, from the time
        returned. (A request starts a load here; pre-warming can start one without a request.)"""
        models, vram = self.models_on[node], float(self.fleet.vram_gb[node])
        if model in models:
            return models[model]
        for other in list(models):
            if self.resident_gb[node] + self.need[model] <= vram:
                break
            if self.users[other, node] == 0:
                self._prewarm_ended(node, other, t, used=False)
                del models[other]
                self.resident[other, node] = self.ready[other, node] = False
                self.resident_gb[node] -= self.need[other]
        if self.resident_gb[node] + self.need[model] > vram:
            return None
        ready_at = t + float(self.load_s[model])
        models[model] = ready_at
        self.resident[model, node] = True
        self.resident_gb[node] += self.need[model]
        self.result.loads += 1
        self.push(ready_at, LOADED, (node, model, ready_at, self.epoch[node]))
        return ready_at

    def _loaded(self, t: float, data: tuple[int, int, float, int]) -> None:
        node, model, ready_at, epoch = data
        if epoch != self.epoch[node] or self.models_on[node].get(model) != ready_at:
            return  # the node was lost, or the model evicted, meanwhile
        self.ready[model, node] = True
        for req in self.waiting_load[node].pop(model, []):
            if req.state == "loading":
                self._prefill(node, req, t)

    # Serving: prefill, then decode steps shared by every stream on the GPU.

    def _prefill(self, node: int, req: Req, t: float) -> None:
        req.state = "prefill"
        shape = MODELS[req.model]
        done = t + physics.prefill_s(shape.params_b, req.prompt, float(self.fleet.tflops[node]))
        self.push(done, PREFILLED, (req, req.attempt))

    def _prefilled(self, t: float, data: tuple[Req, int]) -> None:
        req, attempt = data
        if req.state != "prefill" or attempt != req.attempt:
            return  # the node was lost meanwhile
        self.result.ttfts.append(
            t - req.arrival + 2 * physics.rtt_s(req.caller, int(self.fleet.region[req.node]))
        )
        if req.output == 0:  # an embedding: done
            self._finish(req, t)
            return
        node = req.node
        self._advance(node, t)
        req.state, req.left = "decode", float(req.output)
        self.decoding[node].append(req)
        self._reschedule(node, t)

    def _step(self, node: int) -> float:
        """One decode step on `node`: each model's weights read once, plus each stream's KV cache
        and FLOPs. A measured batching curve, when there is one, sets the per-stream slowdown."""
        streams = self.decoding[node]
        weights = sum(float(self.weights_s[m, node]) for m in {r.model for r in streams})
        per_stream = [
            float(self.flops_s[r.model, node] + r.kv_bytes * self.kv_s_per_byte[node]) for r in streams
        ]
        if self.batching is None:
            return weights + sum(per_stream)
        return (weights + sum(per_stream) / len(streams)) / self.batching.rel(len(streams))

    def _advance(self, node: int, t: float) -> None:
        """Count the tokens decoded on `node` since the last change."""
        streams = self.decoding[node]
        if streams:
            steps = (t - self.decode_since[node]) / self.step_s[node]
            for r in streams:
                r.left -= steps
        self.decode_since[node] = t

    def _reschedule(self, node: int, t: float) -> None:
        self.decode_version[node] += 1
        streams = self.decoding[node]
        if not streams:
            return
        self.step_s[node] = self._step(node)
        first = min(r.left for r in streams)
        self.push(t + max(first, 0.0) * self.step_s[node], DECODED, (node, self.decode_version[node]))

    def _decoded(self, t: float, data: tuple[int, int]) -> None:
        node, version = data
        if version != self.decode_version[node]:
            return
        self._advance(node, t)
        done = [r for r in self.decoding[node] if r.left <= 1e-6]
        self.decoding[node] = [r for r in self.decoding[node] if r.left > 1e-6]
        self._reschedule(node, t)
        for req in done:
            self._finish(req, t)

    def _finish(self, req: Req, t: float) -> None:
        node = req.node
        f, model = self.fleet, req.model
        cat = self.catalog[MODEL_IDS[model]]
        self.result.latencies.append(t - req.arrival + 2 * physics.rtt_s(req.caller, int(f.region[node])))
        self.result.tokens += req.prompt + req.output
        self.result.bill_usd += (
            req.prompt * cat.input_usd_per_mtok + req.output * cat.output_usd_per_mtok
        ) / 1e6
        self.result.load_waits += req.waited_load
        f.successes[node] += 1
        self.consecutive_failures[node] = 0
        self._bill_slot(req, t)
        self._release(req, t)
        self._end(req, "served")
        self._retry_queued(t, node)

    # Slots and outcomes.

    def _bill_slot(self, req: Req, until: float) -> None:
        """The slot-seconds a request held on a live node: their supply cost and utilization."""
        node, f = req.node, self.fleet
        seconds = max(0.0, until - req.claimed)
        self.result.supply_usd += float(f.hourly_rate[node]) * seconds / 3600 / int(f.max_concurrency[node])
        gpu = self.gpu[node]
        self.result.busy_slot_s[gpu] = self.result.busy_slot_s.get(gpu, 0.0) + seconds

    def _release(self, req: Req, t: float) -> None:
        node, model = req.node, req.model
        self.fleet.inflight[node] -= 1
        del self.running[node][req.id]
        if req.placement is not None:
            req.placement.end = t
        if req.job is not None:
            req.job.ended = t
        if req.state != "doomed":
            self.users[model, node] -= 1
            if self.users[model, node] == 0:
                self.busy_gb[node] -= self.need[model]

    def _end(self, req: Req, outcome: str, lost: bool = False) -> None:
        if req.id in self.outcomes:
            raise AssertionError(f"request {req.id} ended twice")
        self.outcomes[req.id] = outcome
        req.state = outcome
        name = MODEL_IDS[req.model]
        counts = self.result.served_by_model if outcome == "served" else self.result.failed_by_model
        counts[name] = counts.get(name, 0) + 1
        if outcome == "failed":
            if lost:
                self.result.lost += 1
            else:
                self.result.refused += 1

    def _fail(self, req: Req, t: float) -> None:
        """An attempt failed because its node is gone: cool the node down, fail over."""
        node = req.node
        self._release(req, t)
        self.fleet.failures[node] += 1
        self.consecutive_failures[node] += 1
        cooldown = self.platform.cooldown_s(int(self.consecutive_failures[node]))
        self.cool_until[node] = max(self.cool_until[node], t + cooldown)
        if req.attempt > self.platform.fallbacks:
            self._end(req, "failed", lost=True)
            return
        self.result.retries += 1
        req.attempt += 1
        req.state = "retry"
        self.push(t, ARRIVE, req)

    def _attempt_failed(self, t: float, data: tuple[Req, int]) -> None:
        req, attempt = data
        if req.state == "doomed" and attempt == req.attempt:  # else the sweeper was first
            self._fail(req, t)

    # Churn.

    def _lose(self, t: float, index: int) -> None:
        loss = self.losses[index]
        candidates = np.flatnonzero(self.alive & self.fleet.online)
        if not len(candidates):
            return
        node = loss.strikes(candidates, self.fleet.inflight)
        self.alive[node], self.silent[node] = False, loss.silent
        self.epoch[node] += 1  # its loads stop here
        self.decoding[node] = []
        self.decode_version[node] += 1
        for req in list(self.running[node].values()):
            if req.state != "doomed":
                self._bill_slot(req, t)
                self._doom(req)
        if not loss.silent:  # a crash resets the connections: every request fails over now
            for req in list(self.running[node].values()):
                self._fail(req, t)
        detected = self.platform.offline_at(t, float(self.heartbeat_phase[node]))
        self.push(max(detected, t), DETECT, (node, loss.rejoin_s))

    def _doom(self, req: Req) -> None:
        """The node under a request is gone: it holds nothing more and waits to fail."""
        node, model = req.node, req.model
        self.users[model, node] -= 1
        if self.users[model, node] == 0:
            self.busy_gb[node] -= self.need[model]
        req.state = "doomed"

    def _detect(self, t: float, data: tuple[int, float]) -> None:
        node, rejoin_s = data
        self.fleet.online[node] = False
        self._slot_time(node, min(t, self.end) - self.online_since[node])
        for req in list(self.running[node].values()):
            self._fail(req, t)
        for model in list(self.models_on[node]):  # it comes back cold
            self._prewarm_ended(node, model, t, used=False)
            self.resident[model, node] = self.ready[model, node] = False
        self.models_on[node] = {}
        self.waiting_load[node] = {}
        self.resident_gb[node] = self.busy_gb[node] = 0.0
        self.push(t + rejoin_s, JOIN, node)

    def _join(self, t: float, node: int) -> None:
        self.alive[node], self.silent[node] = True, False
        self.fleet.online[node] = True
        self.online_since[node] = t
        self.cool_until[node], self.consecutive_failures[node] = 0.0, 0
        self._retry_queued(t, node)

    def _slot_time(self, node: int, seconds: float) -> None:
        gpu = self.gpu[node]
        self.result.slot_s[gpu] = self.result.slot_s.get(gpu, 0.0) + seconds * int(
            self.fleet.max_concurrency[node]
        )
