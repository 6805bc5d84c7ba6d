"""API keys from the command line (as the service): create, list, revoke."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row, dict_row

from neuralgrid.db.errors import InvalidRequest, translate

CREATE_KEY = "select id, api_key, prefix from public.create_api_key(%s, %s::int, %s::int, %s::numeric)"


@dataclass(frozen=True)
class CreatedKey:
    id: UUID
    api_key: str
    prefix: str


def create(
    conn: psycopg.Connection, name: str, rpm: int | None, tpm: int | None, budget_usd: float | None
) -> CreatedKey:
    try:
        with conn.cursor(row_factory=class_row(CreatedKey)) as cur:
            row = cur.execute(CREATE_KEY, (name, rpm, tpm, budget_usd)).fetchone()
    except psycopg.Error as err:
        raise translate(err) from err
    assert row is not None
    return row


def list_keys(conn: psycopg.Connection) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            "select id, name, prefix, rpm_limit, tpm_limit, budget_usd::float8 as budget_usd,"
            " spent_usd::float8 as spent_usd, created_at, last_used_at, revoked_at"
            " from public.api_keys order by created_at"
        ).fetchall()


def revoke(conn: psycopg.Connection, id_or_prefix: str) -> str:
    """Revoke one active key by id or by its shown prefix; ambiguity and absence are errors."""
    rows = conn.execute(
        "select id, prefix from public.api_keys where revoked_at is null and (id::text = %s or prefix = %s)",
        (id_or_prefix, id_or_prefix),
    ).fetchall()
    if not rows:
        raise InvalidRequest(f"no active key with id or prefix {id_or_prefix!r}")
    if len(rows) > 1:
        raise InvalidRequest(f"{id_or_prefix!r} matches {len(rows)} keys: use the id")
    conn.execute("update public.api_keys set revoked_at = now() where id = %s", (rows[0][0],))
    return f"{rows[0][1]}… ({rows[0][0]})"
