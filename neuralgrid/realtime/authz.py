"""What a subscriber may see, asked of Postgres as the subscriber: its role and JWT claims set for
the transaction, exactly as PostgREST and Supabase Realtime do, so grants and RLS decide. What it
asks, and how, is in realtime/sql.py; here are the answers, cached, and what they mean."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from psycopg_pool import AsyncConnectionPool

from neuralgrid.realtime import sql

CATALOG_TTL_S = 30.0  # grants and keys change with migrations; re-read them now and then


@dataclass(frozen=True, slots=True)
class Access:
    read: bool
    write: bool


@dataclass(frozen=True, slots=True)
class Table:
    schema: str
    name: str
    columns: tuple[tuple[str, str], ...]  # (name, type name) in column order
    primary_key: tuple[str, ...]
    replica_identity_full: bool
    published: bool


class Authorizer:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        self._tables: dict[tuple[str, str], tuple[float, Table | None]] = {}
        self._visible: dict[tuple[str, str, str], tuple[float, frozenset[str]]] = {}
        self._bypass: dict[str, bool] = {}

    async def bypasses_rls(self, role: str) -> bool:
        if role not in self._bypass:
            self._bypass[role] = bool(await sql.first(self.pool, sql.ROLE_BYPASSES_RLS, (role,)))
        return self._bypass[role]

    async def topic_access(self, claims: dict[str, Any], topic: str) -> Access:
        """Read and write rights on a private topic: RLS on realtime.messages, as Supabase decides them."""
        if await self.bypasses_rls(claims["role"]):
            return Access(True, True)
        return Access(*await sql.topic_rights(self.pool, claims, topic))

    async def table(self, schema: str, name: str) -> Table | None:
        cached = self._tables.get((schema, name))
        if cached and time.monotonic() - cached[0] < CATALOG_TTL_S:
            return cached[1]
        columns = await sql.run(self.pool, sql.TABLE_COLUMNS, (schema, name))
        table = (
            Table(
                schema,
                name,
                tuple((c.name, c.type_name) for c in columns),
                tuple(c.name for c in columns if c.in_primary_key),
                columns[0].replica_identity_full,
                columns[0].published,
            )
            if columns
            else None
        )
        self._tables[(schema, name)] = (time.monotonic(), table)
        return table

    async def visible_columns(self, role: str, table: Table) -> frozenset[str]:
        """The columns `role` may select (column grants included), as Realtime filters them."""
        key = (role, table.schema, table.name)
        cached = self._visible.get(key)
        if cached and time.monotonic() - cached[0] < CATALOG_TTL_S:
            return cached[1]
        visible = frozenset(
            await sql.run(self.pool, sql.SELECTABLE_COLUMNS, (table.schema, table.name, role))
        )
        self._visible[key] = (time.monotonic(), visible)
        return visible

    async def row_visible(self, claims: dict[str, Any], table: Table, record: dict[str, Any]) -> bool:
        """Whether the subscriber's SELECT (RLS included) finds the changed row, by primary key."""
        if await self.bypasses_rls(claims["role"]):
            return True
        if not table.primary_key:
            return False  # Supabase cannot check RLS without a key either
        key = {c: record.get(c) for c in table.primary_key}
        return await sql.row_visible(self.pool, claims, table.schema, table.name, key)
