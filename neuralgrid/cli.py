"""The `neuralgrid` command. Every flag has an environment-variable twin, shown in --help."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import psycopg
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from neuralgrid import fleet, keys, matching, stack
from neuralgrid.config import Settings
from neuralgrid.db import connect, migrate
from neuralgrid.db.embedded import EmbeddedPostgresError
from neuralgrid.db.errors import DatabaseError
from neuralgrid.serving import run_fast

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help=__doc__, pretty_exceptions_show_locals=False
)
db_app = typer.Typer(no_args_is_help=True, help="The database: migrations and its URL.")
nodes_app = typer.Typer(no_args_is_help=True, help="Load and list the fleet of GPU nodes.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print numbers and write JSON.")
app.add_typer(db_app, name="db")
app.add_typer(nodes_app, name="nodes")
app.add_typer(bench_app, name="bench")

DEMO_FLEET = Path(__file__).parent / "data" / "demo_fleet.json"
DEMO_NODES = 24
out = Console()
P = ParamSpec("P")
R = TypeVar("R")


def fail(message: str) -> typer.Exit:
    """One line on stderr and a non-zero exit, for every error a person can cause."""
    Console(stderr=True).print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def friendly_errors(command: Callable[P, R]) -> Callable[P, R]:
    @wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except (DatabaseError, EmbeddedPostgresError) as err:
            raise fail(str(err).splitlines()[0]) from err
        except psycopg.OperationalError as err:
            raise fail(f"cannot reach the database: {str(err).strip().splitlines()[0]}") from err

    return wrapper


@app.callback()
def main(
    ctx: typer.Context,
    home: Annotated[
        Path | None, typer.Option(envvar="NEURALGRID_HOME", help="State directory (embedded DB).")
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(envvar="DATABASE_URL", help="Use this Postgres instead of the embedded one."),
    ] = None,
    db_port: Annotated[
        int | None, typer.Option(envvar="NEURALGRID_DB_PORT", help="Embedded Postgres TCP port.")
    ] = None,
) -> None:
    """NeuralGrid: route OpenAI-compatible inference to other people's GPUs."""
    overrides: dict[str, Any] = {
        "NEURALGRID_HOME": home,
        "DATABASE_URL": database_url,
        "NEURALGRID_DB_PORT": db_port,
    }
    try:
        ctx.obj = stack.with_stack_secret(Settings(**{k: v for k, v in overrides.items() if v is not None}))
    except ValidationError as err:
        raise fail(err.errors()[0]["msg"]) from err


@contextmanager
def database(ctx: typer.Context) -> Iterator[psycopg.Connection]:
    settings: Settings = ctx.obj
    with psycopg.connect(connect.prepare(settings), autocommit=True) as conn:
        yield conn


@db_app.command("migrate")
@friendly_errors
def db_migrate(ctx: typer.Context) -> None:
    """Apply the Supabase compatibility layer (only where missing) and pending migrations."""
    settings: Settings = ctx.obj
    with psycopg.connect(connect.database_url(settings), autocommit=True) as conn:
        if migrate.apply_compat_layer(conn):
            out.print("applied the Supabase compatibility layer")
        applied = migrate.migrate(conn)
        if migrate.apply_realtime_feed(conn):
            out.print("installed the embedded Realtime feed")
    for m in applied:
        out.print(f"applied {m.version}_{m.name}")
    if not applied:
        out.print("database is up to date")


@db_app.command("url")
@friendly_errors
def db_url(ctx: typer.Context) -> None:
    """Print a database URL that psql and the Supabase CLI accept."""
    print(connect.prepare(ctx.obj))


@nodes_app.command("import")
@friendly_errors
def nodes_import(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="JSON list of nodes (fields of the nodes table + models).")],
) -> None:
    """Insert or update (by name) the nodes of a fleet file, all or nothing."""
    specs = fleet.read_fleet(file)
    with database(ctx) as conn:
        ids = fleet.import_fleet(conn, specs)
    out.print(f"imported {len(ids)} nodes from {file}")


