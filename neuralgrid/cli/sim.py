"""`neuralgrid simulate`: the fleet under each matching policy, in a discrete-event simulation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from neuralgrid.cli.common import database, fail, friendly_errors, out


@friendly_errors
def simulate(
    ctx: typer.Context,
    fleet_file: Annotated[
        Path | None,
        typer.Option("--fleet", envvar="NEURALGRID_SIM_FLEET", help="A fleet file (else --nodes)."),
    ] = None,
    nodes: Annotated[
        int, typer.Option(envvar="NEURALGRID_SIM_NODES", help="Generated fleet size.", min=1)
    ] = 200,
    trace: Annotated[
        Path | None, typer.Option(envvar="NEURALGRID_SIM_TRACE", help="CSV of requests (else --rps).")
    ] = None,
    rps: Annotated[
        float, typer.Option(envvar="NEURALGRID_SIM_RPS", help="Mean requests per second.", min=0.01)
    ] = 20,
    duration: Annotated[
        float, typer.Option(envvar="NEURALGRID_SIM_DURATION", help="Seconds simulated.", min=1)
    ] = 600,
    churn: Annotated[
        float, typer.Option(envvar="NEURALGRID_SIM_CHURN", help="Share of nodes leaving per hour.", min=0)
    ] = 0.10,
    poisson: Annotated[bool, typer.Option(envvar="NEURALGRID_SIM_POISSON", help="No bursts.")] = False,
    policies: Annotated[
        str, typer.Option(envvar="NEURALGRID_SIM_POLICIES", help="Comma-separated policies.")
    ] = "seed,balanced,round_robin,least_loaded,random",
    seed: Annotated[int, typer.Option(envvar="NEURALGRID_SIM_SEED", help="Same seed, same results.")] = 7,
    out_dir: Annotated[
        Path, typer.Option("--out", envvar="NEURALGRID_SIM_OUT", help="Report directory.")
    ] = Path("sim-results"),
    show_progress: Annotated[
        bool, typer.Option("--progress", envvar="NEURALGRID_SIM_PROGRESS", help="Show a progress bar.")
    ] = False,
) -> None:
    """Simulate the fleet under each policy; write a markdown report, JSON and PNG plots."""
    from rich.progress import Progress

    from neuralgrid.admin import fleet
    from neuralgrid.db.errors import DatabaseError
    from neuralgrid.sim.engine import Scenario, fleet_from_specs, read_trace
    from neuralgrid.sim.report import simulate as run
    from neuralgrid.sim.report import write_report

    try:
        custom_fleet = None if fleet_file is None else fleet_from_specs(fleet.read_fleet(fleet_file))
        workload = None if trace is None else read_trace(trace)
    except (OSError, ValueError, DatabaseError) as err:
        raise fail(str(err)) from err
    if workload:
        duration = max(duration, workload[-1][0])
    scenario = Scenario(
        nodes=len(custom_fleet["gpu"]) if custom_fleet else nodes,
        rps=rps,
        duration_s=duration,
        churn_per_hour=churn,
        bursty=not poisson,
        seed=seed,
    )
    names = [p.strip() for p in policies.split(",") if p.strip()]
    with database(ctx) as conn, Progress(console=Console(stderr=True), disable=not show_progress) as bar:
        tasks = {p: bar.add_task(p, total=scenario.duration_s) for p in names}

        def advance(policy: str, t: float) -> None:
            if policy in tasks:
                bar.update(tasks[policy], completed=t)

        try:
            results = run(conn, scenario, names, progress=advance, fleet=custom_fleet, workload=workload)
        except ValueError as err:
            raise fail(str(err)) from err
    data = write_report(results, scenario, out_dir)
    table = Table("policy", "served %", "p95 s", "$/1M tok", "cold %", "VRAM waste GB")
    for s in data["policies"].values():
        table.add_row(
            s["policy"],
            f"{s['served_pct']:.2f}",
            f"{s['p95_s']:.2f}",
            f"{s['cost_per_mtok_usd']:.4f}",
            f"{s['cold_start_pct']:.2f}",
            f"{s['vram_wasted_gb_mean']:.1f}",
        )
    out.print(table)
    for goal in data["goals"]:
        out.print(f"{'met   ' if goal['met'] else 'MISSED'} {goal['goal']}: {goal['detail']}")
    out.print(f"wrote {out_dir / 'report.md'}")
