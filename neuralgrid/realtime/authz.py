"""What a subscriber may see, asked of Postgres as the subscriber: its role and JWT claims set for
the transaction, exactly as PostgREST and Supabase Realtime do, so grants and RLS decide."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from neuralgrid.db.roles import act_as

CATALOG_TTL_S = 30.0
# A message on the topic being authorized: written as the server, it is what the subscriber's SELECT
# policies must see; written as the subscriber, what its INSERT policies must allow.
PROBE = (
    "insert into realtime.messages (topic, extension, event, private)"
    " values (%s, 'broadcast', 'authorization-probe', true)"
)  # grants and keys change with migrations; re-read them now and then


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

    @asynccontextmanager
    async def as_subscriber(self, claims: dict[str, Any]) -> AsyncIterator[psycopg.AsyncConnection]:
        """A transaction acting as the subscriber, always rolled back."""
        async with self.pool.connection() as conn, conn.transaction(force_rollback=True):
            await act_as(conn, claims)
            yield conn

    async def bypasses_rls(self, role: str) -> bool:
        if role not in self._bypass:
            async with self.pool.connection() as conn:
                row = await (
                    await conn.execute(
                        "select rolbypassrls or rolsuper from pg_roles where rolname = %s", (role,)
                    )
                ).fetchone()
            self._bypass[role] = bool(row and row[0])
        return self._bypass[role]

    async def topic_access(self, claims: dict[str, Any], topic: str) -> Access:
        """Read and write rights on a private topic: RLS on realtime.messages, as Supabase decides them."""
        if await self.bypasses_rls(claims["role"]):
            return Access(True, True)
        async with self.pool.connection() as conn, conn.transaction(force_rollback=True):
            # A probe message, written as the server, that the subscriber's SELECT policies must see.
            row = await (await conn.execute(PROBE + " returning id", (topic,))).fetchone()
            assert row is not None
            await act_as(conn, claims)
            await conn.execute("select set_config('realtime.topic', %s, true)", (topic,))
            seen = await (
                await conn.execute("select exists (select from realtime.messages where id = %s)", (row[0],))
            ).fetchone()
            write = True
            try:
                async with conn.transaction():
                    await conn.execute(PROBE, (topic,))
            except psycopg.errors.InsufficientPrivilege:
                write = False
        return Access(bool(seen and seen[0]), write)

    async def table(self, schema: str, name: str) -> Table | None:
        cached = self._tables.get((schema, name))
        if cached and time.monotonic() - cached[0] < CATALOG_TTL_S:
            return cached[1]
        async with self.pool.connection() as conn:
            rows = await (
                await conn.execute(
                    """
                    select a.attname, t.typname, coalesce(a.attnum = any(i.indkey), false),
                           c.relreplident = 'f',
                           exists (select from pg_publication_tables p where p.pubname = 'supabase_realtime'
                                   and p.schemaname = n.nspname and p.tablename = c.relname)
                    from pg_class c
                    join pg_namespace n on n.oid = c.relnamespace
                    join pg_attribute a on a.attrelid = c.oid and a.attnum > 0 and not a.attisdropped
                    join pg_type t on t.oid = a.atttypid
                    left join pg_index i on i.indrelid = c.oid and i.indisprimary
                    where n.nspname = %s and c.relname = %s
                    order by a.attnum
                    """,
                    (schema, name),
                )
            ).fetchall()
        table = (
            Table(
                schema,
                name,
                tuple((r[0], r[1]) for r in rows),
                tuple(r[0] for r in rows if r[2]),
                bool(rows[0][3]),
                bool(rows[0][4]),
            )
            if rows
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
        async with self.pool.connection() as conn:
            rows = await (
                await conn.execute(
                    "select a.attname from pg_attribute a"
                    " where a.attrelid = format('%%I.%%I', %s::text, %s::text)::regclass and a.attnum > 0"
                    "   and not a.attisdropped and has_column_privilege(%s, a.attrelid, a.attnum, 'SELECT')",
                    (table.schema, table.name, role),
                )
            ).fetchall()
        visible = frozenset(r[0] for r in rows)
        self._visible[key] = (time.monotonic(), visible)
        return visible

    async def row_visible(self, claims: dict[str, Any], table: Table, record: dict[str, Any]) -> bool:
        """Whether the subscriber's SELECT (RLS included) finds the changed row, by primary key."""
        if await self.bypasses_rls(claims["role"]):
            return True
        if not table.primary_key:
            return False  # Supabase cannot check RLS without a key either
        relation = sql.Identifier(table.schema, table.name)
        keys = sql.SQL(", ").join(sql.Identifier(c) for c in table.primary_key)
        query = sql.SQL(
            "select exists (select from {rel} t where ({t_keys}) = "
            "(select {keys} from jsonb_populate_record(null::{rel}, %s::jsonb)))"
        ).format(
            rel=relation,
            keys=keys,
            t_keys=sql.SQL(", ").join(sql.Identifier("t", c) for c in table.primary_key),
        )
        pk = {c: record.get(c) for c in table.primary_key}
        async with self.as_subscriber(claims) as conn:
            row = await (await conn.execute(query, (json.dumps(pk),))).fetchone()
        return bool(row and row[0])
