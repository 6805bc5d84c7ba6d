"""The scarcity study (issue 43): where 80 GB nodes are few and a 70B model only they can hold, does
a policy keep them for it?

For each scenario that names a heavy load (`Scenario.heavy_factor` times its rate), at its own rate
(moderate) and at the heavy one, every policy runs twice on the same requests: the whole workload, and its 70B
requests alone. The second is the policy's ceiling, what the 80 GB nodes serve of the 70B requests
when nothing else competes for them; the gap between the two is what small jobs on big nodes cost
the 70B requests. Reported per policy: 70B served and its ceiling, served overall and for the 7B and
8B models, supply cost per 1M tokens, VRAM idle per placement and p95.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from neuralgrid.sim.physics import BIG_MODEL, LLAMA_8B, MISTRAL_7B
from neuralgrid.sim.report import WEIGHT_ONLY, Progress, World, platform_default, run_policies, seconds
from neuralgrid.sim.scenarios import MODEL_IDS, Fleet, Scenario, make_workload, with_overrides

SMALL_MODELS = (LLAMA_8B, MISTRAL_7B)
GAP_PTS = 2.0  # the target: 70B served within this many points of the policy's ceiling


@dataclass(frozen=True)
class Cell:
    """One policy at one load of one scenario."""

    scenario: str
    load: str  # moderate | heavy
    rps: float
    policy: str
    big_pct: float
    ceiling_pct: float
    served_pct: float
    small_pct: dict[str, float]
    supply_usd_per_mtok: float
    vram_idle_gb: float
    p95_s: float | None


def study(
    world: World,
    scenarios: list[Scenario],
    policies: list[str],
    progress: Progress = lambda policy, t: None,
    fleet: Fleet | None = None,
) -> list[Cell]:
    """Every policy at each load of each scenario that names a heavy one, and at its ceiling."""
    big = MODEL_IDS.index(BIG_MODEL)
    cells = []
    for scenario in scenarios:
        if scenario.heavy_factor is None:
            continue
        for load, rps in (("moderate", scenario.rps), ("heavy", scenario.rps * scenario.heavy_factor)):
            at = with_overrides(scenario, rps=rps)
            workload = make_workload(at)
            alone = [r for r in workload if r[1] == big]
            full = run_policies(world, at, policies, progress, fleet, workload)
            ceiling = run_policies(world, at, policies, progress, fleet, alone)
            for result, solo in zip(full, ceiling, strict=True):
                s = result.summary()
                by_model = s["served_pct_by_model"]
                cells.append(
                    Cell(
                        scenario.name,
                        load,
                        rps,
                        result.policy,
                        s["big_model_served_pct"],
                        solo.summary()["big_model_served_pct"],
                        s["served_pct"],
                        {m: by_model[m] for m in SMALL_MODELS if m in by_model},
                        s["supply_usd_per_mtok"],
                        s["vram_idle_gb_mean"],
                        s["p95_s"],
                    )
                )
    return cells


def goals(cells: list[Cell]) -> list[tuple[str, bool, str]]:
    """For the platform's default at every load: 70B served within GAP_PTS of its ceiling, and served
    overall no less than with the reserve as a weight only (the default before issue 43), if run."""
    out = []
    for scenario, load in dict.fromkeys((c.scenario, c.load) for c in cells):
        here = {c.policy: c for c in cells if (c.scenario, c.load) == (scenario, load)}
        name = platform_default({p: {} for p in here})
        if name not in here:
            continue
        cell = here[name]
        gap = cell.ceiling_pct - cell.big_pct
        out.append(
            (
                f"{scenario}, {load} ({cell.rps:g}/s): {name} serves 70B within {GAP_PTS:g} points"
                " of its ceiling",
                gap <= GAP_PTS,
                f"{cell.big_pct:.1f}% vs {cell.ceiling_pct:.1f}%",
            )
        )
        before = here.get(name + WEIGHT_ONLY)
        if before is not None:
            out.append(
                (
                    f"{scenario}, {load}: served overall at least as with the reserve a weight only",
                    cell.served_pct >= before.served_pct,
                    f"{cell.served_pct:.2f}% vs {before.served_pct:.2f}%",
                )
            )
    return out


COLUMNS = (
    "| scenario | load | policy | 70B served % | its ceiling % | served % | 8B / 7B served %"
    " | supply $/1M tok | VRAM idle GB | p95 s |"
)


def _small(cell: Cell) -> str:
    return " / ".join(f"{cell.small_pct[m]:.1f}" if m in cell.small_pct else "-" for m in SMALL_MODELS)


def lines(cells: list[Cell]) -> list[str]:
    """The report's section: the table, then the goals."""
    if not cells:
        return []
    rows = [
        f"| {c.scenario} | {c.load} ({c.rps:g}/s) | {c.policy} | {c.big_pct:.1f} | {c.ceiling_pct:.1f}"
        f" | {c.served_pct:.2f} | {_small(c)} | {c.supply_usd_per_mtok:.4f} | {c.vram_idle_gb:.1f}"
        f" | {seconds(c.p95_s)} |"
        for c in cells
    ]
    return [
        "## Scarcity: keeping the big nodes for what only they can serve",
        "",
        "Each policy on the whole workload and on its 70B requests alone (its ceiling: what the 80 GB"
        " nodes serve of them when nothing else competes), at the scenario's rate (moderate) and a"
        f" heavy one. `{WEIGHT_ONLY}`: the reserve as it was before issue 43, a weight on running jobs"
        " only, with no scarcity rule and the gateways' lines not counted.",
        "",
        COLUMNS,
        "| --- | --- | --- |" + " ---: |" * 7,
        *rows,
        "",
        *(f"- {'met' if ok else 'MISSED'}: {goal}: {detail}" for goal, ok, detail in goals(cells)),
        "",
    ]


def as_json(cells: list[Cell]) -> dict[str, Any]:
    return {
        "cells": [c.__dict__ for c in cells],
        "goals": [{"goal": g, "met": bool(ok), "detail": d} for g, ok, d in goals(cells)],
    }


def table(cells: list[Cell], add_row: Callable[..., object]) -> None:
    """The CLI's table, a row a cell."""
    for c in cells:
        add_row(
            c.scenario,
            f"{c.load} {c.rps:g}/s",
            c.policy,
            f"{c.big_pct:.1f}",
            f"{c.ceiling_pct:.1f}",
            f"{c.served_pct:.2f}",
            _small(c),
            f"{c.supply_usd_per_mtok:.4f}",
            f"{c.vram_idle_gb:.1f}",
            seconds(c.p95_s),
        )
