"""`neuralgrid bench …`: benchmarks that print numbers and write JSON."""

from __future__ import annotations

import json
from contextlib import ExitStack
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

app = typer.Typer(no_args_is_help=True, help="Benchmarks that print numbers and write JSON.")


@app.command("matching")
@friendly_errors
def matching(
    ctx: typer.Context,
    sizes: Annotated[
        str, typer.Option(envvar="NEURALGRID_BENCH_SIZES", help="Fleet sizes, comma-separated.")
    ] = "1000,10000,100000",
    callers: Annotated[
        str,
        typer.Option(envvar="NEURALGRID_BENCH_CALLERS", help="Concurrent callers, comma-separated."),
    ] = "1,16",
    calls: Annotated[int, typer.Option(envvar="NEURALGRID_BENCH_CALLS", help="Calls per case.", min=1)] = 400,
    out_file: OutFile = Path("bench-results/matching.json"),
) -> None:
    """p50/p99 of match_job() and score_nodes() at 1k/10k/100k online nodes, 1 and 16 callers."""
    from neuralgrid.bench import matching as bench

    fleet_sizes, caller_counts = integers(sizes, "--sizes"), integers(callers, "--callers")
    results = bench.run(database_url(ctx), fleet_sizes, caller_counts, calls, progress=progress)
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
    report(table, out_file, "matching", results, target="match_job p99 <= 5 ms at 10,000 nodes")


@app.command("capacity")
@friendly_errors
def capacity(
    ctx: typer.Context,
    callers: Annotated[
        str, typer.Option(envvar="NEURALGRID_BENCH_CALLERS", help="Concurrent callers, comma-separated.")
    ] = "4,8,16,64",
    requests: Annotated[
        int, typer.Option(envvar="NEURALGRID_BENCH_REQUESTS", help="Requests per case.", min=1)
    ] = 800,
    work_ms: Annotated[
        float, typer.Option(envvar="NEURALGRID_BENCH_WORK_MS", help="Each answer's time on its node.", min=0)
    ] = 20.0,
    gateways: Annotated[
        int, typer.Option(envvar="NEURALGRID_BENCH_GATEWAYS", help="Gateways on one database.", min=1, max=8)
    ] = 1,
    out_file: OutFile = Path("bench-results/capacity.json"),
) -> None:
    """Refusals, queue wait, requests/s and CPU per request at the default settings: two nodes of
    the default 4 slots, more callers than slots, through one gateway or several on one database."""
    from neuralgrid.bench import capacity as bench

    results = bench.run(
        database_url(ctx), integers(callers, "--callers"), requests, work_ms, gateways, progress=progress
    )
    table = Table(
        "mode",
        "callers",
        "slots",
        "served",
        "503",
        "wait p50",
        "wait p99",
        "p50",
        "p99",
        "req/s",
        "gateway cpu",
        "postgres cpu",
        caption=f"ms; {gateways} gateway(s); cpu: per request served, all gateway processes, all of Postgres",
    )
    for r in results:
        table.add_row(
            "stream" if r["stream"] else "plain",
            str(r["callers"]),
            str(r["slots"]),
            f"{r['served']}/{r['requests']}",
            str(r["refused_503"]),
            f"{r['queue_wait_p50_ms']:.1f}",
            f"{r['queue_wait_p99_ms']:.1f}",
            f"{r.get('p50_ms', 0):.1f}",
            f"{r.get('p99_ms', 0):.1f}",
            f"{r['rps']:,.0f}",
            f"{r['gateway_cpu_ms_per_request']:.2f}",
            f"{r['postgres_cpu_ms_per_request']:.2f}",
        )
    report(
        table,
        out_file,
        "capacity",
        results,
        target="0 refused while callers <= slots; every request served within the queue's deadline at 8x",
    )


