"""`neuralgrid bench gateway` and `neuralgrid bench sql`: the request path, through the gateway's
processes and in its SQL alone. Commands of the `bench` group, kept apart from cli/bench.py for
their length."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from neuralgrid.cli.common import (
    OutFile,
    database_url,
    fail,
    friendly_errors,
    integers,
    out,
    print_table,
    progress,
    report,
)


@friendly_errors
def gateway(
    ctx: typer.Context,
    callers: Annotated[
        str, typer.Option(envvar="NEURALGRID_BENCH_CALLERS", help="Concurrent callers, comma-separated.")
    ] = "1,16,64",
    requests: Annotated[
        int,
        typer.Option(
            envvar="NEURALGRID_BENCH_REQUESTS", help="Requests per sequential case (x4 concurrent).", min=1
        ),
    ] = 500,
    paths: Annotated[
        str,
        typer.Option(
            envvar="NEURALGRID_BENCH_PATHS",
            help="Paths to measure besides direct, comma-separated: relay, relay_sql, agent, gateway,"
            " gateway_placed (leases off), gateway_agent, smg.",
        ),
    ] = "relay,relay_sql,agent,gateway,gateway_placed,gateway_agent,smg",
    warmup: Annotated[
        float | None,
        typer.Option(
            envvar="NEURALGRID_BENCH_WARMUP_S",
            help="Seconds of each round's load before it counts (leases follow a load at each renewal);"
            " 0.6 unless given.",
            min=0,
        ),
    ] = None,
    out_file: OutFile = Path("bench-results/gateway.json"),
) -> None:
    """Added latency, requests/s, refusals, queue wait and CPU per request (gateway, Postgres, node
    agent) of the gateway and of the node agent against the node they front (and a bare relay, alone
    and holding a slot in Postgres), at the default node settings: enough default-size nodes for the
    most callers. Beside them, in the same interleaved rounds on the same fake node: smg, SGLang's
    model gateway in Rust (dev extras), launched as `smg launch --worker-urls NODE --policy round_robin
    --disable-tokenizer-autoload --disable-load-monitoring --log-level warn`, on loopback only. Its
    process's CPU shows as "gateway cpu"; a second table gives ours over smg: the gateway's and the
    bare relay's added p50 and requests/s, and the gateway process's CPU per request. Without smg
    installed, one line says so and the other paths run. The JSON holds smg's version and flags."""
    from neuralgrid.bench import gateway as bench
    from neuralgrid.bench import peer

    chosen = tuple(part.strip() for part in paths.split(",") if part.strip())
    unknown = set(chosen) - set(bench.PATHS)
    if unknown:
        raise fail(f"--paths: unknown {', '.join(sorted(unknown))}; choose from {', '.join(bench.PATHS[1:])}")
    smg_asked = "smg" in chosen
    smg = peer.find_smg() if smg_asked else None
    if smg_asked and smg is None:
        out.print(peer.NOT_INSTALLED, markup=False, highlight=False, soft_wrap=True)
        chosen = tuple(name for name in chosen if name != "smg")
    results = bench.run(
        database_url(ctx),
        integers(callers, "--callers"),
        requests,
        progress=progress,
        paths=chosen,
        smg=smg,
        warmup_s=bench.WARMUP_S if warmup is None else warmup,
    )
    table = Table(
        "mode",
        "callers",
        "path",
        "slots",
        "p50",
        "p99",
        "+p50",
        "+p99",
        "req/s",
        "503",
        "failed",
        "wait p99",
        "gateway cpu",
        "postgres cpu",
        "agent cpu",
        caption="ms; +: added to the direct path; slots: of the nodes the gateway reaches (default size);"
        " wait: for a slot; cpu: per request served; gateway cpu on relay_sql and smg: the relay's, smg's",
    )

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for r in results:
        for path in bench.PATHS:
            if path not in r:
                continue
            p = r[path]
            prefix = bench.ADDED.get(path)
            added = (
                (None, None)
                if prefix is None
                else (r.get(f"{prefix}added_p50_ms"), r.get(f"{prefix}added_p99_ms"))
            )
            table.add_row(
                "stream" if r["stream"] else "plain",
                str(r["callers"]),
                path,
                str(p.get("slots", "-")),
                ms(p.get("p50_ms")),
                ms(p.get("p99_ms")),
                ms(added[0]),
                ms(added[1]),
                f"{p['rps']:,.0f}",
                str(p["refused_503"]),
                str(p["failed"]),
                ms(p["queue_wait_p99_ms"]) if "slots" in p else "-",
                ms(p.get("gateway_cpu_ms_per_request")),
                ms(p.get("postgres_cpu_ms_per_request")),
                ms(p.get("agent_cpu_ms_per_request")),
            )
    if any("leased_over_placed_postgres_cpu" in r for r in results):
        print_table(_leased_over_placed(results))
    if any("smg" in r for r in results):
        print_table(_over_smg(results))
    target = (
        "gateway: added <= 1 ms p50 and <= 5 ms p99 sequential; gateway and agent: added <= 1.5 ms p50"
        " sequential; 0 refused while callers <= slots; >= 1000 rps non-streaming; Postgres <= 0.7 ms"
        " CPU per request; agent: added <= 0.5 ms p50 and <= 0.3 ms CPU per request"
    )
    meta: dict[str, Any] = {}  # (write_report adds the date and the commit)
    if smg_asked:  # what was measured, or that it could not be
        meta["smg"] = (
            {"version": peer.version(smg), "launch": peer.flags(["NODE"])} if smg else {"version": None}
        )
    report(table, out_file, "gateway", results, units="ms", target=target, **meta)


