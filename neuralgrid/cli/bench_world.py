"""`neuralgrid bench world` and `neuralgrid bench chaos`: gateways far from their database on one
machine, measured (issue 42's proof) and put through faults under load. Commands of the `bench`
group, kept apart from cli/bench.py for their length."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from neuralgrid.cli.common import OutFile, database_url, friendly_errors, out, progress, report


def _rtts(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError as err:
        raise typer.BadParameter(f"comma-separated milliseconds ({err})") from err
    if min(values) <= 0:
        raise typer.BadParameter("every RTT must be positive")
    return values


def _ms(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


@friendly_errors
def bench_world(
    ctx: typer.Context,
    rtts: Annotated[
        str,
        typer.Option(
            envvar="NEURALGRID_BENCH_RTTS", help="Far gateways' RTTs to Postgres, ms, comma-separated."
        ),
    ] = "5,80,200",
    requests: Annotated[
        int,
        typer.Option(
            envvar="NEURALGRID_BENCH_REQUESTS",
            help="Steady-state whole answers (and streams) per gateway.",
            min=1,
        ),
    ] = 30,
    warmup: Annotated[
        int, typer.Option(help="Requests (of each kind) per gateway before counting.", min=0)
    ] = 5,
    cold: Annotated[
        int, typer.Option(help="Cold whole answers (and streams) per gateway, a model each.", min=1)
    ] = 10,
    timeout_s: Annotated[
        float,
        typer.Option(help="How long a revocation or a node's death may take to reach a gateway.", min=1),
    ] = 10.0,
    quick: Annotated[
        bool, typer.Option("--quick", help="A few requests of each kind: to see that it runs.")
    ] = False,
    out_file: OutFile = Path("bench-results/world.json"),
) -> None:
    """Gateways at 5, 80 and 200 ms from Postgres (delay proxies) beside one next to it: what each
    adds to a whole answer and a stream's first byte, steady and cold; how long a revocation and a
    node's death take to reach each."""
    from neuralgrid.bench import LEDGER_HISTORY
    from neuralgrid.bench import world as bench

    if quick:
        requests, warmup, cold = min(requests, 4), min(warmup, 2), 1
    results = bench.run(
        database_url(ctx),
        _rtts(rtts),
        requests,
        warmup,
        cold,
        timeout_s,
        history=1_000 if quick else LEDGER_HISTORY,
        progress=progress,
    )
    table = Table(
        "gateway",
        "link",
        "whole p50",
        "added",
        "first byte p50",
        "added",
        "cold whole",
        "added",
        "cold first byte",
        "added",
        "revoked: refused",
        "dead node: avoided",
        caption="ms, medians; link: a `select 1` over the gateway's link to Postgres; added: over the"
        " gateway next to the database, in ms (RTTs); revoked: after the revocation, the first request"
        " refused (and all after it); dead node: after the kill, the"
        " first of 3 answers in a row from the other node at the first attempt",
    )
    for r in results:
        cells = [r["gateway"], _ms(r["link_rtt_ms"], 2)]
        for prefix in ("", "cold_"):
            for name in ("whole", "first_byte"):
                cells.append(_ms(r[f"{prefix}{name}_p50_ms"]))
                added, rtt = r[f"{prefix}{name}_added_ms"], r[f"{prefix}{name}_added_rtt"]
                cells.append("" if not r["rtt_ms"] else f"{_ms(added)} ({_ms(rtt, 2)})")
        cells += [_ms(r["revoked_refused_ms"]), _ms(r["dead_node_avoided_ms"])]
        table.add_row(*cells)
    failed = sum(r["failed"] + r["cold_failed"] for r in results)
    if failed:
        out.print(f"[yellow]{failed} request(s) failed in the steady or cold rounds (not counted)[/]")
    report(table, out_file, "world", results, units="ms", target=bench.TARGET)


@friendly_errors
def bench_chaos(
    rtts: Annotated[
        str,
        typer.Option(
            envvar="NEURALGRID_BENCH_RTTS", help="Far gateways' RTTs to Postgres, ms, comma-separated."
        ),
    ] = "5,80,200",
    callers: Annotated[
        int, typer.Option(help="Concurrent callers, spread 1:2:3:… over the gateways.", min=2)
    ] = 50,
    seconds: Annotated[
        float,
        typer.Option(
            help="How long the load lasts (shares counted from 10% to 35%, faults at 35% and 65%).", min=1
        ),
    ] = 100.0,
    work_ms: Annotated[float, typer.Option(help="Each answer's time on its node.", min=0)] = 200.0,
    nodes: Annotated[int, typer.Option(help="Nodes of the default 4 slots, on two fake nodes.", min=1)] = 4,
    budget_callers: Annotated[
        int, typer.Option(help="Callers (of all) with the small-budget key.", min=1)
    ] = 8,
    budget_usd: Annotated[float, typer.Option(help="That key's budget.", min=0.0001)] = 0.002,
    overspend_usd: Annotated[float, typer.Option(help="The overspend the check allows.", min=0)] = 0.0,
    restart_s: Annotated[
        float, typer.Option(help="Seconds before the killed gateway is started again.", min=0)
    ] = 5.0,
    settle_s: Annotated[float, typer.Option(help="Rest after the load before the checks.", min=0)] = 60.0,
    out_file: OutFile = Path("bench-results/chaos.json"),
) -> None:
    """Correctness under load through faults (issue 42): callers over the gateways of `bench world`,
    one gateway killed (SIGKILL) and started again, Postgres crash-restarted (a cluster of its own);
    then slots, budget overspend, running jobs, slots at rest, the ledger and demand shares checked.
    Exits 1 when a check fails."""
    from neuralgrid.bench import world_chaos as bench

    if budget_callers >= callers:
        raise typer.BadParameter("--budget-callers must leave callers with the unlimited key")
    checks, seen = bench.run(
        _rtts(rtts),
        callers,
        seconds,
        work_ms,
        nodes,
        budget_callers,
        budget_usd,
        overspend_usd,
        restart_s,
        settle_s,
        progress=progress,
    )
    table = Table(
        "check", "", "numbers", caption=f"answers by status: {seen['statuses']}; killed: {seen['killed']}"
    )
    for c in checks:
        numbers = {k: v for k, v in c.items() if k not in ("check", "passed", "gateways")}
        if "gateways" in c:
            numbers |= {name: f"{g['share']:.3f}/{g['fair']:.3f}" for name, g in c["gateways"].items()}
        table.add_row(
            c["check"], "pass" if c["passed"] else "FAIL", ", ".join(f"{k} {v}" for k, v in numbers.items())
        )
    report(table, out_file, "chaos", checks, seen=seen, target=bench.TARGET)
    failed = [c["check"] for c in checks if not c["passed"]]
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("world")(bench_world)
    app.command("chaos")(bench_chaos)