@app.command("heartbeats")
@friendly_errors
def heartbeats(
    ctx: typer.Context,
    nodes: Annotated[
        int, typer.Option(envvar="NEURALGRID_BENCH_NODES", help="Nodes beating through a gateway.", min=1)
    ] = 2_000,
    fleet: Annotated[
        int,
        typer.Option(envvar="NEURALGRID_BENCH_FLEET", help="Nodes beating in SQL alone (0: none).", min=0),
    ] = 100_000,
    seconds: Annotated[
        float, typer.Option(envvar="NEURALGRID_BENCH_SECONDS", help="Each window's length.", min=1)
    ] = 15.0,
    interval: Annotated[
        float, typer.Option(help="Seconds between a node's beats (the default's).", min=0.1)
    ] = 5.0,
    rounds: Annotated[int, typer.Option(help="Rounds through the gateway, per-beat and batched.", min=1)] = 1,
    out_file: OutFile = Path("bench-results/heartbeats.json"),
) -> None:
    """Postgres CPU and WAL per heartbeat, batched (node_heartbeats()) against one agent_heartbeat() a
    beat (and the code before issue 41), through a gateway and at scale in SQL; beats/s delivered;
    match_job() p99 while they run against quiet."""
    from neuralgrid.bench import heartbeats as bench

    results = bench.run(database_url(ctx), nodes, fleet, seconds, interval, rounds, progress=progress)
    table = Table(
        "path",
        "code",
        "nodes",
        "offered/s",
        "beats/s",
        "pg us/beat",
        "gw us/beat",
        "WAL B/beat",
        "nodes/core",
        "match p99",
        "quiet p99",
        caption="CPU and WAL per beat written; nodes/core: nodes one core of Postgres keeps beating at that"
        " cost; match p99: match_job() while the beats run, quiet: without them, ms",
    )

    def num(value: Any, digits: int = 0) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    for r in results:
        table.add_row(
            r["path"],
            r["code"],
            f"{r['nodes']:,}",
            num(r.get("offered_beats_per_s")),
            num(r["beats_per_s"]),
            num(r["postgres_cpu_us_per_beat"], 1),
            num(r.get("gateway_cpu_us_per_beat"), 1),
            num(r["wal_bytes_per_beat"]),
            num(r.get("nodes_per_postgres_core")),
            num(r.get("match_p99_ms"), 2),
            num(r.get("quiet_match_p99_ms"), 2),
        )
    summary = bench.summary(results)
    out.print(", ".join(f"{k}: {v}" for k, v in summary.items()))
    report(
        table,
        out_file,
        "heartbeats",
        results,
        summary=summary,
        target="a batched beat <= 1/10 of the per-beat path's Postgres CPU; every node's beats delivered"
        " (400/s at 2,000 nodes); match_job p99 under beats <= 1.5x quiet",
    )


@app.command("realtime")
@friendly_errors
def realtime(
    ctx: typer.Context,
    subscribers: Annotated[
        str, typer.Option(envvar="NEURALGRID_BENCH_SUBSCRIBERS", help="Subscriber counts, comma-separated.")
    ] = "1,100,1000",
    rate: Annotated[int, typer.Option(help="Status changes per second.", min=1)] = 100,
    seconds: Annotated[float, typer.Option(help="Seconds of changes per case.", min=1)] = 10,
    viewers: Annotated[
        str, typer.Option(help="Map viewers per feed (the summary, and the row changes it replaced).")
    ] = "1,100",
    out_file: OutFile = Path("bench-results/realtime.json"),
) -> None:
    """Delivery latency from a committed node status change to N Realtime subscribers; then messages
    a second per map viewer while nodes change, on the map's summary and on the row feed it replaced."""
    from neuralgrid.bench import realtime as bench

    counts, viewer_counts = integers(subscribers, "--subscribers"), integers(viewers, "--viewers")
    results, seen = bench.run(database_url(ctx), counts, rate, seconds, progress, viewer_counts)
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
    print_table(table)
    table = Table("feed", "viewers", "changes/s", "msgs/s per viewer", "bytes/s per viewer")
    for v in seen:
        table.add_row(
            v["feed"],
            str(v["viewers"]),
            f"{v['changes_per_s']:.0f}",
            f"{v['messages_per_s_per_viewer']:.2f}",
            f"{v['bytes_per_s_per_viewer']:,.0f}",
        )
    target = "p99 <= 200 ms at 1,000 subscribers, 100 changes/s; <= 10 messages/s per map viewer"
    report(table, out_file, "realtime", results, units="ms", target=target, viewers=seen)


@app.command("health")
@friendly_errors
def health(
    ctx: typer.Context,
    requests: Annotated[
        int, typer.Option(envvar="NEURALGRID_BENCH_REQUESTS", help="Requests per tunnel/direct case.", min=1)
    ] = 300,
    out_file: OutFile = Path("bench-results/health.json"),
) -> None:
    """Time from a node's death to offline and to requests avoiding it; tunnel overhead vs direct."""
    from neuralgrid.bench import health as bench

    result = bench.run(database_url(ctx), requests, progress=progress)
    t = result["tunnel_vs_direct"]
    tunnel_p50, direct_p50 = t["tunnel"]["sequential"]["p50_ms"], t["direct"]["sequential"]["p50_ms"]
    table = Table(
        "death",
        "to offline s",
        "first served elsewhere s",
        "first request avoiding it s",
        caption=f"tunnel vs direct: p50 {tunnel_p50:.2f} vs {direct_p50:.2f} ms"
        f" (added {t['added_p50_ms']:.2f} ms); streams x16:"
        f" {t['tunnel']['stream_x16_rps']:,.0f} vs {t['direct']['stream_x16_rps']:,.0f} req/s",
    )
    for scenario, r in result["deaths"].items():
        table.add_row(scenario, *(f"{v:.2f}" if v is not None else "never" for v in r.values()))
    targets = "silent node offline <= 15 s; dropped tunnel <= 1 s"
    report(table, out_file, "health", [result], targets=targets)


