"""Run every policy on each scenario, then write the report: markdown tables, goals, JSON, PNG plots.

Cost is compared as supply cost: the slot-seconds a policy used x the node's hourly rate / its slots,
per 1M tokens served (what the capacity used costs its owners). The developer's bill is the catalog's
per-token price, the same on every node, so it is equal between policies by construction; the report
shows it too.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt
import numpy as np
import psycopg

from neuralgrid.sim import physics
from neuralgrid.sim.engine import BASELINES, CatalogModel, Simulation
from neuralgrid.sim.physics import Batching, Platform, read_batching
from neuralgrid.sim.policies import Weights
from neuralgrid.sim.prewarm import PrewarmSettings
from neuralgrid.sim.result import Result
from neuralgrid.sim.scenarios import MODEL_IDS, Fleet, Request, Scenario, with_overrides

POLICIES = ("seed", "seed_warm", "balanced", "balanced+prewarm", "round_robin", "least_loaded", "random")
PREWARM = "+prewarm"  # a policy name's suffix: the platform's pre-warm runs too (as it does by default)
# A last suffix: the reserve as it was before issue 43, a weight on running jobs only (no scarcity
# rule, the gateways' lines not counted), for comparison.
WEIGHT_ONLY = "+weight-only"


def parse_policy(name: str) -> tuple[str, bool, bool]:
    """A policy name's matching policy, and whether pre-warm runs and the reserve is a weight only."""
    rest = name.removesuffix(WEIGHT_ONLY)
    policy = rest.removesuffix(PREWARM)
    return policy, policy != rest, rest != name


Progress = Callable[[str, float], None]


def load_catalog(conn: psycopg.Connection) -> tuple[dict[str, CatalogModel], dict[str, Weights]]:
    """The catalog and policy weights the simulator uses: the database's own, not copies."""
    models = set(MODEL_IDS)
    rows = conn.execute(
        "select id, min_vram_gb, cold_start_s, tokens_per_s_per_tflop, input_usd_per_mtok,"
        " output_usd_per_mtok from public.models where id = any(%s)",
        (list(models),),
    ).fetchall()
    catalog = {
        r[0]: CatalogModel(
            float(r[1]),
            float(r[2]),
            None if r[3] is None else float(r[3]),
            float(r[4] or 0),
            float(r[5] or 0),
        )
        for r in rows
    }
    missing = models - catalog.keys()
    if missing:
        raise ValueError(f"the catalog lacks {sorted(missing)}")
    weights = {
        r[0]: Weights(*(float(v) for v in r[1:]))
        for r in conn.execute(
            "select name, fit, compute, price, warm, capacity, reputation, proximity, compute_half_tflops,"
            " price_half_usd_per_tflop_hour, distance_half_km, reserve from public.matching_policies"
        ).fetchall()
    }
    return catalog, weights


def load_platform(conn: psycopg.Connection) -> tuple[Platform, PrewarmSettings]:
    """Heartbeats, cooldowns, the reserve's window and threshold, and pre-warm as the database sets
    them (one row of platform_settings); the gateway's settings at their defaults."""
    row = conn.execute(
        "select heartbeat_interval_s, missed_heartbeats_offline, cooldown_base_s, cooldown_max_s,"
        " reserve_window_s, reserve_threshold, prewarm_enabled, prewarm_window_s, prewarm_refresh_s,"
        " prewarm_interval_s, prewarm_busy_ratio from public.platform_settings"
    ).fetchone()
    if row is None:
        return Platform(), PrewarmSettings()
    heartbeat, missed, cooldown_base, cooldown_max, reserve_window, threshold, enabled, *prewarm = row
    platform = Platform(
        heartbeat_interval_s=float(heartbeat),
        missed_heartbeats_offline=int(missed),
        cooldown_base_s=float(cooldown_base),
        cooldown_max_s=float(cooldown_max),
        reserve_window_s=float(reserve_window),
        reserve_threshold=float(threshold),
    )
    return platform, PrewarmSettings(bool(enabled), *(float(v) for v in prewarm))


