"""The platform's commands: `up`, `status`, `signin`, `watch` and `db …`."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import typer

from neuralgrid.cli.common import database_url, fail, friendly_errors, log_to_stderr, out, settings

db_app = typer.Typer(no_args_is_help=True, help="The database: migrations and its URL.")


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
    from neuralgrid.db import connect
    from neuralgrid.dev.demo import DEMO_NODES
    from neuralgrid.server.run import serve
    from neuralgrid.server.serving import run_fast

    chosen = {k: v for k, v in {"host": host, "port": port}.items() if v}
    config = settings(ctx).model_copy(update=chosen)
    if not 0 <= demo <= DEMO_NODES:
        raise fail(f"--demo takes 0 to {DEMO_NODES} nodes")
    server = connect.embedded_server(config) if config.embedded else None
    started_here = server is not None and not server.is_running()
    url = connect.prepare(config)
    log_to_stderr()
    try:
        run_fast(serve(config, url, demo, lambda line: out.print(line, soft_wrap=True)))
    finally:
        if server is not None and started_here:  # leave a server someone else started alone
            server.stop()
            out.print("stopped the embedded database")


def status(
    ctx: typer.Context,
    output: Annotated[str, typer.Option("--output", "-o", help="pretty, json or env.")] = "pretty",
) -> None:
    """Print the stack's URLs and keys (API, Realtime, database, anon and service_role), as
    `supabase status` does."""
    from neuralgrid.db import connect
    from neuralgrid.server import stack

    config = settings(ctx)
    if output not in ("pretty", "json", "env"):
        raise fail("--output takes pretty, json or env")
    info = stack.status(config, connect.database_url(config, start=False))
    if output == "json":
        print(json.dumps(info, indent=2))
    elif output == "env":
        for name, value in info.items():
            print(f'{name}="{value}"')
    else:
        width = max(len(n) for n in info)
        for name, value in info.items():
            out.print(f"{name.replace('_', ' ').lower():>{width}}: {value}", highlight=False, soft_wrap=True)
        if config.embedded and not connect.embedded_server(config).is_running():
            out.print("the embedded database is not running: start the stack with `neuralgrid up`")


def signin(ctx: typer.Context) -> None:
    """Print a fresh one-time sign-in link for the local owner (`up` prints one at start)."""
    from neuralgrid.server import stack
    from neuralgrid.web.signin import signin_link

    config = settings(ctx)
    link = signin_link(config, stack.public_base_url(config))
    if link is None:
        raise fail(
            "this stack signs in through Supabase Auth (NEURALGRID_SUPABASE_URL): use the page's email form"
        )
    print(link)


def watch(
    ctx: typer.Context,
    heartbeats: Annotated[bool, typer.Option(help="Also print every heartbeat (postgres_changes).")] = False,
    count: Annotated[int | None, typer.Option(help="Exit after this many events.", min=1)] = None,
    timeout: Annotated[float | None, typer.Option(help="Exit after this many seconds.", min=0)] = None,
) -> None:
    """Print the fleet's live feed (node status and health changes) through Supabase Realtime."""
    from neuralgrid.realtime.watch import watch as watch_feed
    from neuralgrid.server import stack

    info = stack.status(settings(ctx), "")
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


@db_app.command("migrate")
@friendly_errors
def db_migrate(ctx: typer.Context) -> None:
    """Apply the Supabase compatibility layer (only where missing) and pending migrations."""
    import psycopg

    from neuralgrid.db import connect, migrate

    with psycopg.connect(connect.database_url(settings(ctx)), autocommit=True) as conn:
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
    print(database_url(ctx))


def register(app: typer.Typer) -> None:
    app.command("up")(friendly_errors(up))
    app.command("status")(status)
    app.command("signin")(signin)
    app.command("watch")(watch)
    app.add_typer(db_app, name="db")
