"""`neuralgrid nodes …` and `neuralgrid match`: the fleet as the operator sees it, or a GPU owner's
own nodes when `neuralgrid login` signed them in to a hosted project."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, NamedTuple
from uuid import UUID

import typer
from rich import box
from rich.table import Table

from neuralgrid.cli.account import hosted_errors, signed_in
from neuralgrid.cli.common import database, fail, friendly_errors, out, print_table

nodes_app = typer.Typer(no_args_is_help=True, help="Import and list the fleet of GPU nodes.")
JsonOption = Annotated[bool, typer.Option("--json", envvar="NEURALGRID_JSON", help="Print JSON.")]


@nodes_app.command("import")
@friendly_errors
def nodes_import(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="JSON list of nodes (fields of the nodes table + models).")],
) -> None:
    """Insert or update (by name) the nodes of a fleet file, all or nothing."""
    from neuralgrid.admin import fleet

    specs = fleet.read_fleet(file)
    with database(ctx) as conn:
        ids = fleet.import_fleet(conn, specs)
    out.print(f"imported {len(ids)} nodes from {file}")


def print_json(rows: list[dict[str, Any]]) -> None:
    """Rows as JSON, whether psycopg or the Data API read them (no server package needed)."""

    def default(value: object) -> str | float:
        if isinstance(value, date | UUID):  # datetimes too
            return str(value)
        if isinstance(value, Decimal):
            return float(value)
        raise TypeError(type(value).__name__)

    print(json.dumps(rows, default=default, indent=2))


class Column(NamedTuple):
    """A column of a listing that fits 80 columns by default (--wide: every column)."""

    header: str
    cell: Callable[[dict[str, Any]], str]
    narrow: bool = True  # in the default view, which fits 80 columns; --wide adds the others
    wraps: bool = False  # only cells of several words: wrapping a one-word cell would cut it
    only_with: str | None = None  # shown only for rows that carry this field (an owner's own nodes)


def _heartbeat(r: dict[str, Any]) -> str:
    return r["last_heartbeat_at"].strftime("%H:%M:%S") if r["last_heartbeat_at"] else "never"


def _gpu(r: dict[str, Any]) -> str:
    return r["gpu_model"] if r["gpu_count"] == 1 else f"{r['gpu_count']}x {r['gpu_model']}"


# What an operator checks first (is it up, how busy, which hardware, where) is narrow.
_NODE_COLUMNS = (
    Column("name", lambda r: r["name"], narrow=True),
    Column("gpu", _gpu, narrow=True, wraps=True),
    Column("vram", lambda r: f"{r['vram_gb']:g}", narrow=False),
    Column("tflops", lambda r: f"{r['tflops']:g}", narrow=False),
    Column("$/h", lambda r: f"{r['hourly_rate']:.2f}", narrow=False),
    Column("region", lambda r: r["region"], narrow=True),
    Column("status", lambda r: r["status"], narrow=True),
    Column("load", lambda r: f"{r['inflight']}/{r['max_concurrency']}", narrow=True),
    Column("heartbeat", _heartbeat, narrow=True),
    Column("ok/fail", lambda r: f"{r['successes']}/{r['failures']}", narrow=False),
    Column("warm models", lambda r: ", ".join(r["warm_models"]), narrow=False, wraps=True),
    Column("endpoint", lambda r: r["endpoint_url"] or "", narrow=False, wraps=True, only_with="endpoint_url"),
)


@nodes_app.command("ls")
@hosted_errors
def nodes_ls(
    ctx: typer.Context,
    as_json: JsonOption = False,
    wide: Annotated[
        bool,
        typer.Option(
            "--wide", help="Every column: VRAM, TFLOPS, price, ok/fail, warm models (endpoint: yours)."
        ),
    ] = False,
) -> None:
    """List nodes with status, last heartbeat, load and hardware (--wide: reputation, warm models).

    Signed in to a hosted project (`neuralgrid login`): your own nodes, with their endpoints."""
    api = signed_in(ctx)
    rows = api.nodes() if api is not None else _fleet_in_database(ctx)
    if as_json:
        print_json(rows)
        return
    print_table(column_table(rows, [c for c in _NODE_COLUMNS if wide or c.narrow]))


def column_table(rows: list[dict[str, Any]], columns: Sequence[Column]) -> Table:
    """The given columns of rows (those only_with fields the rows carry); no outer edges or rules
    between columns, so that a narrow choice fits 80 with its cells of several words wrapped."""
    shown = [c for c in columns if c.only_with is None or _carry(rows, c)]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for c in shown:
        table.add_column(c.header, no_wrap=not c.wraps)
    for r in rows:
        table.add_row(*(c.cell(r) for c in shown))
    return table


def _carry(rows: list[dict[str, Any]], column: Column) -> bool:
    return bool(rows) and column.only_with in rows[0]


@friendly_errors
def _fleet_in_database(ctx: typer.Context) -> list[dict[str, Any]]:
    from neuralgrid.admin import fleet

    with database(ctx) as conn:
        return fleet.list_nodes(conn)


@friendly_errors
def match(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(envvar="NEURALGRID_MODEL", help="Model id to serve.")],
    min_vram: Annotated[
        float | None,
        typer.Option(envvar="NEURALGRID_MIN_VRAM", help="VRAM needed (GB); default: catalog."),
    ] = None,
    policy: Annotated[str, typer.Option(envvar="NEURALGRID_POLICY", help="seed or balanced.")] = "balanced",
    region: Annotated[str | None, typer.Option(envvar="NEURALGRID_REGION", help="Caller's region.")] = None,
    max_rate: Annotated[
        float | None, typer.Option(envvar="NEURALGRID_MAX_RATE", help="Price cap, USD per hour.")
    ] = None,
    limit: Annotated[int | None, typer.Option(envvar="NEURALGRID_LIMIT", help="Show the best N.")] = None,
    explain: Annotated[
        bool, typer.Option(envvar="NEURALGRID_EXPLAIN", help="Also list rejected nodes and why.")
    ] = False,
    route: Annotated[
        str | None,
        typer.Option(envvar="NEURALGRID_ROUTE", help="Only nodes serving this route (e.g. rerank)."),
    ] = None,
    wide: Annotated[bool, typer.Option("--wide", help="Every score component.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Rank the nodes for a request (score_nodes), best first, without claiming any."""
    from neuralgrid.db import matching
    from neuralgrid.protocol.routes import parse_routes

    if max_rate is not None and not max_rate >= 0:  # NaN too
        raise fail("--max-rate must be a number of USD per hour, not negative")
    try:
        routes = parse_routes(route) if route is not None else ()
    except ValueError as err:
        raise fail(f"--route: {err}") from err
    if len(routes) > 1:
        raise fail("--route: one route at a time")
    request = matching.MatchRequest(
        model=model,
        min_vram_gb=min_vram,
        policy=policy,
        region=region,
        max_hourly_rate=max_rate,
        route=routes[0] if routes else None,
    )
    with database(ctx) as conn:
        rows = matching.score_nodes(conn, request, explain=explain, limit=limit)
    if as_json:
        print(json.dumps([asdict(r) for r in rows], default=str, indent=2))
        return
    components = _MATCH_COMPONENTS if wide else _MATCH_EXPLAIN if explain else _MATCH_NARROW
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header in ("#", "node", "score", *components):
        table.add_column(header, no_wrap=True)
    if explain:
        table.add_column("rejected because", min_width=24)  # wraps: the sentence is as long as it needs
    for r in rows:
        cells = [str(r.rank or "-"), r.name, _fmt(r.score), *(_fmt(getattr(r, c)) for c in components)]
        table.add_row(*cells, *([r.reject_reason or ""] if explain else []))
    print_table(table)


# The default view fits 80 columns with the components that weigh most by default (fewer beside the
# reasons of --explain); --wide shows them all.
_MATCH_COMPONENTS = ("fit", "compute", "price", "warm", "capacity", "reputation", "proximity", "reserve")
_MATCH_NARROW = ("fit", "warm", "compute", "price", "reserve")
_MATCH_EXPLAIN = ("fit", "warm", "price")


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"