@dataclass
class World:
    """What every run reads from the database, once."""

    catalog: dict[str, CatalogModel]
    weights: dict[str, Weights]
    platform: Platform
    batching: Batching | None
    prewarm: PrewarmSettings

    @classmethod
    def load(cls, conn: psycopg.Connection, batching: Path | None = None) -> World:
        """`batching`: a measured batching curve (`neuralgrid bench calibrate`) to use in place of the
        analytic one. The one in neuralgrid/sim/data was measured on a 2-core CPU, where one stream
        already takes the whole machine: it is evidence about CPUs, not GPUs, so it is not the default."""
        catalog, weights = load_catalog(conn)
        curve = None if batching is None else read_batching(batching)
        if batching is not None and curve is None:
            raise ValueError(f"{batching}: no such batching file")
        platform, prewarm = load_platform(conn)
        return cls(catalog, weights, platform, curve, prewarm)

    def check(self, policies: list[str]) -> None:
        unknown = [
            p
            for p in policies
            if parse_policy(p)[0] not in BASELINES and parse_policy(p)[0] not in self.weights
        ]
        if unknown:
            raise ValueError(
                f"unknown policy {unknown[0]!r}: choose from {', '.join(POLICIES)} or a matching_policies row"
            )


def run_policies(
    world: World,
    scenario: Scenario,
    policies: list[str],
    progress: Progress = lambda policy, t: None,
    fleet: Fleet | None = None,
    workload: list[Request] | None = None,
) -> list[Result]:
    """Each policy on its own copy of the fleet (Simulation copies it), reported under its own name."""
    world.check(policies)
    results = []
    for name in policies:
        policy, prewarm, weight_only = parse_policy(name)
        platform = world.platform
        if weight_only:
            platform = replace(platform, reserve_threshold=None, waiting_demand=False)
        sim = Simulation(
            scenario,
            policy,
            None if policy in BASELINES else world.weights[policy],
            world.catalog,
            fleet=fleet,
            workload=workload,
            platform=platform,
            batching=world.batching,
            prewarm=world.prewarm if prewarm else None,
        )
        sim.result.policy = name
        results.append(sim.run(progress=partial(progress, name)))
        progress(name, sim.end)
    return results


def simulate(
    conn: psycopg.Connection,
    scenario: Scenario,
    policies: list[str],
    progress: Progress = lambda policy, t: None,
    fleet: Fleet | None = None,
    workload: list[Request] | None = None,
) -> list[Result]:
    return run_policies(World.load(conn), scenario, policies, progress, fleet, workload)


@dataclass
class Run:
    scenario: Scenario
    results: list[Result]
    seconds: float  # wall time


def run_scenario(
    world: World,
    scenario: Scenario,
    policies: list[str],
    progress: Progress = lambda policy, t: None,
    fleet: Fleet | None = None,
    workload: list[Request] | None = None,
) -> Run:
    start = time.perf_counter()
    results = run_policies(world, scenario, policies, progress, fleet, workload)
    return Run(scenario, results, time.perf_counter() - start)


@dataclass
class Sweep:
    """Where `seed` serves `target_pct` of big-model requests, and every policy there."""

    scenario: Scenario
    target_pct: float
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rps, seed's big-model served %)
    results: list[Result] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.scenario.rps


def sweep_big_model(
    world: World,
    scenario: Scenario,
    policies: list[str],
    target_pct: float = 90.0,
    steps: int = 6,
    progress: Progress = lambda policy, t: None,
    fleet: Fleet | None = None,
) -> Sweep:
    """Raise the request rate until `seed` serves less than `target_pct` of the big model's requests,
    bisect (in log rate) for the rate where it serves just `target_pct`, then run every policy there."""
    probes: dict[float, float] = {}

    def seed_at(rps: float) -> float:
        result = run_policies(world, with_overrides(scenario, rps=rps), ["seed"], progress, fleet)[0]
        probes[rps] = float(result.summary()["big_model_served_pct"])
        return probes[rps]

    lo, hi = scenario.rps, scenario.rps
    while seed_at(lo) < target_pct and lo > 0.5:
        lo /= 2
    hi = lo * 2
    while seed_at(hi) >= target_pct and hi < 5000:
        lo, hi = hi, hi * 2
    for _ in range(steps):
        mid = float(np.sqrt(lo * hi))
        if seed_at(mid) >= target_pct:
            lo = mid
        else:
            hi = mid
    at = with_overrides(scenario, rps=lo)
    return Sweep(at, target_pct, sorted(probes.items()), run_policies(world, at, policies, progress, fleet))


