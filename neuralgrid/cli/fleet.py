"""`neuralgrid nodes …` and `neuralgrid match`: the fleet as the operator sees it, or a GPU owner's
own nodes when `neuralgrid login` signed them in to a hosted project."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, NamedTuple
from uuid import UUID

import typer
from rich import box
from rich.table import Table

from neuralgrid.cli.account import hosted_errors, signed_in
from neuralgrid.cli.common import database, fail, friendly_errors, out, piped, print_table

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
    """A column of a listing: a narrow set of them fits 80 columns, --wide shows the others too."""

    header: str
    cell: Callable[[dict[str, Any]], str]
    wraps: bool = False  # only cells of several words: wrapping a one-word cell would cut it
    only_with: str | None = None  # shown only for rows that carry this field (an owner's own nodes)


def heartbeat_age(at: datetime | None, now: datetime) -> str:
    """How long ago, in the unit that reads at a glance: a clock time would need its zone."""
    if at is None:
        return "never"
    seconds = max(0, int((now - at).total_seconds()))  # a server's clock a little ahead: "0 s ago"
    if seconds < 60:
        return f"{seconds} s ago"
    if seconds < 3_600:
        return f"{seconds // 60} min ago"
    if seconds < 2 * 86_400:
        return f"{seconds // 3_600} h ago"
    return f"{seconds // 86_400} d ago"


def _status(r: dict[str, Any]) -> str:
    """Its status, and whether it fell silent since: no sweep marks it offline while nothing runs."""
    return f"{r['status']}, silent" if r.get("silent") else r["status"]


def _heartbeat(r: dict[str, Any]) -> str:
    return heartbeat_age(r["last_heartbeat_at"], datetime.now(UTC))


def _reputation(r: dict[str, Any]) -> str:
    """The share of its jobs a node served, as the map's node card and the owner's page show it."""
    jobs = r["successes"] + r["failures"]
    return f"{100 * r['successes'] / jobs:.1f}%" if jobs else "no jobs"


def _verification(r: dict[str, Any]) -> str:
    """The worst state of the node's models under verification; "-" when it holds no pinned model."""
    return r["verification"] or "-"


def _gpu(r: dict[str, Any]) -> str:
    return r["gpu_model"] if r["gpu_count"] == 1 else f"{r['gpu_count']}x {r['gpu_model']}"


_VENDOR_WORDS = {"NVIDIA", "GeForce", "AMD"}


def _short_gpu(r: dict[str, Any]) -> str:
    """The model without its maker's words (RTX 4090, A100 40GB): the narrow view's room is short."""
    model = " ".join(w for w in r["gpu_model"].split() if w not in _VENDOR_WORDS) or r["gpu_model"]
    return model if r["gpu_count"] == 1 else f"{r['gpu_count']}x {model}"


# What an operator checks first (is it up, how busy, is it alive, can it be trusted, which hardware)
# fits 80 columns; --wide adds the region, specs, price, counts, verification and warm models. The
# narrow view has no room for a verification column: the nodes that failed it, or are suspect, are
# named under the table (_print_flagged()).
_NODES_NARROW = (
    Column("name", lambda r: r["name"]),
    Column("gpu", _short_gpu, wraps=True),
    Column("status", _status),
    Column("load", lambda r: f"{r['inflight']}/{r['max_concurrency']}"),
    Column("heartbeat", _heartbeat),
    Column("reputation", _reputation),
)
_NODES_WIDE = (
    Column("name", lambda r: r["name"]),
    Column("gpu", _gpu, wraps=True),
    Column("vram", lambda r: f"{r['vram_gb']:g}"),
    Column("tflops", lambda r: f"{r['tflops']:g}"),
    Column("$/h", lambda r: f"{r['hourly_rate']:.2f}"),
    Column("region", lambda r: r["region"]),
    Column("status", _status),
    Column("load", lambda r: f"{r['inflight']}/{r['max_concurrency']}"),
    Column("heartbeat", _heartbeat),
    Column("ok/fail", lambda r: f"{r['successes']}/{r['failures']}"),
    Column("reputation", _reputation),
    Column("verification", _verification, only_with="verification"),
    Column("gpu proof", lambda r: r["gpu_proof"] or "-", only_with="gpu_proof"),
    Column("warm models", lambda r: ", ".join(r["warm_models"]), wraps=True),
    Column("endpoint", lambda r: r["endpoint_url"] or "", wraps=True, only_with="endpoint_url"),
)


