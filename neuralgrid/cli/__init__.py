"""The `neuralgrid` command: one group per part of the platform, assembled here."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Annotated, Any

import typer

from neuralgrid.cli import (
    account,
    bench,
    bench_gateway,
    bench_map,
    bench_verify,
    dev,
    fleet,
    keys,
    models,
    node,
    platform,
    referee,
    sim,
    users,
)
from neuralgrid.cli.bench_world import register as register_bench_world
from neuralgrid.cli.common import OneLineErrors, Options

HELP = (
    "NeuralGrid: route OpenAI-compatible inference to other people's GPUs. `neuralgrid up` runs the"
    " platform on this machine; the other commands talk to it."
)
app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    help=HELP,
    pretty_exceptions_show_locals=False,
)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"neuralgrid {importlib.metadata.version('neuralgrid')}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    home: Annotated[
        Path | None,
        typer.Option(envvar="NEURALGRID_HOME", help="State directory: the embedded DB, the running stack."),
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(envvar="DATABASE_URL", help="Use this Postgres instead of the embedded one."),
    ] = None,
    db_port: Annotated[
        int | None, typer.Option(envvar="NEURALGRID_DB_PORT", help="Embedded Postgres TCP port.")
    ] = None,
    _version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    chosen: dict[str, Any] = {
        "NEURALGRID_HOME": home,
        "DATABASE_URL": database_url,
        "NEURALGRID_DB_PORT": db_port,
    }
    ctx.obj = Options({k: v for k, v in chosen.items() if v is not None})


platform.register(app)
app.command("login")(account.login)
app.command("logout")(account.logout)
app.command("match")(fleet.match)
app.command("simulate")(sim.simulate)
app.command("fake-node")(dev.fake_node)
app.command("referee")(referee.referee)
app.add_typer(fleet.nodes_app, name="nodes")
app.add_typer(node.app, name="node")
app.add_typer(models.app, name="models")
app.add_typer(keys.app, name="keys")
app.add_typer(users.app, name="users")
bench_gateway.register(bench.app)
bench_map.register(bench.app)
bench_verify.register(bench.app)
register_bench_world(bench.app)
app.add_typer(bench.app, name="bench")
