"""`neuralgrid keys …`: developers' API keys, as the service."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from neuralgrid.cli.common import database, friendly_errors, out
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
) -> None:
    """Create a key and print it: this is the only time it is shown."""
    from neuralgrid.admin import keys

    with database(ctx) as conn:
        row = keys.create(conn, name, rpm, tpm, budget_usd)
    out.print(f"created key {row.prefix}… ({row.id}); it is shown once, keep it safe:")
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
