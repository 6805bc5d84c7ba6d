"""Run every policy on one scenario, then write the report: a markdown table, goals, PNG plots."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt
import numpy as np
import psycopg

from neuralgrid.sim.engine import WORKLOAD, CatalogModel, Result, Scenario, Simulation
from neuralgrid.sim.policies import Weights

POLICIES = ("seed", "balanced", "round_robin", "least_loaded", "random")


def load_catalog(conn: psycopg.Connection) -> tuple[dict[str, CatalogModel], dict[str, Weights]]:
    """The catalog and policy weights the simulator uses: the database's own, not copies."""
    models = {m for m, _, _ in WORKLOAD}
    rows = conn.execute(
        "select id, min_vram_gb, cold_start_s, tokens_per_s_per_tflop from public.models where id = any(%s)",
        (list(models),),
    ).fetchall()
    catalog = {
        r[0]: CatalogModel(float(r[1]), float(r[2]), None if r[3] is None else float(r[3])) for r in rows
    }
    missing = models - catalog.keys()
    if missing:
        raise ValueError(f"the catalog lacks {sorted(missing)}")
    weights = {
        r[0]: Weights(*(float(v) for v in r[1:]))
        for r in conn.execute(
            "select name, fit, compute, price, warm, capacity, reputation, proximity, compute_half_tflops,"
            " price_half_usd_per_tflop_hour, distance_half_km from public.matching_policies"
        ).fetchall()
    }
    return catalog, weights


def simulate(
    conn: psycopg.Connection,
    scenario: Scenario,
    policies: list[str],
    progress: Callable[[str, float], None] = lambda policy, t: None,
    fleet: dict[str, Any] | None = None,
    workload: list[tuple[float, int, int, int, int]] | None = None,
) -> list[Result]:
    catalog, weights = load_catalog(conn)
    results = []
    for policy in policies:
        if policy not in POLICIES and policy not in weights:
            raise ValueError(
                f"unknown policy {policy!r}: choose from {', '.join(POLICIES)} or a matching_policies row"
            )
        sql_policy = "balanced" if policy in weights else policy
        sim = Simulation(scenario, sql_policy, weights.get(policy), catalog, fleet=fleet, workload=workload)
        results.append(sim.run(progress=lambda t, policy=policy: progress(policy, t)))
        progress(policy, scenario.duration_s)
    return results


def goals(summaries: dict[str, dict[str, Any]], churn_per_hour: float) -> list[tuple[str, bool, str]]:
    out: list[tuple[str, bool, str]] = []
    if "seed" in summaries and "balanced" in summaries:
        seed, bal = summaries["seed"], summaries["balanced"]
        saving = 1 - bal["cost_per_mtok_usd"] / seed["cost_per_mtok_usd"]
        out.append(
            (
                "balanced costs >= 30% less per 1M tokens than seed",
                saving >= 0.30,
                f"{100 * saving:.1f}% less"
                f" (${bal['cost_per_mtok_usd']:.4f} vs ${seed['cost_per_mtok_usd']:.4f})",
            )
        )
        out.append(
            (
                "at equal or better p95 latency",
                bal["p95_s"] <= seed["p95_s"],
                f"p95 {bal['p95_s']:.2f} s vs {seed['p95_s']:.2f} s",
            )
        )
    if "balanced" in summaries:
        bal = summaries["balanced"]
        out.append(
            ("cold starts <= 5% of requests", bal["cold_start_pct"] <= 5, f"{bal['cold_start_pct']:.2f}%")
        )
        out.append(
            (
                f">= 99.9% served under {100 * churn_per_hour:.0f}% hourly churn",
                bal["served_pct"] >= 99.9,
                f"{bal['served_pct']:.3f}%",
            )
        )
    return out


def write_report(results: list[Result], scenario: Scenario, out_dir: Path) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = {r.policy: r.summary() for r in results}
    checks = goals(summaries, scenario.churn_per_hour)
    _plots(results, summaries, out_dir)
    lines = [
        "# Matching policies, simulated",
        "",
        f"{scenario.nodes} nodes, {scenario.rps:g} requests/s"
        f" ({'bursty' if scenario.bursty else 'Poisson'}) for {scenario.duration_s:g} s,"
        f" {100 * scenario.churn_per_hour:.0f}% hourly churn, seed {scenario.seed}. "
        "The performance model is documented in neuralgrid/sim/engine.py.",
        "",
        "| policy | served % | p50 s | p95 s | p99 s | $ per 1M tokens | cold starts % | retries"
        " | VRAM wasted GB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summaries.values():
        lines.append(
            f"| {s['policy']} | {s['served_pct']:.2f} | {s['p50_s']:.2f} | {s['p95_s']:.2f}"
            f" | {s['p99_s']:.2f} | {s['cost_per_mtok_usd']:.4f} | {s['cold_start_pct']:.2f} | {s['retries']}"
            f" | {s['vram_wasted_gb_mean']:.1f} |"
        )
    lines += ["", "## Goals", ""]
    lines += [f"- {'met' if ok else 'MISSED'}: {goal}: {detail}" for goal, ok, detail in checks]
    lines += [
        "",
        "![latency CDF](latency_cdf.png)",
        "",
        "![cost, cold starts, failures, waste](summary.png)",
        "",
        "![utilization by GPU class](utilization.png)",
        "",
    ]
    (out_dir / "report.md").write_text("\n".join(lines))
    data = {
        "scenario": scenario.__dict__,
        "policies": summaries,
        "goals": [{"goal": g, "met": bool(ok), "detail": d} for g, ok, d in checks],
    }
    (out_dir / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    return data


def _plots(results: list[Result], summaries: dict[str, dict[str, Any]], out_dir: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        lat = np.sort(np.array(r.latencies))
        if len(lat):
            ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=r.policy)
    ax.set(xscale="log", xlabel="latency (s, log)", ylabel="share of requests", title="Latency CDF by policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "latency_cdf.png", dpi=110)
    plt.close(fig)

    names = list(summaries)
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.5))
    for ax, key, title in zip(
        axes,
        ("cost_per_mtok_usd", "cold_start_pct", "lost_to_churn", "vram_wasted_gb_mean"),
        ("$ per 1M tokens", "cold starts (%)", "attempts lost to churn", "VRAM wasted (GB)"),
        strict=True,
    ):
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
