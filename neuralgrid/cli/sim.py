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
    scenario: Annotated[
        str,
        typer.Option(
            envvar="NEURALGRID_SIM_SCENARIO",
            help="default, scarce-big, scarce-burst, churn-storm, trace, or all (with the scarce-big load"
            " sweep and the scarcity study).",
        ),
    ] = "default",
    fleet_file: Annotated[
        Path | None,
        typer.Option("--fleet", envvar="NEURALGRID_SIM_FLEET", help="A fleet file (else the scenario's)."),
    ] = None,
    nodes: Annotated[
        int | None, typer.Option(envvar="NEURALGRID_SIM_NODES", help="Generated fleet size.", min=1)
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(envvar="NEURALGRID_SIM_TRACE", help="CSV of requests (else generated).")
    ] = None,
    rps: Annotated[
        float | None, typer.Option(envvar="NEURALGRID_SIM_RPS", help="Mean requests per second.", min=0.01)
    ] = None,
    duration: Annotated[
        float | None, typer.Option(envvar="NEURALGRID_SIM_DURATION", help="Seconds simulated.", min=1)
    ] = None,
    churn: Annotated[
        float | None,
        typer.Option(envvar="NEURALGRID_SIM_CHURN", help="Share of nodes lost per hour.", min=0),
    ] = None,
    poisson: Annotated[bool, typer.Option(envvar="NEURALGRID_SIM_POISSON", help="No bursts.")] = False,
    policies: Annotated[
        str, typer.Option(envvar="NEURALGRID_SIM_POLICIES", help="Comma-separated policies.")
    ] = (
        "seed,seed_warm,balanced,balanced+prewarm,balanced+prewarm+weight-only,round_robin,least_loaded,random"
    ),
    seed: Annotated[
        int | None, typer.Option(envvar="NEURALGRID_SIM_SEED", help="Same seed, same results.")
    ] = None,
    sweep: Annotated[
        bool,
        typer.Option(
            envvar="NEURALGRID_SIM_SWEEP",
            help="Run scarce-big's load sweep and the scarcity study (with scarce-big or scarce-burst).",
        ),
    ] = True,
    out_dir: Annotated[
        Path, typer.Option("--out", envvar="NEURALGRID_SIM_OUT", help="Report directory.")
    ] = Path("sim-results"),
    show_progress: Annotated[
        bool, typer.Option("--progress", envvar="NEURALGRID_SIM_PROGRESS", help="Show a progress bar.")
    ] = False,
    batching: Annotated[
        Path | None,
        typer.Option(
            envvar="NEURALGRID_SIM_BATCHING",
            help="A measured batching curve (bench calibrate's JSON) instead of the analytic one.",
        ),
    ] = None,
) -> None:
    """Simulate the fleet under each matching policy; write a markdown report, JSON and PNG plots.

    One scenario or all; options given override the scenario's own settings."""
    from rich.progress import Progress, TaskID

    from neuralgrid.admin import fleet
    from neuralgrid.db.errors import DatabaseError
    from neuralgrid.sim import scarcity
    from neuralgrid.sim.report import World, run_scenario, seconds, sweep_big_model, write_report
    from neuralgrid.sim.scenarios import SCENARIOS, fleet_from_specs, read_trace, with_overrides

    if scenario != "all" and scenario not in SCENARIOS:
        raise fail(f"unknown scenario {scenario!r}: choose from {', '.join(SCENARIOS)} or all")
    try:
        custom_fleet = None if fleet_file is None else fleet_from_specs(fleet.read_fleet(fleet_file))
        workload = None if trace is None else read_trace(trace)
    except (OSError, ValueError, DatabaseError) as err:
        raise fail(str(err)) from err
    scenarios = [
        with_overrides(
            s,
            nodes=len(custom_fleet) if custom_fleet else nodes,
            rps=rps,
            duration_s=max(duration or s.duration_s, workload[-1][0]) if workload else duration,
            churn_per_hour=churn,
            arrivals="poisson" if poisson else None,
            seed=seed,
        )
        for name, s in SCENARIOS.items()
        if scenario in (name, "all")
    ]
    names = [p.strip() for p in policies.split(",") if p.strip()]
    with database(ctx) as conn:
        try:
            world = World.load(conn, batching)
        except (OSError, ValueError) as err:  # an unreadable batching file
            raise fail(str(err)) from err
    try:
        world.check(names)
    except ValueError as err:
        raise fail(str(err)) from err
    runs, swept = [], None
    with Progress(console=Console(stderr=True), disable=not show_progress) as bar:
        for s in scenarios:
            tasks = {p: bar.add_task(f"{s.name}: {p}", total=s.duration_s) for p in names}

            def advance(policy: str, t: float, tasks: dict[str, TaskID] = tasks) -> None:
                if policy in tasks:
                    bar.update(tasks[policy], completed=t)

            runs.append(run_scenario(world, s, names, advance, custom_fleet, workload))
            if s.name == "scarce-big" and sweep and workload is None:
                task = bar.add_task("scarce-big: load sweep", total=None)
                swept = sweep_big_model(world, s, names, fleet=custom_fleet)
                bar.update(task, total=1, completed=1)
    cells = []
    if sweep and workload is None and any(s.heavy_factor for s in scenarios):
        with Progress(console=Console(stderr=True), disable=not show_progress) as bar:
            task = bar.add_task("scarcity study", total=None)
            cells = scarcity.study(world, scenarios, names, fleet=custom_fleet)
            bar.update(task, total=1, completed=1)
    sections = {"scarcity": (scarcity.lines(cells), scarcity.as_json(cells))} if cells else {}
    data = write_report(runs, out_dir, swept, world.batching, sections)
    for name, result in data["scenarios"].items():
        table = Table(
            "policy", "served %", "70B %", "p95 s", "supply $/1M tok", "cold %", "VRAM idle GB", title=name
        )
        for s in result["policies"].values():
            table.add_row(
                s["policy"],
                f"{s['served_pct']:.2f}",
                f"{s['big_model_served_pct']:.2f}",
                seconds(s["p95_s"]),
                f"{s['supply_usd_per_mtok']:.4f}",
                f"{s['cold_start_pct']:.2f}",
                f"{s['vram_idle_gb_mean']:.1f}",
            )
        out.print(table)
        for goal in result["goals"]:
            out.print(f"{'met   ' if goal['met'] else 'MISSED'} {goal['goal']}: {goal['detail']}")
    if "sweep" in data:
        at = data["sweep"]
        out.print(
            f"load sweep: seed serves {at['target_pct']:g}% of 70B requests at {at['rps']:.1f} requests/s;"
            " there: " + ", ".join(f"{p} {s['big_model_served_pct']:.1f}%" for p, s in at["policies"].items())
        )
    if cells:
        table = Table(
            "scenario", "load", "policy", "70B %", "ceiling %", "served %", "8B / 7B %", "supply $/1M tok",
            "VRAM idle GB", "p95 s", title="scarcity",
        )  # fmt: skip
        scarcity.table(cells, table.add_row)
        out.print(table)
        for goal, met, detail in scarcity.goals(cells):
            out.print(f"{'met   ' if met else 'MISSED'} {goal}: {detail}")
    out.print(f"wrote {out_dir / 'report.md'}")
