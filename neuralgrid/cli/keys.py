"""`neuralgrid keys …`: developers' API keys, as the service."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from neuralgrid.cli.common import database, friendly_errors, out, progress, settings
from neuralgrid.cli.fleet import JsonOption

app = typer.Typer(no_args_is_help=True, help="Developer API keys (shown in clear once, stored hashed).")


@app.command("create")
@friendly_errors
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option(envvar="NEURALGRID_KEY_NAME", help="A name to recognise it by.")],
    rpm: Annotated[int | None, typer.Option(envvar="NEURALGRID_KEY_RPM", help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(envvar="NEURALGRID_KEY_TPM", help="Tokens per minute.")] = None,
    budget_usd: Annotated[
        float | None, typer.Option(envvar="NEURALGRID_KEY_BUDGET_USD", help="Spending cap in USD.")
    ] = None,
    owner: Annotated[
        str | None,
        typer.Option(
            envvar="NEURALGRID_KEY_OWNER",
            help="The user it belongs to, by email or id (default: the local owner `signin` signs in).",
        ),
    ] = None,
) -> None:
    """Create a key and print it: this is the only time it is shown.

    It belongs to a user (--owner; by default the local owner): their API keys page lists it, and the
    nodes registered with it are theirs."""
    from neuralgrid.admin import keys
    from neuralgrid.web.signin import LOCAL_OWNER_EMAIL

    config = settings(ctx)
    with database(ctx) as conn:
        if owner is not None:
            owner_id, whose = keys.find_user(conn, owner), owner
        elif config.supabase_url:  # Supabase Auth signs users in: there is no local owner
            owner_id, whose = None, ""
        else:
            owner_id, whose = keys.local_owner(conn, create=config.embedded), LOCAL_OWNER_EMAIL
        row = keys.create(conn, name, rpm, tpm, budget_usd, owner_id)
    if owner_id is None:
        why = (
            "this stack signs users in through Supabase Auth (NEURALGRID_SUPABASE_URL)"
            if config.supabase_url
            else f"this database has no local owner yet ({LOCAL_OWNER_EMAIL} appears at the first sign-in"
            " with a `neuralgrid signin` link; it is never made up in a database not the embedded one)"
        )
        progress(
            f"note: the key belongs to no user, since {why}: no API keys page lists it and nodes"
            " registered with it belong to nobody; --owner EMAIL gives it to a user"
        )
        whose = "the service"
    shown = f"created key {row.prefix}… ({row.id}) for {whose}; it is shown once, keep it safe:"
    out.print(shown, soft_wrap=True)
    print(row.api_key)


@app.command("ls")
@friendly_errors
def ls(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """List keys (never the keys themselves): limits, spend, last use, revocation."""
    from neuralgrid.admin import fleet, keys

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


@app.command("revoke")
@friendly_errors
def revoke(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="The key's id or prefix (as `keys ls` shows).")],
) -> None:
    """Revoke a key; every gateway refuses it within a second."""
    from neuralgrid.admin import keys

    with database(ctx) as conn:
        revoked = keys.revoke(conn, key)
    out.print(f"revoked {revoked}")
