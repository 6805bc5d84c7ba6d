"""`neuralgrid keys …`: developers' API keys, as the service (through the database), or as the user
`neuralgrid login` signed in (through a hosted project's Data API)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from neuralgrid.cli.account import hosted_errors, signed_in
from neuralgrid.cli.common import database, fail, friendly_errors, out, print_table, progress, settings
from neuralgrid.cli.fleet import Column, JsonOption, column_table, print_json
from neuralgrid.cli.node import MAX_DAYS
from neuralgrid.validation import KEY_BUDGET_MAX_USD, KEY_LIMIT_MAX

if TYPE_CHECKING:
    from neuralgrid.db.queries import CreatedKey

app = typer.Typer(no_args_is_help=True, help="Developer API keys (shown in clear once, stored hashed).")


@app.command("create")
@hosted_errors
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

    It belongs to a user (--owner; by default the local owner, or you when signed in with `neuralgrid
    login`): their API keys page lists it, and the nodes registered with it are theirs."""
    for flag, limit in (("--rpm", rpm), ("--tpm", tpm)):
        if limit is not None and not 1 <= limit <= KEY_LIMIT_MAX:
            raise fail(
                f"{flag} must be a positive whole number, at most {KEY_LIMIT_MAX} (leave it out for no limit)"
            )
    if budget_usd is not None and not 0 <= budget_usd < KEY_BUDGET_MAX_USD:  # NaN too
        raise fail(
            f"--budget-usd must be a number of USD below {KEY_BUDGET_MAX_USD:,} (leave it out for no budget)"
        )
    api = signed_in(ctx)
    if api is None:
        _create_in_database(ctx, name, rpm, tpm, budget_usd, owner)
        return
    if owner is not None:
        raise fail(f"--owner: signed in to {api.project.url}, the keys you create are yours ({api.email})")
    row = api.create_api_key(name, rpm, tpm, budget_usd)
    _print_created(row["prefix"], row["id"], api.email, row["api_key"])


@friendly_errors
def _create_in_database(
    ctx: typer.Context,
    name: str,
    rpm: int | None,
    tpm: int | None,
    budget_usd: float | None,
    owner: str | None,
) -> None:
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
        row: CreatedKey = keys.create(conn, name, rpm, tpm, budget_usd, owner_id)
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
    _print_created(row.prefix, row.id, whose, row.api_key)


def _print_created(prefix: str, key_id: object, whose: str, api_key: str) -> None:
    shown = f"created key {prefix}… ({key_id}) for {whose}; it is shown once, keep it safe:"
    out.print(shown, soft_wrap=True)
    print(api_key)


def _when(value: object, length: int) -> str:
    return str(value)[:length] if value else ""


def _limits(r: dict[str, Any]) -> str:
    return f"{r['rpm_limit'] or '-'}/{r['tpm_limit'] or '-'}"


def _budget(r: dict[str, Any]) -> str:
    """As kept (to a hundredth of a cent), cents at least: 5.00, 0.0001."""
    budget = r["budget_usd"]
    return "-" if budget is None else f"{budget:.4f}".rstrip("0").ljust(len(f"{budget:.2f}"), "0")


# What a key's owner checks first (which key, its limits, what it spent, is it in use) fits 80
# columns; --wide has ids, each limit and exact times.
_KEYS_NARROW = (
    Column("prefix", lambda r: r["prefix"]),
    Column("name", lambda r: r["name"], wraps=True),
    Column("rpm/tpm", _limits),
    Column("spent/budget $", lambda r: f"{r['spent_usd']:.6f}/{_budget(r)}"),
    Column("last used", lambda r: _when(r["last_used_at"], 16) or "never"),
    Column("state", lambda r: "revoked" if r["revoked_at"] else "active"),
)
_KEYS_WIDE = (
    Column("id", lambda r: str(r["id"])),
    Column("name", lambda r: r["name"]),
    Column("prefix", lambda r: r["prefix"]),
    Column("rpm", lambda r: str(r["rpm_limit"] or "-")),
    Column("tpm", lambda r: str(r["tpm_limit"] or "-")),
    Column("budget $", _budget),
    Column("spent $", lambda r: f"{r['spent_usd']:.6f}"),
    Column("last used", lambda r: _when(r["last_used_at"], 19) or "never"),
    Column("revoked", lambda r: _when(r["revoked_at"], 19)),
)


@app.command("ls")
@hosted_errors
def ls(
    ctx: typer.Context,
    as_json: JsonOption = False,
    wide: Annotated[bool, typer.Option("--wide", help="Every column: ids, each limit, exact times.")] = False,
) -> None:
    """List keys (never the keys themselves): limits, spend, last use, revocation (--wide: ids and
    exact times). `keys revoke` takes the prefix shown."""
    api = signed_in(ctx)
    rows = api.api_keys() if api is not None else _keys_in_database(ctx)
    if as_json:
        print_json(rows)
        return
    print_table(column_table(rows, _KEYS_WIDE if wide else _KEYS_NARROW), narrow=not wide)


@friendly_errors
def _keys_in_database(ctx: typer.Context) -> list[dict[str, Any]]:
    from neuralgrid.admin import keys

    with database(ctx) as conn:
        return keys.list_keys(conn)


@app.command("revoke")
@hosted_errors
def revoke(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="The key's id or prefix (as `keys ls` shows).")],
) -> None:
    """Revoke a key; every gateway refuses it within a second."""
    api = signed_in(ctx)
    revoked = api.revoke_api_key(key) if api is not None else _revoke_in_database(ctx, key)
    out.print(f"revoked {revoked}")


@friendly_errors
def _revoke_in_database(ctx: typer.Context, key: str) -> str:
    from neuralgrid.admin import keys

    with database(ctx) as conn:
        return keys.revoke(conn, key)


@app.command("usage")
@hosted_errors
def usage(
    ctx: typer.Context,
    days: Annotated[
        int, typer.Option(envvar="NEURALGRID_USAGE_DAYS", help="The period: the last N days (UTC).")
    ] = 30,
    as_json: JsonOption = False,
) -> None:
    """Your requests per day, key and model: tokens and cost (signed in with `neuralgrid login`)."""
    if not 1 <= days <= MAX_DAYS:
        raise fail(f"--days takes 1 to {MAX_DAYS} (today and the days before it), not {days}")
    api = signed_in(ctx)
    if api is None:
        raise fail(
            "usage is read as a signed-in user: `neuralgrid login --project https://<ref>.supabase.co …`"
            " first (with an API key instead: GET /v1/usage on the gateway)"
        )
    rows = api.usage(days)
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print(f"no requests in the last {days} days (UTC)", highlight=False)
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("day", no_wrap=True)
    table.add_column("key", no_wrap=True)
    table.add_column("model", overflow="fold")
    for header in ("requests", "failed", "tokens in", "tokens out", "cost $"):
        table.add_column(header, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*_usage_cells(r))
    out.print(table)


def _usage_cells(r: dict[str, Any]) -> list[str]:
    key = r["key_name"] or "(deleted key)"
    return [
        str(r["day"]),
        f"{key} {r['key_prefix'] or ''}".strip(),
        r["model_id"],
        str(r["requests"]),
        str(r["failed"]),
        str(r["prompt_tokens"]),
        str(r["completion_tokens"]),
        f"{r['cost_usd']:.6f}",
    ]