@nodes_app.command("ls")
@friendly_errors
def nodes_ls(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", envvar="NEURALGRID_JSON", help="Print JSON.")] = False,
) -> None:
    """List nodes with status, last heartbeat, load, warm models and reputation."""
    with database(ctx) as conn:
        rows = fleet.list_nodes(conn)
    if as_json:
        print(fleet.to_json(rows))
        return
    table = Table(
        "name",
        "gpu",
        "vram",
        "tflops",
        "$/h",
        "region",
        "status",
        "load",
        "heartbeat",
        "ok/fail",
        "warm models",
    )
    for r in rows:
        beat = r["last_heartbeat_at"].strftime("%H:%M:%S") if r["last_heartbeat_at"] else "never"
        table.add_row(
            r["name"],
            f"{r['gpu_count']}x {r['gpu_model']}",
            f"{r['vram_gb']:g}",
            f"{r['tflops']:g}",
            f"{r['hourly_rate']:.2f}",
            r["region"],
            r["status"],
            f"{r['inflight']}/{r['max_concurrency']}",
            beat,
            f"{r['successes']}/{r['failures']}",
            ", ".join(r["warm_models"]),
        )
    out.print(table)


@app.command("match")
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
    as_json: Annotated[bool, typer.Option("--json", envvar="NEURALGRID_JSON", help="Print JSON.")] = False,
) -> None:
    """Rank the nodes for a request (score_nodes), best first, without claiming any."""
    request = matching.MatchRequest(
        model=model, min_vram_gb=min_vram, policy=policy, region=region, max_hourly_rate=max_rate
    )
    with database(ctx) as conn:
        rows = matching.score_nodes(conn, request, explain=explain, limit=limit)
    if as_json:
        print(json.dumps([asdict(r) for r in rows], default=str, indent=2))
        return
    components = ("fit", "compute", "price", "warm", "capacity", "reputation", "proximity")
    table = Table("#", "node", "score", *components, "rejected because")
    for r in rows:
        cells = [getattr(r, c) for c in components]
        table.add_row(
            str(r.rank or "-"),
            r.name,
            _fmt(r.score),
            *(_fmt(c) for c in cells),
            r.reject_reason or "",
        )
    out.print(table)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


@bench_app.command("matching")
@friendly_errors
def bench_matching(
    ctx: typer.Context,
    sizes: Annotated[
        str, typer.Option(envvar="NEURALGRID_BENCH_SIZES", help="Fleet sizes, comma-separated.")
    ] = "1000,10000,100000",
    callers: Annotated[
        str,
        typer.Option(envvar="NEURALGRID_BENCH_CALLERS", help="Concurrent callers, comma-separated."),
    ] = "1,16",
    calls: Annotated[int, typer.Option(envvar="NEURALGRID_BENCH_CALLS", help="Calls per case.")] = 400,
    out_file: Annotated[
        Path, typer.Option("--out", envvar="NEURALGRID_BENCH_OUT", help="Where to write the JSON.")
    ] = Path("bench-results/matching.json"),
) -> None:
    """p50/p99 of match_job() and score_nodes() at 1k/10k/100k online nodes, 1 and 16 callers."""
    from neuralgrid.bench import matching as bench
    from neuralgrid.bench import write_report

    try:
        fleet_sizes = [int(s) for s in sizes.split(",")]
        caller_counts = [int(c) for c in callers.split(",")]
    except ValueError as err:
        raise fail(f"--sizes and --callers take comma-separated integers ({err})") from err
    if min(fleet_sizes) < 1 or min(caller_counts) < 1 or calls < 1:
        raise fail("sizes, callers and calls must be positive")
    url = connect.prepare(ctx.obj)
    results = bench.run(
        url,
        fleet_sizes,
        caller_counts,
        calls,
        progress=lambda msg: Console(stderr=True).print(f"[dim]{msg}[/]"),
    )
    table = Table("nodes", "function", "callers", "p50 ms", "p99 ms", "calls/s")
    for r in results:
        table.add_row(
            f"{r['nodes']:,}",
            r["function"],
            str(r["callers"]),
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['calls_per_s']:,.0f}",
        )
    out.print(table)
    write_report(out_file, "matching", results, target="match_job p99 <= 5 ms at 10,000 nodes")
    out.print(f"wrote {out_file}")