@nodes_app.command("ls")
@hosted_errors
def nodes_ls(
    ctx: typer.Context,
    as_json: JsonOption = False,
    wide: Annotated[
        bool,
        typer.Option(
            "--wide",
            help="Every column: region, VRAM, TFLOPS, price, ok/fail, verification, GPU proof, warm models"
            " (endpoint: yours).",
        ),
    ] = False,
) -> None:
    """List nodes: GPU, status, load, heartbeat age, reputation, and under them those that failed
    verification or are suspect, or whose GPU failed its probe (--wide: region, specs, warm models,
    each node's verification: the worst state of its models the platform checks, "-" for none, and
    its GPU proof: unproven, proven, suspect, failed or no_gpu).

    Signed in to a hosted project (`neuralgrid login`): your own nodes, with their endpoints."""
    api = signed_in(ctx)
    rows = api.nodes() if api is not None else _fleet_in_database(ctx)
    if as_json:
        print_json(rows)
        return
    print_table(column_table(rows, _NODES_WIDE if wide else _NODES_NARROW), narrow=not wide)
    if not wide:
        _print_flagged(rows)


def _print_flagged(rows: list[dict[str, Any]]) -> None:
    """The nodes whose models failed verification (the matcher passes them over for those models) or
    are suspect (challenged more often), a line each state; and those whose GPU failed its probe."""
    meanings = {"failed": "no requests for the failed model", "suspect": "challenged more often"}
    for state, meaning in meanings.items():
        names = [r["name"] for r in rows if r.get("verification") == state]
        if names:
            out.print(f"{state} verification: {', '.join(names)} ({meaning})", highlight=False)
    names = [r["name"] for r in rows if r.get("gpu_proof") == "failed"]
    if names:
        out.print(f"GPU failed its probe: {', '.join(names)} (no requests)", highlight=False)


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
        bool,
        typer.Option(envvar="NEURALGRID_EXPLAIN", help="Also say why the others lost, grouped by reason."),
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
    components = _MATCH_COMPONENTS if wide else _MATCH_NARROW
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header in ("#", "node", "score", *components):
        table.add_column(header, no_wrap=True)
    ranked = [r for r in rows if r.rank is not None]
    for r in ranked:
        table.add_row(str(r.rank), r.name, _fmt(r.score), *(_fmt(getattr(r, c)) for c in components))
    if ranked:
        print_table(table, narrow=not wide)
    else:
        why = "" if explain else " (--explain says why)"
        out.print(f"no node can serve {model} now{why}", highlight=False)
    rejected = [(r.name, r.reject_reason or "") for r in rows if r.rank is None]
    if rejected:
        _print_reasons(rejected)


# The default view fits 80 columns with the components that weigh most by default; --wide shows them
# all.
_MATCH_COMPONENTS = ("fit", "compute", "price", "warm", "capacity", "reputation", "proximity", "reserve")
_MATCH_NARROW = ("fit", "warm", "compute", "price", "reserve")
_NAMED_UP_TO = 4  # a reason that rejects more nodes gives their count alone: --json names each


def _print_reasons(rejected: list[tuple[str, str]]) -> None:
    """Why the other nodes lost, a paragraph a reason with how many it rejects (most first): a line a
    node buried the ranking under two dozen copies of one sentence."""
    import textwrap

    by_reason: dict[str, list[str]] = {}
    for name, reason in rejected:
        by_reason.setdefault(reason, []).append(name)
    width = 80 if piped() else out.width
    out.print(f"\n{len(rejected)} {_nodes(len(rejected))} rejected:", highlight=False)
    for reason, names in sorted(by_reason.items(), key=lambda item: -len(item[1])):
        text = _grouped(reason, len(names))
        if len(names) <= _NAMED_UP_TO:
            text += f" ({', '.join(names)})"
        wrapped = textwrap.fill(
            text,
            width,
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        out.print(wrapped, highlight=False, soft_wrap=True)
    if any(len(names) > _NAMED_UP_TO for names in by_reason.values()):
        out.print("  (--json names each node with its reason)", highlight=False)


def _nodes(count: int) -> str:
    return "node" if count == 1 else "nodes"


def _grouped(reason: str, count: int) -> str:
    """'15 nodes: 24 GB VRAM, needs 42 GB'; a reason that is a verb takes the count as its subject:
    '24 nodes do not hold my/model'."""
    if reason.startswith("does not "):
        verb = reason if count == 1 else "do not " + reason.removeprefix("does not ")
        return f"{count} {_nodes(count)} {verb}"
    return f"{count} {_nodes(count)}: {reason}"


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"