def _over_smg(results: list[dict[str, Any]]) -> Table:
    """bench gateway's ratios: ours over smg, case by case."""
    from neuralgrid.bench import peer

    table = Table(
        "mode",
        "callers",
        "+p50 gateway/smg",
        "req/s gateway/smg",
        "cpu gateway/smg",
        "+p50 relay/smg",
        "req/s relay/smg",
        caption="ours over smg: +p50 added to the direct path (above 1: ours adds more); req/s (below 1:"
        " ours serves fewer); cpu per request of the gateway's process (Postgres's apart); relay: the"
        " bare Python relay, the floor; -: smg added nothing measurable (with many callers, a hop that"
        " pools its connections to the fake node can beat the direct path)",
    )

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for r in results:
        if "smg" in r:
            table.add_row(
                "stream" if r["stream"] else "plain",
                str(r["callers"]),
                *(x(r.get(key)) for key, _, _ in peer.RATIOS),
            )
    return table


def _leased_over_placed(results: list[dict[str, Any]]) -> Table:
    """bench gateway's ratios: the gateway over the same gateway with leases off, case by case."""
    table = Table(
        "mode",
        "callers",
        "postgres cpu",
        "gateway cpu",
        "req/s",
        caption="the gateway (leases on) over gateway_placed (leases off: every request placed and ended"
        " in SQL before its answer): cpu per request, requests/s",
    )
    for r in results:
        if "leased_over_placed_postgres_cpu" in r:
            table.add_row(
                "stream" if r["stream"] else "plain",
                str(r["callers"]),
                *(
                    f"{r[key]:.2f}x" if key in r else "-"
                    for key in (
                        "leased_over_placed_postgres_cpu",
                        "leased_over_placed_gateway_cpu",
                        "leased_over_placed_rps",
                    )
                ),
            )
    return table


@friendly_errors
def sql(
    ctx: typer.Context,
    groups: Annotated[
        str,
        typer.Option(envvar="NEURALGRID_BENCH_GROUPS", help="Requests per group, comma-separated (1-16)."),
    ] = "1,14",
    jobs: Annotated[int, typer.Option(envvar="NEURALGRID_BENCH_JOBS", help="Jobs per round.", min=1)] = 700,
    rounds: Annotated[
        int, typer.Option(envvar="NEURALGRID_BENCH_ROUNDS", help="Rounds per case.", min=1)
    ] = 6,
    compare: Annotated[
        Path | None,
        typer.Option(help="SQL applied to a second scratch database, measured side by side.", exists=True),
    ] = None,
    stream: Annotated[
        bool, typer.Option("--stream", help="Streams, whose endings measure the node's speed.")
    ] = False,
    paths: Annotated[
        str,
        typer.Option(
            envvar="NEURALGRID_BENCH_PATHS",
            help="placed (place_jobs() and complete_jobs()), leased (record_jobs(): start, then end),"
            " once (record_jobs(): start and end in one call), renew (renew_leases() of a gateway's"
            " idle lanes, a group of them a call: per lane).",
        ),
    ] = "placed,leased",
    out_file: OutFile = Path("bench-results/sql.json"),
) -> None:
    """Postgres time and CPU per job of the request path's SQL alone, both ways a gateway writes a
    job (placed in SQL: place_jobs() and complete_jobs(); dispatched from a lease: record_jobs(),
    start then end), in groups as the gateway sends them, optionally against a change."""
    from neuralgrid.bench import request_sql as bench

    sizes = integers(groups, "--groups")
    if not all(1 <= size <= bench.MAX_GROUP for size in sizes):
        raise fail(f"--groups: from 1 to {bench.MAX_GROUP} requests each (place_jobs() takes no more)")
    chosen = tuple(path.strip() for path in paths.split(",") if path.strip())
    if not chosen or not set(chosen) <= set(bench.PATHS):
        raise fail(f"--paths: one or more of {', '.join(bench.PATHS)}, comma-separated (got {paths!r})")
    try:
        results = bench.run(
            database_url(ctx), sizes, jobs, rounds, compare, stream, tuple(dict.fromkeys(chosen)), progress
        )
    except bench.CompareFailed as err:
        raise fail(str(err)) from err
    table = Table(
        "group",
        "path",
        "database",
        "first call",
        "second call",
        "total",
        "postgres cpu",
        caption="ms per job: the client's wall time in each call (placed: place_jobs(), complete_jobs();"
        " leased: record_jobs() of the starts, of the ends; once: none, then record_jobs() of both;"
        " renew: renew_leases(), per lane), the backend's CPU; medians over rounds",
    )
    for r in results:
        for name in ("base", "compare", "ratio", "leased_over_placed"):
            if name in r:
                f = r[name]
                fmt = "{:.3f}x" if name in ("ratio", "leased_over_placed") else "{:.3f}"
                table.add_row(
                    str(r["group"]),
                    r["path"],
                    f"{r['path']}/placed" if name == "leased_over_placed" else name,
                    *(
                        fmt.format(f[k]) if k in f else "-"
                        for k in ("first_ms", "second_ms", "total_ms", "postgres_cpu_ms")
                    ),
                )
    report(
        table,
        out_file,
        "sql",
        results,
        units="ms",
        target="Postgres <= 0.7 ms CPU per request (issue 16); leased: 5x less CPU per job than placed",
    )


def register(app: typer.Typer) -> None:
    app.command("gateway")(gateway)
    app.command("sql")(sql)