@bench_app.command("gateway")
@friendly_errors
def bench_gateway(
    ctx: typer.Context,
    callers: Annotated[
        str, typer.Option(envvar="NEURALGRID_BENCH_CALLERS", help="Concurrent callers, comma-separated.")
    ] = "1,16,64",
    requests: Annotated[
        int,
        typer.Option(
            envvar="NEURALGRID_BENCH_REQUESTS", help="Requests per sequential case (x4 concurrent)."
        ),
    ] = 500,
    out_file: Annotated[
        Path, typer.Option("--out", envvar="NEURALGRID_BENCH_OUT", help="Where to write the JSON.")
    ] = Path("bench-results/gateway.json"),
) -> None:
    """Added latency and requests/s of the gateway against the node it fronts and a bare relay."""
    from neuralgrid.bench import gateway as bench
    from neuralgrid.bench import write_report

    try:
        caller_counts = [int(c) for c in callers.split(",")]
    except ValueError as err:
        raise fail(f"--callers takes comma-separated integers ({err})") from err
    if min(caller_counts) < 1 or requests < 1:
        raise fail("callers and requests must be positive")
    url = connect.prepare(ctx.obj)
    results = bench.run(
        url, caller_counts, requests, progress=lambda m: Console(stderr=True).print(f"[dim]{m}[/]")
    )
    table = Table(
        "mode",
        "callers",
        "direct p50",
        "relay +p50",
        "gateway +p50",
        "gateway +p99",
        "direct req/s",
        "relay req/s",
        "gateway req/s",
        "errors d/r/g",
        caption="ms; +: added to the direct path",
    )
    for r in results:
        table.add_row(
            "stream" if r["stream"] else "plain",
            str(r["callers"]),
            f"{r['direct']['p50_ms']:.2f}",
            f"{r['relay_added_p50_ms']:.2f}",
            f"{r['added_p50_ms']:.2f}",
            f"{r['added_p99_ms']:.2f}",
            f"{r['direct']['rps']:,.0f}",
            f"{r['relay']['rps']:,.0f}",
            f"{r['gateway']['rps']:,.0f}",
            "/".join(str(r[t]["errors"]) for t in ("direct", "relay", "gateway")),
        )
    (out if out.is_terminal else Console(width=140)).print(table)  # whole headers in a log too
    write_report(
        out_file,
        "gateway",
        results,
        units="ms",
        target="added <= 1 ms p50 and <= 5 ms p99 sequential; >= 1000 rps non-streaming",
    )
    out.print(f"wrote {out_file}")


@bench_app.command("realtime")
@friendly_errors
def bench_realtime(
    ctx: typer.Context,
    subscribers: Annotated[
        str, typer.Option(envvar="NEURALGRID_BENCH_SUBSCRIBERS", help="Subscriber counts, comma-separated.")
    ] = "1,100,1000",
    rate: Annotated[int, typer.Option(help="Status changes per second.", min=1)] = 100,
    seconds: Annotated[float, typer.Option(help="Seconds of changes per case.", min=1)] = 10,
    out_file: Annotated[
        Path, typer.Option("--out", envvar="NEURALGRID_BENCH_OUT", help="Where to write the JSON.")
    ] = Path("bench-results/realtime.json"),
) -> None:
    """Delivery latency from a committed node status change to N Realtime subscribers."""
    from neuralgrid.bench import realtime as bench
    from neuralgrid.bench import write_report

    try:
        counts = [int(c) for c in subscribers.split(",")]
    except ValueError as err:
        raise fail(f"--subscribers takes comma-separated integers ({err})") from err
    if min(counts) < 1:
        raise fail("subscriber counts must be positive")
    url = connect.prepare(ctx.obj)
    results = bench.run(
        url, counts, rate, seconds, progress=lambda m: Console(stderr=True).print(f"[dim]{m}[/]")
    )
    table = Table("subscribers", "changes/s", "delivered", "lost", "p50 ms", "p99 ms", "max ms")
    for r in results:
        table.add_row(
            str(r["subscribers"]),
            f"{r['changes_per_s']:.0f}",
            f"{r['delivered']:,}",
            str(r["lost"]),
            f"{r.get('p50_ms', float('nan')):.1f}",
            f"{r.get('p99_ms', float('nan')):.1f}",
            f"{r['max_ms'] or float('nan'):.1f}",
        )
    out.print(table)
    write_report(
        out_file, "realtime", results, units="ms", target="p99 <= 200 ms at 1,000 subscribers, 100 changes/s"
    )
    out.print(f"wrote {out_file}")