@app.command("sse")
@friendly_errors
def sse(
    rounds: Annotated[
        int, typer.Option(envvar="NEURALGRID_BENCH_ROUNDS", help="Runs per shape (the least is kept).", min=1)
    ] = 5,
    out_file: OutFile = Path("bench-results/sse.json"),
) -> None:
    """CPU of the gateway's SSE reader by stream shape; a 15 MiB event in pieces against in one read."""
    from neuralgrid.bench import stream_reader as bench

    result = bench.run(rounds, progress=progress)
    table = Table(
        "stream",
        "MiB",
        "cpu ms",
        "cpu ms per MiB",
        caption=f"a 15 MiB event in 64 KiB pieces / in one read: {result['pieces_over_whole']:.2f}x",
    )
    for r in result["shapes"]:
        table.add_row(r["shape"], f"{r['mib']:.2f}", f"{r['cpu_ms']:.1f}", f"{r['cpu_ms_per_mib']:.1f}")
    report(table, out_file, "sse", [result], target="pieces_over_whole near 1: each byte read once")


@app.command("calibrate")
def calibrate(
    url: Annotated[
        str | None, typer.Option(help="An OpenAI-compatible server's base URL (http://host:port).")
    ] = None,
    serve_built: Annotated[
        bool,
        typer.Option(
            "--serve-built",
            help="Instead of --url: the llama-server scripts/backends.sh built, on loopback, for the run.",
        ),
    ] = False,
    model: Annotated[
        str | None, typer.Option(help="The model to ask for; default: the server's first.")
    ] = None,
    parallel: Annotated[
        str, typer.Option(help="Requests at once, comma-separated; 1 is always measured (the baseline).")
    ] = "1,2,4,8",
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length, in the server's tokens.", min=1)] = 200,
    output_tokens: Annotated[int, typer.Option(help="Tokens to generate per request.", min=2)] = 128,
    rounds: Annotated[int, typer.Option(help="Rounds of p requests per parallelism.", min=1)] = 3,
    out_file: OutFile = Path("bench-results/batching.json"),
) -> None:
    """Per-stream and aggregate decode speed by requests at once, and prefill speed, of a real server:
    the simulator's batching model (`--out neuralgrid/sim/data/batching.json` replaces its file)."""
    from neuralgrid.bench import calibrate as bench

    levels = integers(parallel, "--parallel")
    if (url is None) == (not serve_built):
        raise fail("give --url or --serve-built (one of them)")
    try:
        with ExitStack() as stack:
            pids: list[int] = []
            if serve_built:
                # llama.cpp splits -c among its slots: each gets room for a whole request, and more.
                context = max(2048, 2 * (prompt_tokens + output_tokens))
                served = stack.enter_context(bench.serve_built(max(levels), context))
                url, pids = served.url, [served.pid]
            assert url is not None
            result = bench.calibrate(
                url, model, levels, prompt_tokens, output_tokens, rounds, progress=progress, server_pids=pids
            )
    except bench.CalibrationError as err:
        raise fail(str(err)) from err
    raw = result["raw"]
    table = Table(
        "parallel",
        "per-stream tok/s",
        "rel",
        "aggregate tok/s",
        "rel",
        "TTFT p50 ms",
        "prefill tok/s",
        "server CPU",
        caption=f"{result['model']} on {result['measured_on']}; prompts of {raw['prompt_tokens']} tokens,"
        f" {raw['output_tokens']} out; each level's fastest of {raw['rounds']} rounds; prefill: a round's"
        " uncached prompt tokens over its slowest first token",
    )
    for level, per_stream, aggregate in zip(
        raw["by_parallel"], result["per_stream_rel"], result["aggregate_rel"], strict=True
    ):
        cpu = level["server_cpu_cores"]
        table.add_row(
            str(level["parallel"]),
            f"{level['per_stream_tokens_per_s']:.1f}",
            f"{per_stream:.2f}",
            f"{level['aggregate_tokens_per_s']:.1f}",
            f"{aggregate:.2f}",
            f"{level['ttft_p50_ms']:.0f}",
            f"{level['prefill_tokens_per_s']:.0f}",
            "-" if cpu is None else f"{cpu:.2f} cores",
        )
    print_table(table)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result, indent=2) + "\n")
    out.print(f"wrote {out_file}")
