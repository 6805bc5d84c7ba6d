"""`neuralgrid users …`: the users of a stack that signs them in with one-time links (the embedded
one): the local owner, and those added here, each with a link of their own. On a hosted Supabase
project users sign up through Supabase Auth, and these commands say so."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from neuralgrid.cli.account import home
from neuralgrid.cli.common import database, fail, friendly_errors, out, print_table, settings
from neuralgrid.cli.fleet import Column, JsonOption, column_table, print_json
from neuralgrid.cli.platform import print_signin_link

if TYPE_CHECKING:
    from neuralgrid.server.settings import Settings

app = typer.Typer(
    no_args_is_help=True, help="Users of the embedded stack: add one (with a sign-in link), list them."
)

_SUPABASE_AUTH = (
    "users sign up through Supabase Auth there, with the sign-in page's email form; the project's"
    " dashboard lists them (Authentication > Users)"
)


def _signing_in_with_links(ctx: typer.Context) -> Settings:
    """The settings of a stack whose users sign in with links, or one line where Supabase Auth signs
    them in: a row written into a hosted project's auth.users would be a user its Auth never made."""
    from neuralgrid import hosted

    if hosted.session_path(home(ctx)).exists():
        raise fail(f"signed in to a hosted project (`neuralgrid login`): {_SUPABASE_AUTH}")
    config = settings(ctx)
    if config.supabase_url:
        raise fail(f"this stack is a hosted Supabase project ({config.supabase_url}): {_SUPABASE_AUTH}")
    return config


@app.command("add")
@friendly_errors
def add(
    ctx: typer.Context,
    email: Annotated[str, typer.Argument(help="The user's email address.")],
) -> None:
    """Add a user (if new) and print a one-time sign-in link for them (valid once, for 10 minutes).

    Their keys: `neuralgrid keys create --owner EMAIL`. Run it again for a fresh link."""
    from neuralgrid.admin import users

    config = _signing_in_with_links(ctx)
    address = users.email_address(email)
    with database(ctx) as conn:
        user_id, made = users.add_user(conn, address)
    said = f"added {address}" if made else f"{address} is already a user"
    for line in (
        f"{said} ({user_id}); keys for them: `neuralgrid keys create --owner {address}`",
        f"a sign-in link for {address}, valid once for 10 minutes:",
    ):
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    print_signin_link(config, address)


_USERS = (
    Column("email", lambda r: r["email"] or "(none)"),
    Column("keys", lambda r: str(r["keys"])),
    Column("nodes", lambda r: str(r["nodes"])),
    Column("since", lambda r: str(r["created_at"])[:10]),
)


@app.command("ls")
@friendly_errors
def ls(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """List the users: their active keys and their nodes (--json: with their ids)."""
    from neuralgrid.admin import users

    _signing_in_with_links(ctx)
    with database(ctx) as conn:
        rows: list[dict[str, Any]] = users.list_users(conn)
    if as_json:
        print_json(rows)
    elif not rows:
        out.print("no users yet: the local owner appears at its first sign-in; `neuralgrid users add EMAIL`")
    else:
        print_table(column_table(rows, _USERS), narrow=True)