@bench_app.command("health")
@friendly_errors
def bench_health(
    ctx: typer.Context,
    requests: Annotated[
        int, typer.Option(envvar="NEURALGRID_BENCH_REQUESTS", help="Requests per tunnel/direct case.")
    ] = 300,
    out_file: Annotated[
        Path, typer.Option("--out", envvar="NEURALGRID_BENCH_OUT", help="Where to write the JSON.")
    ] = Path("bench-results/health.json"),
) -> None:
    """Time from a node's death to offline and to requests avoiding it; tunnel overhead vs direct."""
    from neuralgrid.bench import health as bench
    from neuralgrid.bench import write_report

    url = connect.prepare(ctx.obj)
    result = bench.run(url, requests, progress=lambda m: Console(stderr=True).print(f"[dim]{m}[/]"))
    table = Table("death", "to offline s", "first served elsewhere s", "first request avoiding it s")
    for scenario, r in result["deaths"].items():
        table.add_row(scenario, *(f"{v:.2f}" if v is not None else "never" for v in r.values()))
    out.print(table)
    t = result["tunnel_vs_direct"]
    tunnel_p50, direct_p50 = t["tunnel"]["sequential"]["p50_ms"], t["direct"]["sequential"]["p50_ms"]
    out.print(
        f"tunnel vs direct: p50 {tunnel_p50:.2f} vs {direct_p50:.2f} ms (added {t['added_p50_ms']:.2f} ms);"
        f" streams x16: {t['tunnel']['stream_x16_rps']:,.0f} vs {t['direct']['stream_x16_rps']:,.0f} req/s"
    )
    write_report(out_file, "health", [result], targets="silent node offline <= 15 s; dropped tunnel <= 1 s")
    out.print(f"wrote {out_file}")


@app.command("simulate")
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


@app.command("fake-node")
def fake_node(
    port: Annotated[int, typer.Option(envvar="NEURALGRID_FAKE_PORT", help="Port on 127.0.0.1.")] = 8000,
    tokens_per_s: Annotated[
        float, typer.Option(envvar="NEURALGRID_FAKE_TOKENS_PER_S", help="Generation speed (0: instant).")
    ] = 0.0,
    latency_s: Annotated[
        float, typer.Option(envvar="NEURALGRID_FAKE_LATENCY_S", help="Delay before the first byte.")
    ] = 0.0,
    failure_rate: Annotated[
        float, typer.Option(envvar="NEURALGRID_FAKE_FAILURE_RATE", help="Share of requests answered 500.")
    ] = 0.0,
    like: Annotated[
        str,
        typer.Option(
            envvar="NEURALGRID_FAKE_LIKE",
            help="Behave like vllm, llama.cpp or llama-cpp-python, as the conformance suite measured them.",
        ),
    ] = "vllm",
) -> None:
    """Serve a fake OpenAI-compatible inference server (for trying the platform without a GPU)."""
    import uvicorn

    from neuralgrid.demo import DEMO_MODELS
    from neuralgrid.fakenode import LIKE, FakeNodeConfig, create_fake_node

    if like not in LIKE:
        raise fail(f"--like {like!r}: choose one of {', '.join(LIKE)}")
    config = FakeNodeConfig.like(
        like, models=DEMO_MODELS, tokens_per_s=tokens_per_s, latency_s=latency_s, failure_rate=failure_rate
    )
    uvicorn.run(create_fake_node(config), host="127.0.0.1", port=port, log_level="warning")


