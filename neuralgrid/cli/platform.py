"""The platform's commands: `up`, `status`, `signin`, `watch` and `db …`."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from neuralgrid.cli.common import (
    Options,
    StartupProgress,
    database_url,
    fail,
    friendly_errors,
    log_to_stderr,
    out,
    settings,
    stops_with,
)

if TYPE_CHECKING:
    import socket

    from neuralgrid.server.settings import Settings

db_app = typer.Typer(no_args_is_help=True, help="The database: migrations, its URL, stopping it.")


def up(
    ctx: typer.Context,
    demo: Annotated[
        int,
        typer.Option(
            envvar="NEURALGRID_DEMO", help="Run N demo nodes (the demo fleet, backed by a fake node)."
        ),
    ] = 0,
    host: Annotated[str | None, typer.Option(envvar="NEURALGRID_HOST", help="Gateway address.")] = None,
    port: Annotated[
        int | None,
        typer.Option(envvar="NEURALGRID_PORT", help="Gateway port (0: any free one).", min=0, max=65535),
    ] = None,
) -> None:
    """Start the platform: database, migrations, gateway and health sweeper (Ctrl-C stops it)."""
    from neuralgrid.db import connect
    from neuralgrid.dev.demo import DEMO_NODES
    from neuralgrid.server.run import serve
    from neuralgrid.server.serving import run_fast

    options: Options = ctx.obj
    chosen = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    config = options.configured.model_copy(update=chosen)  # never the running stack's: this is a new one
    if not 0 <= demo <= DEMO_NODES:
        raise fail(f"--demo takes 0 to {DEMO_NODES} nodes")
    listener = _listen(config)  # first: a taken port fails before the database starts
    progress = StartupProgress()
    server = connect.embedded_server(config) if config.embedded else None
    if server is not None:  # the port it runs on (or last ran on): the one the stack records
        config = config.model_copy(update={"db_port": server.port})
    started_here = server is not None and not server.is_running()
    try:
        url = connect.prepare(config, progress)
        log_to_stderr()
        run_fast(serve(config, url, demo, _say, listener, progress))
    finally:
        listener.close()
        if server is not None and started_here and server.is_running():  # leave others' servers alone
            server.stop()
            out.print("stopped the embedded database")


def _say(line: str) -> None:
    out.print(line, soft_wrap=True)


def _listen(config: Settings) -> socket.socket:
    """The gateway's socket, or one line that names the port and what to do."""
    import errno

    from neuralgrid.server import running
    from neuralgrid.server.run import listen

    where = f"{config.host}:{config.port}"
    try:
        return listen(config.host, config.port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            stack = running.find(config)
            holder = (
                f"`neuralgrid up` (pid {stack.pid}) serves it already"
                if stack is not None and stack.port == config.port
                else "another program holds it"
            )
            reason = f"the port is in use ({holder}); pick another with --port (or NEURALGRID_PORT)"
        elif err.errno == errno.EACCES:
            reason = "permission denied (ports below 1024 need root); pick another with --port"
        else:
            reason = f"{err.strerror or err}; check --host (or NEURALGRID_HOST)"
        raise fail(f"cannot start the gateway on {where}: {reason}") from err


def status(
    ctx: typer.Context,
    output: Annotated[str, typer.Option("--output", "-o", help="pretty, json or env.")] = "pretty",
) -> None:
    """Print whether the stack runs, with its URLs and keys, as `supabase status` does.

    The API, map, Realtime and database URLs, the JWT secret, the anon and service_role keys. When
    no `neuralgrid up` runs from this home: one line and a non-zero exit."""
    from neuralgrid.db import connect
    from neuralgrid.server import stack

    config = settings(ctx)
    if output not in ("pretty", "json", "env"):
        raise fail("--output takes pretty, json or env")
    state, running_now = _running_state(config)
    if not running_now:  # a stack that is gone has no URLs to print, and a script must see it failed
        raise fail(state)
    info = stack.status(config, connect.database_url(config, start=False))
    if output == "json":
        print(json.dumps(info, indent=2))
    elif output == "env":
        for name, value in info.items():
            print(f'{name}="{value}"')
    else:
        out.print(state, highlight=False, soft_wrap=True)
        width = max(len(n) for n in info)
        for name, value in info.items():
            out.print(f"{name.replace('_', ' ').lower():>{width}}: {value}", highlight=False, soft_wrap=True)


def _running_state(config: Settings) -> tuple[str, bool]:
    """One line on the stack `neuralgrid up` runs from this home (or ran: a stale record), and whether
    it runs."""
    from neuralgrid.server import running

    recorded = running.read(config)
    if recorded is not None and recorded.alive:
        since = recorded.started_at.replace("T", " ").replace("+00:00", " UTC")
        return f"running: `neuralgrid up` (pid {recorded.pid}) since {since}, at {recorded.gateway_url}", True
    start = "start it with `neuralgrid up`"
    if recorded is not None:
        path = running.state_file(config)
        return f"not running: the stack recorded in {path} (pid {recorded.pid}) is gone; {start}", False
    return f"not running: no `neuralgrid up` runs from {config.home}; {start}", False


def signin(ctx: typer.Context) -> None:
    """Print a fresh one-time sign-in link for the local owner (`up` prints one at start)."""
    from neuralgrid.web.signin import LOCAL_OWNER_EMAIL

    print_signin_link(settings(ctx), LOCAL_OWNER_EMAIL)


def print_signin_link(config: Settings, email: str) -> None:
    """A one-time link that signs in this user, on stdout alone (for scripts); where no gateway runs
    from this home yet, a line on stderr says when it will work."""
    from neuralgrid.server import stack
    from neuralgrid.web.signin import signin_link

    base_url = stack.public_base_url(config)
    link = signin_link(config, base_url, email)
    if link is None:
        raise fail(
            "this stack signs in through Supabase Auth (NEURALGRID_SUPABASE_URL): use the page's email form"
        )
    state, running_now = _running_state(config)
    if not running_now:
        Console(stderr=True).print(
            f"{state}; the link works on {base_url} once a gateway serves there (for 10 minutes)",
            highlight=False,
            soft_wrap=True,
        )
    print(link)


def watch(
    ctx: typer.Context,
    heartbeats: Annotated[
        bool,
        typer.Option(
            help="Also print every change of a node's row (postgres_changes): a heartbeat that changes"
            " nothing writes none."
        ),
    ] = False,
    count: Annotated[int | None, typer.Option(help="Exit after this many events.", min=1)] = None,
    timeout: Annotated[float | None, typer.Option(help="Exit after this many seconds.", min=0)] = None,
) -> None:
    """Print the fleet as it stands, then its live feed (node status and health changes) through
    Supabase Realtime."""
    from websockets.exceptions import WebSocketException

    from neuralgrid.realtime.watch import watch as watch_feed
    from neuralgrid.server import stack

    config = settings(ctx)
    state, running_now = _running_state(config)
    named = bool({"host", "port"} & config.model_fields_set) or config.supabase_url is not None
    if not running_now and not named:  # fail now, not after the Realtime client's retries
        raise fail(f"{state} (or name a gateway with NEURALGRID_HOST and NEURALGRID_PORT)")
    info = stack.status(config, "")
    _print_fleet(info["MAP_URL"])
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
    except (OSError, ConnectionError, WebSocketException) as err:
        raise fail(f"cannot watch {info['REALTIME_URL']}: {err} (is `neuralgrid up` running?)") from err


FLEET_LINES = 1000  # the nodes `watch` prints before the feed, at most


def _print_fleet(map_url: str) -> None:
    """The fleet as it stands, a line a node, before the feed's changes: on a quiet fleet the feed
    says nothing for minutes, which read as a hang. The map's own snapshot, which anyone may read."""
    import httpx

    from neuralgrid.realtime.watch import describe

    url = f"{map_url.rstrip('/')}/api/nodes"
    try:
        reply = httpx.get(url, params={"limit": FLEET_LINES}, timeout=10)
        reply.raise_for_status()
        nodes: list[dict[str, Any]] = reply.json()["data"]
        total = int(reply.json().get("total", len(nodes)))
    except httpx.ConnectError as err:  # nothing listens there: neither will the feed (one line, not two)
        raise fail(f"cannot reach {map_url}: {err} (is `neuralgrid up` running?)") from err
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:  # the feed may still work: say, go on
        warn = Console(stderr=True, highlight=False, soft_wrap=True)
        warn.print(f"cannot read the fleet from {url}: {err}")
        return
    if not nodes:
        print("the fleet has no nodes yet", flush=True)
    for node in nodes:
        print(describe("fleet", {"node": node}), flush=True)
    if total > len(nodes):  # the API pages the fleet (issue 41): a terminal needs no 100,000 lines
        print(f"... and {total - len(nodes):,} more nodes (neuralgrid nodes ls lists them all)", flush=True)


@db_app.command("migrate")
@friendly_errors
def db_migrate(ctx: typer.Context) -> None:
    """Apply the Supabase compatibility layer (only where missing) and pending migrations."""
    import psycopg

    from neuralgrid.db import connect, migrate

    config = settings(ctx)
    stops_with(ctx, config)
    with psycopg.connect(connect.database_url(config), autocommit=True) as conn:
        if migrate.apply_compat_layer(conn):
            out.print("applied the Supabase compatibility layer")
        applied = migrate.migrate(conn)
        if migrate.apply_realtime_feed(conn):
            out.print("installed the embedded Realtime feed")
        sweep = migrate.schedule_sweep(conn)
    for m in applied:
        out.print(f"applied {m.version}_{m.name}")
    if not applied:
        out.print("database is up to date")
    out.print(f"sweeper: {sweep}")


@db_app.command("url")
@friendly_errors
def db_url(ctx: typer.Context) -> None:
    """Print a database URL that psql and the Supabase CLI accept; the embedded database, started
    for it, keeps running (`neuralgrid db stop` stops it)."""
    print(database_url(ctx, keep_running=True))


@db_app.command("stop")
@friendly_errors
def db_stop(ctx: typer.Context) -> None:
    """Stop the embedded database of this home (one `neuralgrid db url` left running, say)."""
    from neuralgrid.db import connect
    from neuralgrid.server import running

    config = settings(ctx)
    if config.database_url:
        raise fail("DATABASE_URL names a database of its own: nothing here runs it")
    if running.find(config) is not None:
        raise fail("`neuralgrid up` runs on this database: stop it (Ctrl-C), and it stops its own")
    server = connect.embedded_server(config)
    if not server.is_running():
        out.print("the embedded database is not running")
        return
    server.stop()
    out.print("stopped the embedded database")


def register(app: typer.Typer) -> None:
    app.command("up")(friendly_errors(up))
    app.command("status")(status)
    app.command("signin")(signin)
    app.command("watch")(watch)
    app.add_typer(db_app, name="db")
