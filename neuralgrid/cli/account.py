"""`neuralgrid login` and `logout`: the CLI as a signed-in user of a hosted Supabase project.

Once signed in, `keys`, `nodes ls`, `node earnings`, `node verify` and `keys usage` go through the
project's Data API as that user (neuralgrid/hosted.py), with no database password; `logout` returns
them to the database (DATABASE_URL, or the embedded stack)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ParamSpec, TypeVar

import typer

from neuralgrid.cli.common import fail, out, progress

if TYPE_CHECKING:
    from neuralgrid.hosted import DataApi

DEFAULT_HOME = "~/.neuralgrid"
P = ParamSpec("P")
R = TypeVar("R")


def hosted_errors(command: Callable[P, R]) -> Callable[P, R]:
    """A hosted project's refusals (wrong password, expired session, unreachable, RLS) as one line."""

    @wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from neuralgrid.hosted import HostedError

        try:
            return command(*args, **kwargs)
        except HostedError as err:
            raise fail(str(err)) from err

    return wrapper


def home(ctx: typer.Context) -> Path:
    """NEURALGRID_HOME as the option or the environment gives it; read without the server's settings,
    which a developer's or GPU owner's install does not have."""
    chosen = ctx.obj.overrides.get("NEURALGRID_HOME") or os.environ.get("NEURALGRID_HOME") or DEFAULT_HOME
    return Path(chosen).expanduser()


def signed_in(ctx: typer.Context) -> DataApi | None:
    """The Data API as the signed-in user when `login` stored a session here; else None (the
    commands then use the database)."""
    from neuralgrid import hosted

    if not hosted.session_path(home(ctx)).exists():  # no import of supabase-py for the database path
        return None
    return hosted.signed_in(home(ctx))


@hosted_errors
def login(
    ctx: typer.Context,
    project: Annotated[
        str,
        typer.Option(envvar="NEURALGRID_SUPABASE_URL", help="The project's URL: https://<ref>.supabase.co"),
    ],
    key: Annotated[
        str,
        typer.Option(
            envvar="NEURALGRID_SUPABASE_ANON_KEY",
            help="The project's publishable key (sb_publishable_…) or legacy anon key.",
        ),
    ],
    email: Annotated[str, typer.Option(envvar="NEURALGRID_EMAIL", help="Your email on the project.")],
    password_stdin: Annotated[
        bool, typer.Option("--password-stdin", help="Read the password from standard input.")
    ] = False,
    otp: Annotated[
        bool, typer.Option("--otp", help="Email me a one-time code instead, and ask for it.")
    ] = False,
) -> None:
    """Sign in to a hosted Supabase project; the session (refreshed as it expires) is kept in
    NEURALGRID_HOME/session.json, readable by you alone."""
    from neuralgrid import hosted

    if password_stdin and otp:
        raise fail("--password-stdin and --otp: choose one way to sign in")
    where, state = hosted.Project(project.rstrip("/"), key.strip()), home(ctx)
    if otp:
        hosted.send_code(where, email)
        code = typer.prompt(f"the code {where.url} emailed to {email}")
        who = hosted.sign_in_with_code(state, where, email, code)
    else:
        password = _read_password() if password_stdin else typer.prompt("password", hide_input=True)
        who = hosted.sign_in_with_password(state, where, email, password)
    out.print(f"signed in to {where.url} as {who}", highlight=False)
    progress(f"session kept in {hosted.session_path(state)}; `neuralgrid logout` ends it")


def _read_password() -> str:
    password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise fail("--password-stdin: standard input gave no password")
    return password


@hosted_errors
def logout(ctx: typer.Context) -> None:
    """Sign out of the hosted project: this device's session ends there and is forgotten here."""
    from neuralgrid import hosted

    ended = hosted.sign_out(home(ctx))
    if ended is None:
        out.print(f"no one is signed in from {home(ctx)}", highlight=False)
        return
    project, untold = ended
    out.print(f"signed out of {project}", highlight=False)
    if untold is not None:
        progress(f"note: the session is forgotten here, but the project was not told ({untold})")