@app.command("up")
@friendly_errors
def up(
    ctx: typer.Context,
    demo: Annotated[
        int,
        typer.Option(
            envvar="NEURALGRID_DEMO", help="Run N demo nodes (the demo fleet, backed by a fake node)."
        ),
    ] = 0,
    host: Annotated[str | None, typer.Option(envvar="NEURALGRID_HOST", help="Gateway address.")] = None,
    port: Annotated[int | None, typer.Option(envvar="NEURALGRID_PORT", help="Gateway port.")] = None,
) -> None:
    """Start the platform: database, migrations, gateway and health sweeper (Ctrl-C stops it)."""
    settings: Settings = ctx.obj
    settings = settings.model_copy(update={k: v for k, v in {"host": host, "port": port}.items() if v})
    if not 0 <= demo <= DEMO_NODES:
        raise fail(f"--demo takes 0 to {DEMO_NODES} nodes")
    server = connect.embedded_server(settings) if settings.embedded else None
    started_here = server is not None and not server.is_running()
    url = connect.prepare(settings)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request is noise
    try:
        run_fast(_serve(settings, url, demo))
    finally:
        if server is not None and started_here:  # leave a server someone else started alone
            server.stop()
            out.print("stopped the embedded database")


async def _serve(settings: Settings, url: str, demo: int) -> None:
    from neuralgrid import demo as demo_fleet
    from neuralgrid.gateway.app import create_app
    from neuralgrid.serving import make_server
    from neuralgrid.web.signin import signin_link

    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    gateway = make_server(create_app(settings, url), settings.host, settings.port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(gateway, "should_exit", True))
    # Entered resources (the demo node) stop after the gateway has drained.
    async with contextlib.AsyncExitStack() as resources:
        if demo:
            backend_url = await resources.enter_async_context(demo_fleet.backend())
            with psycopg.connect(url, autocommit=True) as conn:
                specs = fleet.read_fleet(DEMO_FLEET)[:demo]
                served = {"endpoint_url": backend_url, "backend": demo_fleet.FAKE_BACKEND}
                fleet.import_fleet(conn, [s.model_copy(update=served) for s in specs])
            tasks.append(asyncio.create_task(demo_fleet.keep_alive(url, stop)))
        tasks.append(asyncio.create_task(gateway.serve()))
        while not gateway.started and not tasks[-1].done():
            await asyncio.sleep(0.05)
        gateway_url = stack.public_base_url(settings)
        out.print(f"database  {url}", soft_wrap=True)
        docs = f"{gateway_url}/docs"
        out.print(f"gateway   {gateway_url}/v1  (OpenAI-compatible; docs at {docs})", soft_wrap=True)
        realtime_url = gateway_url.replace("http", "ws", 1)
        out.print(f"map       {gateway_url}/  (live; Realtime at {realtime_url}/realtime/v1)", soft_wrap=True)
        out.print(f"sweeper   every {settings.sweep_interval_s:g}s")
        if demo:
            out.print(f"demo      {demo} nodes online, served by a fake OpenAI-compatible node")
        if link := signin_link(settings, gateway_url):  # one use, 10 minutes; soft_wrap keeps it one line
            out.print(f"sign in   {link}", soft_wrap=True)
        await tasks[-1]  # returns once a signal sets should_exit and the gateway has drained
        stop.set()
        for task in tasks[:-1]:
            task.cancel()
        await asyncio.gather(*tasks[:-1], return_exceptions=True)


@app.command("status")
def status(
    ctx: typer.Context,
    output: Annotated[str, typer.Option("--output", "-o", help="pretty, json or env.")] = "pretty",
) -> None:
    """Print the stack's URLs and keys (API, Realtime, database, anon and service_role), as
    `supabase status` does."""
    settings: Settings = ctx.obj
    if output not in ("pretty", "json", "env"):
        raise fail("--output takes pretty, json or env")
    url = connect.database_url(settings, start=False)
    info = stack.status(settings, url)
    if output == "json":
        print(json.dumps(info, indent=2))
    elif output == "env":
        for name, value in info.items():
            print(f'{name}="{value}"')
    else:
        width = max(len(n) for n in info)
        for name, value in info.items():
            out.print(f"{name.replace('_', ' ').lower():>{width}}: {value}", highlight=False, soft_wrap=True)
        if settings.embedded and not connect.embedded_server(settings).is_running():
            out.print("the embedded database is not running: start the stack with `neuralgrid up`")