def platform_default(summaries: dict[str, dict[str, Any]]) -> str:
    """The row that stands for the platform as it runs by default: balanced, with pre-warm if run."""
    return "balanced" + PREWARM if "balanced" + PREWARM in summaries else "balanced"


def goals(summaries: dict[str, dict[str, Any]], scenario: Scenario) -> list[tuple[str, bool, str]]:
    """Issue 17's targets for the platform as it runs by default (balanced, with pre-warm), against
    the original system as it was described (seed, warm nodes first)."""
    out: list[tuple[str, bool, str]] = []
    name = platform_default(summaries)
    bal = summaries.get(name)
    if bal is None:
        return out
    base = summaries.get("seed_warm")
    if base is not None:
        saving = 1 - bal["supply_usd_per_mtok"] / base["supply_usd_per_mtok"]
        out.append(
            (
                f"{name}'s supply cost per 1M tokens >= 30% below seed_warm's",
                saving >= 0.30,
                f"{100 * saving:.1f}% below"
                f" (${bal['supply_usd_per_mtok']:.4f} vs ${base['supply_usd_per_mtok']:.4f})",
            )
        )
        out.append(
            (
                "at equal or better p95 latency",
                (bal["p95_s"] or math.inf) <= (base["p95_s"] or math.inf),
                f"p95 {seconds(bal['p95_s'])} s vs {seconds(base['p95_s'])} s",
            )
        )
        out.append(
            (
                "big-model requests served at least as well",
                bal["big_model_served_pct"] >= base["big_model_served_pct"],
                f"{bal['big_model_served_pct']:.2f}% vs {base['big_model_served_pct']:.2f}%",
            )
        )
    if scenario.name == "default":
        out.append(
            (
                "VRAM left idle per placement <= 15 GB",
                bal["vram_idle_gb_mean"] <= 15,
                f"{bal['vram_idle_gb_mean']:.1f} GB",
            )
        )
    out.append(("cold starts <= 1% of requests", bal["cold_start_pct"] <= 1, f"{bal['cold_start_pct']:.2f}%"))
    out.append(
        (
            f">= 99.9% served under {100 * scenario.churn_per_hour:.0f}% hourly churn"
            + (f" and a storm of {100 * scenario.storm_share:.0f}%" if scenario.storm_share else ""),
            bal["served_pct"] >= 99.9,
            f"{bal['served_pct']:.3f}%",
        )
    )
    return out


def sweep_goal(sweep: Sweep, summaries: dict[str, dict[str, Any]]) -> tuple[str, bool, str] | None:
    """At the load where seed serves 90% of big-model requests, the default serves >= 99.9%."""
    name = platform_default(summaries)
    if name not in summaries:
        return None
    pct = summaries[name]["big_model_served_pct"]
    return (
        f"{name} serves >= 99.9% of 70B requests where seed serves {sweep.target_pct:g}%",
        pct >= 99.9,
        f"{pct:.2f}% at {sweep.rps:.1f} requests/s",
    )


def model_description(batching: Batching | None) -> dict[str, Any]:
    return {
        "gpus": [asdict(g) for g in physics.GPUS],
        "models": [asdict(m) for m in physics.MODELS],
        "bandwidth_efficiency": physics.BANDWIDTH_EFFICIENCY,
        "mfu": physics.MFU,
        "load_gb_per_s": physics.LOAD_GB_PER_S,
        "init_s": physics.INIT_S,
        "rtt_s": physics.RTT_S,
        "batching": "analytic" if batching is None else f"measured on {batching.measured_on}",
    }


COLUMNS = (
    "| policy | served % | 70B served % | p50 s | p95 s | p99 s | TTFT p95 s | supply $/1M tok"
    " | bill $/1M tok | cold starts % | VRAM idle GB | retries | lost | refused |"
)


def seconds(value: float | None) -> str:
    """A latency for a table: '-' when nothing was served."""
    return "-" if value is None else f"{value:.2f}"


