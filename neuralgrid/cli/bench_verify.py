"""`neuralgrid bench verify`: model verification against real honest and cheating servers (issue 39).
A command of the `bench` group, kept apart from cli/bench.py for its length."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from neuralgrid.cli.common import database_url, fail, friendly_errors, out, progress, report

TARGET = (
    "0 honest nodes flagged over 2,000 challenges; pruned, sampling and canned flagged within 3 challenges,"
    " requantized within 20; challenges at most 1% of a node's tokens; an honest node forfeits nothing"
)


@friendly_errors
def bench_verify(
    ctx: typer.Context,
    honest: Annotated[int, typer.Option(help="Challenges the honest nodes take between them.", min=1)] = 2000,
    cheat_cap: Annotated[
        int, typer.Option(help="Challenges at most for a cheat not flagged by then.", min=1)
    ] = 40,
    minutes: Annotated[
        float | None, typer.Option(help="Stop after this long, whatever was reached (the report says what).")
    ] = None,
    cross_checks: Annotated[
        bool,
        typer.Option(
            "--cross-checks",
            help="No referee: the nodes are checked against each other (written to cross_checks.json).",
        ),
    ] = False,
    out_file: Annotated[
        Path | None, typer.Option("--out", help="Where to write the JSON report.", dir_okay=False)
    ] = None,
) -> None:
    """Honest servers (llama-server with four slots, llama-cpp-python) under load and six cheats built
    from the same GGUF, each behind an agent, challenged by a gateway with a referee until the honest
    nodes have taken --honest challenges and every cheat is flagged or has taken --cheat-cap: the state
    SQL reached for each, after how many challenges, the share failed, the distances of failures,
    what was paid and forfeited, the referee's CPU and what challenges cost a node. With
    --cross-checks, no referee: each node is checked against two others serving the same file."""
    from neuralgrid.bench import verification as bench

    try:
        results = bench.run(
            database_url(ctx), honest, cheat_cap, minutes, progress=progress, cross_checks=cross_checks
        )
    except RuntimeError as err:
        raise fail(str(err)) from err
    table = Table(
        "node", "state", "challenges", "failed", "flagged after", "failure distance", "paid", "forfeited"
    )
    for r in results["nodes"]:
        distance = r["distance_of_failures"]
        table.add_row(
            r["node"],
            r["state"],
            str(r["challenges"]),
            f"{r['failed']} ({r['failed_share']:.0%})" if r["failed_share"] is not None else "0",
            str(r["flagged_after"] or "-"),
            "-" if distance is None else f"{distance[0]}..{distance[1]} logits",
            str(r.get("paid_jobs", 0)),
            str(r.get("forfeited_jobs", 0)),
        )
    cost = results["cost"]
    name = "cross_checks" if cross_checks else "verification"
    report(
        table,
        out_file or Path(f"bench-results/{name}.json"),
        name,
        results["nodes"],
        cost=cost,
        referee_cpu_s=results["referee_cpu_s"],
        honest_challenges=sum(r["challenges"] for r in results["nodes"] if r["honest"]),
        honest_failures=results["honest_failures"],  # each with what it asked, the answer, its gaps
        target=TARGET,
    )
    capacity = cost["capacity"]
    out.print(
        f"a challenge: {cost['prompt_tokens_per_challenge']} prompt and"
        f" {cost['completion_tokens_per_challenge']} answer tokens, {cost['node_seconds_per_challenge']} s"
        f" of the honest llama-server at its capacity ({capacity['prompt_tokens_per_s']} prompt,"
        f" {capacity['completion_tokens_per_s']} answer tokens/s):"
        f" verified {cost['capacity_share_verified']:.3%} of its time,"
        f" unverified {cost['capacity_share_unverified']:.2%};"
        f" the referee's CPU per challenge: {results['referee_cpu_s']}"
    )


def register(app: typer.Typer) -> None:
    app.command("verify")(bench_verify)