@app.command("signin")
def signin(ctx: typer.Context) -> None:
    """Print a fresh one-time sign-in link for the local owner (`up` prints one at start)."""
    from neuralgrid.web.signin import signin_link

    link = signin_link(ctx.obj, stack.public_base_url(ctx.obj))
    if link is None:
        raise fail(
            "this stack signs in through Supabase Auth (NEURALGRID_SUPABASE_URL): use the page's email form"
        )
    print(link)


@app.command("watch")
def watch(
    ctx: typer.Context,
    heartbeats: Annotated[bool, typer.Option(help="Also print every heartbeat (postgres_changes).")] = False,
    count: Annotated[int | None, typer.Option(help="Exit after this many events.", min=1)] = None,
    timeout: Annotated[float | None, typer.Option(help="Exit after this many seconds.", min=0)] = None,
) -> None:
    """Print the fleet's live feed (node status and health changes) through Supabase Realtime."""
    from neuralgrid.realtime.watch import watch as watch_feed

    settings: Settings = ctx.obj
    info = stack.status(settings, "")
    try:
        asyncio.run(
            watch_feed(
                info["REALTIME_URL"],
                info["ANON_KEY"],
                lambda line: print(line, flush=True),
                heartbeats=heartbeats,
                count=count,
                timeout=timeout,
            )
        )
    except KeyboardInterrupt:
        pass
    except (OSError, ConnectionError) as err:
        raise fail(f"cannot watch {info['REALTIME_URL']}: {err} (is `neuralgrid up` running?)") from err


node_app = typer.Typer(no_args_is_help=True, help="Run a GPU node: the agent a GPU owner runs.")
app.add_typer(node_app, name="node")