def _row(s: dict[str, Any]) -> str:
    return (
        f"| {s['policy']} | {s['served_pct']:.2f} | {s['big_model_served_pct']:.2f} | {seconds(s['p50_s'])}"
        f" | {seconds(s['p95_s'])} | {seconds(s['p99_s'])} | {seconds(s['ttft_p95_s'])}"
        f" | {s['supply_usd_per_mtok']:.4f}"
        f" | {s['bill_usd_per_mtok']:.4f} | {s['cold_start_pct']:.2f} | {s['vram_idle_gb_mean']:.1f}"
        f" | {s['retries']} | {s['lost_to_churn']} | {s['refused']} |"
    )


def _prewarm_lines(summaries: dict[str, dict[str, Any]], scenario: Scenario) -> list[str]:
    """What pre-warm did for `balanced`: cold starts avoided, and the VRAM it held unused."""
    off, on = summaries.get("balanced"), summaries.get("balanced+prewarm")
    if off is None or on is None:
        return []
    return [
        f"Pre-warm: {on['prewarm_loads']} pre-loads, {on['prewarm_used_pct']:.0f}% of them used before"
        f" eviction; cold starts {off['cold_start_pct']:.2f}% without it,"
        f" {on['cold_start_pct']:.2f}% with it;"
        f" VRAM held by pre-loaded models until first use {on['prewarm_unused_gb_s']:,.0f} GB-s"
        f" ({on['prewarm_unused_gb_s'] / scenario.duration_s:.1f} GB across the fleet on average).",
        "",
    ]


