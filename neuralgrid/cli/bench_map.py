"""`neuralgrid bench map`: the fleet map in headless Chromium at 1k, 10k and 100k nodes (issue 41).
A command of the `bench` group, kept apart from cli/bench.py for its length."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from neuralgrid.cli.common import OutFile, database_url, fail, friendly_errors, integers, progress, report

TARGET = (
    "map ready at 100,000 nodes within 2x of 1,000; at most 10 Realtime messages a second per viewer"
    " while nodes change"
)


@friendly_errors
def bench_map(
    ctx: typer.Context,
    sizes: Annotated[
        str, typer.Option(envvar="NEURALGRID_BENCH_SIZES", help="Fleet sizes, comma-separated.")
    ] = "1000,10000,100000",
    rounds: Annotated[int, typer.Option(help="Page loads per size (medians are reported).", min=1)] = 5,
    rate: Annotated[
        int, typer.Option(help="Node status changes a second while the page is live.", min=1)
    ] = 100,
    seconds: Annotated[float, typer.Option(help="Seconds of changes per size.", min=1)] = 10.0,
    quiet: Annotated[
        float,
        typer.Option(
            help="Seconds the fleet is measured at rest, watched and not, before the changes; the"
            " settling before it scales with it (11 s at 5: the feed's 10-s window and a second).",
            min=0.5,
        ),
    ] = 5.0,
    out_file: OutFile = Path("bench-results/map.json"),
) -> None:
    """The map's first paint (paint timing, and its own map-ready mark: the fleet drawn), JS heap, DOM
    and JSON read at each fleet size, written in bulk in SQL on a scratch database and served by a
    gateway of its own; then Realtime messages and bytes a second for one viewer, its requests, and
    Postgres's and the gateway's CPU a second, while node statuses change."""
    from neuralgrid.bench import map as bench

    try:
        results = bench.run(
            database_url(ctx),
            integers(sizes, "--sizes"),
            rounds,
            rate,
            seconds,
            progress=progress,
            rest=bench.Rest(quiet, bench.SETTLE_S * quiet / bench.QUIET_S),
        )
    except bench.BenchMapError as err:
        raise fail(str(err)) from err
    table = Table(
        "nodes",
        "first paint",
        "FCP",
        "map ready",
        "x smallest",
        "JS heap MB",
        "DOM",
        "JSON KB",
        "msgs/s",
        "bytes/s",
        "req/s",
        "postgres cpu/s",
        "at rest",
        "unwatched",
        caption="ms, medians of the page loads; msgs/s: every frame the viewer's Realtime socket received"
        " while statuses changed (bytes/s theirs); cpu/s: ms of Postgres CPU a second then; at rest:"
        " nothing changing, the page live; unwatched: nothing changing, no page (the gateway's upkeep)",
    )
    for r in results:
        live = r["live"]
        table.add_row(
            f"{r['nodes']:,}",
            f"{r['first_paint_ms']:.0f}",
            f"{r['first_contentful_paint_ms']:.0f}",
            f"{r['map_ready_ms']:.0f}",
            f"{r['map_ready_over_smallest']:.2f}",
            f"{r['js_heap_mb']:.1f}",
            f"{r['dom_elements']:,}",
            f"{r['json_kb']:.1f}",
            f"{live['messages_per_s']:.2f}",
            f"{live['bytes_per_s']:,.0f}",
            f"{live['requests_per_s']:.2f}",
            f"{live['postgres_cpu_ms_per_s']:.0f}",
            f"{live['quiet_postgres_cpu_ms_per_s']:.0f}",
            f"{live['unwatched_postgres_cpu_ms_per_s']:.0f}",
        )
    report(table, out_file, "map", results, units="ms", target=TARGET)


def register(app: typer.Typer) -> None:
    app.command("map")(bench_map)