@node_app.command("run")
def node_run(
    gateway: Annotated[str, typer.Option(envvar="NEURALGRID_GATEWAY_URL", help="The gateway's URL.")],
    token: Annotated[str, typer.Option(envvar="NEURALGRID_NODE_TOKEN", help="Your operator API key.")],
    backend: Annotated[
        str,
        typer.Option(envvar="NEURALGRID_BACKEND_URL", help="Your OpenAI-compatible server (vLLM, Ollama…)."),
    ],
    name: Annotated[
        str | None, typer.Option(envvar="NEURALGRID_NODE_NAME", help="Node name (default: host).")
    ] = None,
    region: Annotated[
        str, typer.Option(envvar="NEURALGRID_NODE_REGION", help="Region, e.g. eu-west.")
    ] = "unknown",
    price: Annotated[
        float, typer.Option(envvar="NEURALGRID_NODE_PRICE", help="Your price, USD per hour.")
    ] = 0.5,
    max_concurrency: Annotated[
        int | None,
        typer.Option(
            envvar="NEURALGRID_NODE_MAX_CONCURRENCY",
            min=1,
            max=1024,
            help="Requests at once (default: what the server runs at once, when it says; else 4).",
        ),
    ] = None,
    model_alias: Annotated[
        list[str] | None,
        typer.Option(
            "--model-alias",
            envvar="NEURALGRID_NODE_MODEL_ALIASES",
            help="SERVED=CATALOG: serve the model the server calls SERVED as the catalog's CATALOG"
            " (its price and VRAM apply). Repeat for several.",
        ),
    ] = None,
    listen_port: Annotated[
        int, typer.Option(envvar="NEURALGRID_NODE_PORT", help="Port the agent listens on (direct mode).")
    ] = 8001,
    public_url: Annotated[
        str | None,
        typer.Option(envvar="NEURALGRID_NODE_PUBLIC_URL", help="How the gateway reaches this agent."),
    ] = None,
    gpu_model: Annotated[
        str | None, typer.Option(envvar="NEURALGRID_GPU_MODEL", help="GPU model (no NVML).")
    ] = None,
    vram_gb: Annotated[
        float | None, typer.Option(envvar="NEURALGRID_VRAM_GB", help="Total VRAM, GB.")
    ] = None,
    tflops: Annotated[
        float | None, typer.Option(envvar="NEURALGRID_TFLOPS", help="Dense FP16 TFLOPS.")
    ] = None,
    latitude: Annotated[
        float | None, typer.Option(envvar="NEURALGRID_NODE_LATITUDE", help="For the map.")
    ] = None,
    longitude: Annotated[
        float | None, typer.Option(envvar="NEURALGRID_NODE_LONGITUDE", help="For the map.")
    ] = None,
    tunnel: Annotated[
        bool,
        typer.Option(
            envvar="NEURALGRID_NODE_TUNNEL", help="Dial out to the gateway (behind NAT: no open port)."
        ),
    ] = False,
) -> None:
    """Join the grid: detect the GPU, register with the gateway, heartbeat; SIGTERM drains."""
    import socket

    from neuralgrid.agent.backend import BackendError, parse_aliases
    from neuralgrid.agent.run import Agent, AgentConfig, AgentError

    try:
        aliases = parse_aliases(model_alias or [])
    except BackendError as err:
        raise fail(str(err)) from err
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = AgentConfig(
        gateway_url=gateway,
        token=token,
        backend_url=backend,
        name=name or socket.gethostname(),
        region=region,
        price_usd_per_hour=price,
        max_concurrency=max_concurrency,
        listen_port=listen_port,
        public_url=public_url,
        gpu_model=gpu_model,
        vram_gb=vram_gb,
        tflops=tflops,
        latitude=latitude,
        longitude=longitude,
        tunnel=tunnel,
        model_aliases=aliases,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await Agent(config).run(stop)

    try:
        asyncio.run(main())
    except AgentError as err:
        raise fail(str(err)) from err


keys_app = typer.Typer(no_args_is_help=True, help="Developer API keys (shown in clear once, stored hashed).")
app.add_typer(keys_app, name="keys")


@keys_app.command("create")
@friendly_errors
def keys_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option(envvar="NEURALGRID_KEY_NAME", help="A name to recognise it by.")],
    rpm: Annotated[int | None, typer.Option(envvar="NEURALGRID_KEY_RPM", help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(envvar="NEURALGRID_KEY_TPM", help="Tokens per minute.")] = None,
    budget_usd: Annotated[
        float | None, typer.Option(envvar="NEURALGRID_KEY_BUDGET_USD", help="Spending cap in USD.")
    ] = None,
) -> None:
    """Create a key and print it: this is the only time it is shown."""
    with database(ctx) as conn:
        row = keys.create(conn, name, rpm, tpm, budget_usd)
    out.print(f"created key {row.prefix}… ({row.id}); it is shown once, keep it safe:")
    print(row.api_key)


@keys_app.command("ls")
@friendly_errors
def keys_ls(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", envvar="NEURALGRID_JSON", help="Print JSON.")] = False,
) -> None:
    """List keys (never the keys themselves): limits, spend, last use, revocation."""
    with database(ctx) as conn:
        rows = keys.list_keys(conn)
    if as_json:
        print(fleet.to_json(rows))
        return
    table = Table("id", "name", "prefix", "rpm", "tpm", "budget $", "spent $", "last used", "revoked")
    for r in rows:
        table.add_row(
            str(r["id"]),
            r["name"],
            r["prefix"],
            str(r["rpm_limit"] or "-"),
            str(r["tpm_limit"] or "-"),
            "-" if r["budget_usd"] is None else f"{r['budget_usd']:.2f}",
            f"{r['spent_usd']:.6f}",
            str(r["last_used_at"] or "never")[:19],
            str(r["revoked_at"] or "")[:19],
        )
    out.print(table)


@keys_app.command("revoke")
@friendly_errors
def keys_revoke(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="The key's id or prefix (as `keys ls` shows).")],
) -> None:
    """Revoke a key; every gateway refuses it within a second."""
    with database(ctx) as conn:
        revoked = keys.revoke(conn, key)
    out.print(f"revoked {revoked}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