def write_report(
    runs: list[Run],
    out_dir: Path,
    sweep: Sweep | None = None,
    batching: Batching | None = None,
    sections: dict[str, tuple[list[str], Any]] | None = None,
) -> dict[str, Any]:
    """`sections`: more of the report by name (scarcity.py's), its markdown lines and its JSON."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"model": model_description(batching), "scenarios": {}}
    lines = [
        "# Matching policies, simulated",
        "",
        "Every policy on each scenario, on the same fleet, requests and churn events (each policy on its"
        " own copy of the fleet). The performance model and its sources are in"
        " [docs/simulation.md](../simulation.md) and neuralgrid/sim/physics.py; the batching curve is "
        + ("analytic." if batching is None else f"measured on {batching.measured_on}."),
        "",
        "Costs: **supply $/1M tok** is what a policy's placements cost the nodes' owners (slot-seconds"
        " used x hourly rate / slots, per 1M tokens served); policies are compared on it. **bill $/1M"
        " tok** is what developers pay, the catalog's per-token price, equal whichever node serves by"
        " construction (it moves only with which requests were served). 70B: the AWQ model only 80 GB"
        " nodes can serve. cold starts: served requests that waited for a model load. lost: requests"
        " failed over until no fallback was left; refused: no capable node, or none free within the"
        " 30 s queue.",
        "",
    ]
    for run in runs:
        scenario, name = run.scenario, run.scenario.name
        summaries = {r.policy: r.summary() for r in run.results}
        checks = goals(summaries, scenario)
        _plots(run.results, summaries, out_dir / name)
        data["scenarios"][name] = {
            "scenario": asdict(scenario),
            "wall_s": round(run.seconds, 1),
            "policies": summaries,
            "goals": [{"goal": g, "met": bool(ok), "detail": d} for g, ok, d in checks],
        }
        lines += [
            f"## {name}",
            "",
            (f"{scenario.description}. " if scenario.description else "")
            + f"{_describe(scenario)}; simulated in {run.seconds:.0f} s.",
            "",
            COLUMNS,
            "| --- |" + " ---: |" * 13,
            *(_row(s) for s in summaries.values()),
            "",
            *(f"- {'met' if ok else 'MISSED'}: {goal}: {detail}" for goal, ok, detail in checks),
            "",
            *_prewarm_lines(summaries, scenario),
            f"![latency CDF]({name}/latency_cdf.png)",
            "",
            f"![supply cost, cold starts, churn, VRAM, big model]({name}/summary.png)",
            "",
            f"![utilization by GPU class]({name}/utilization.png)",
            "",
        ]
    if sweep is not None:
        summaries = {r.policy: r.summary() for r in sweep.results}
        _sweep_plot(sweep, summaries, out_dir)
        data["sweep"] = {
            "scenario": sweep.scenario.name,
            "target_pct": sweep.target_pct,
            "rps": round(sweep.rps, 3),
            "probes": [{"rps": round(r, 3), "seed_big_model_served_pct": p} for r, p in sweep.probes],
            "policies": summaries,
            "goal": sweep_goal(sweep, summaries),
        }
        lines += [
            f"## Load sweep ({sweep.scenario.name})",
            "",
            f"The request rate raised until `seed` serves less than {sweep.target_pct:g}% of 70B requests,"
            f" then bisected: `seed` serves {sweep.target_pct:g}% of them at **{sweep.rps:.1f} requests/s**."
            " Every policy at that rate:",
            "",
            COLUMNS,
            "| --- |" + " ---: |" * 13,
            *(_row(s) for s in summaries.values()),
            "",
            *(
                f"- {'met' if met else 'MISSED'}: {goal}: {detail}"
                for goal, met, detail in filter(None, [sweep_goal(sweep, summaries)])
            ),
            "",
            "Probes (requests/s: seed's 70B served %): "
            + ", ".join(f"{r:.1f}: {p:.1f}%" for r, p in sweep.probes)
            + ".",
            "",
            "![big-model served % by rate](sweep.png)",
            "",
        ]
    for key, (more, value) in (sections or {}).items():
        lines += more
        data[key] = value
    (out_dir / "report.md").write_text("\n".join(lines))
    (out_dir / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    return data


def _describe(s: Scenario) -> str:
    arrivals = {"bursty": "bursty: x3 one minute in five", "azure": "the Azure trace's shape"}
    storm = f", {100 * s.storm_share:.0f}% more in a storm" if s.storm_share else ""
    return (
        f"{s.nodes} nodes, {s.rps:g} requests/s ({arrivals.get(s.arrivals, s.arrivals)}) for"
        f" {s.duration_s:g} s, {100 * s.churn_per_hour:g}% of nodes lost per hour{storm}"
        f" ({100 * s.silent_share:.0f}% silently, {100 * s.busy_bias:.0f}% picked among busy nodes),"
        f" seed {s.seed}"
    )


def _plots(results: list[Result], summaries: dict[str, dict[str, Any]], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        lat = np.sort(np.array(r.latencies))
        if len(lat):
            ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=r.policy)
    ax.set(xscale="log", xlabel="latency (s, log)", ylabel="share of served requests", title="Latency CDF")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "latency_cdf.png", dpi=110)
    plt.close(fig)

    names = list(summaries)
    panels = (
        ("supply_usd_per_mtok", "supply $ per 1M tokens"),
        ("cold_start_pct", "cold starts (%)"),
        ("retries", "retries after node loss"),
        ("vram_idle_gb_mean", "VRAM idle per placement (GB)"),
        ("big_model_served_pct", "70B requests served (%)"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(17, 3.6))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.bar(names, [summaries[n][key] for n in names], color="#3b82f6")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(out_dir / "summary.png", dpi=110)
    plt.close(fig)

    gpus = sorted({g for s in summaries.values() for g in s["utilization_by_gpu"]})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        ax.bar(
            np.arange(len(gpus)) + i * width,
            [summaries[n]["utilization_by_gpu"].get(g, 0) for g in gpus],
            width,
            label=n,
        )
    ax.set_xticks(np.arange(len(gpus)) + 0.4 - width / 2, gpus, rotation=30)
    ax.set(ylabel="busy share of slot time", title="Utilization by GPU class")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "utilization.png", dpi=110)
    plt.close(fig)


def _sweep_plot(sweep: Sweep, summaries: dict[str, dict[str, Any]], out_dir: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    rates, pcts = zip(*sweep.probes, strict=True) if sweep.probes else ((), ())
    left.plot(rates, pcts, "o-")
    left.axhline(sweep.target_pct, color="grey", linestyle="--")
    left.set(xscale="log", xlabel="requests/s (log)", ylabel="70B requests served (%)", title="seed, by rate")
    names = list(summaries)
    right.bar(names, [summaries[n]["big_model_served_pct"] for n in names], color="#3b82f6")
    right.set_title(f"70B requests served (%) at {sweep.rps:.1f} requests/s")
    right.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(out_dir / "sweep.png", dpi=110)
    plt.close(fig)
