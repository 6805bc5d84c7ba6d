"""Realtime's own seam to Postgres: every statement the embedded Realtime server runs, named once with
the shape of its rows, and the functions that run them. The hub and the authorizer hold no SQL of
their own (tests/unit/test_seams.py keeps it so).

It stands apart from the platform's seam (db/queries/, run by db/store.py) because it is about other
things, run another way:
- it asks about Postgres itself (the catalog: columns, keys, grants, the publication, roles) and
  about Realtime's own schema (realtime.*), never about the platform's data;
- authorization writes a probe message as the server, then acts as the subscriber (role and JWT
  claims set for the transaction, as Supabase Realtime does) in a transaction that is always rolled
  back; a refused probe is an answer (may not write), not an error. The store's `as_role()` acts
  from the start and keeps what it wrote, so it cannot ask this;
- a row's visibility is asked with a statement composed per table, from identifiers;
- psycopg's errors reach the hub as they are: it reconnects its feed and lets a leaving socket go on
  them, where the store would translate them into the API's;
- the feed LISTENs on a connection of its own, outside the pool, and the hub reconnects it with its
  own backoff and greets the other instances then (db/listen.py's listener does neither).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg.rows import class_row, scalar_row
from psycopg.sql import SQL, Composed, Identifier
from psycopg_pool import AsyncConnectionPool

from neuralgrid.db.queries import Query
from neuralgrid.db.roles import act_as
from neuralgrid.db.store import returns_rows

R = TypeVar("R")
Params = Sequence[Any] | None

FEED_CHANNEL = "realtime"  # what realtime.feed_notify() and the feed's triggers NOTIFY on


@dataclass(frozen=True, slots=True)
class CatalogColumn:
    """A table's column as the catalog describes it, with what Realtime must know of its table."""

    name: str
    type_name: str
    in_primary_key: bool
    replica_identity_full: bool  # the table's: an old row carries every column, not only the key
    published: bool  # the table's: in the supabase_realtime publication


@dataclass(frozen=True, slots=True)
class PublishedTable:
    relid: int
    schema: str
    name: str


# --- authorization (authz.py) ----------------------------------------------------------------------

ROLE_BYPASSES_RLS = Query(
    "role_bypasses_rls", "select rolbypassrls or rolsuper from pg_roles where rolname = %s", scalar_row
)
# No row: no such table.
TABLE_COLUMNS = Query(
    "table_columns",
    """
    select a.attname as name, t.typname as type_name,
           coalesce(a.attnum = any(i.indkey), false) as in_primary_key,
           c.relreplident = 'f' as replica_identity_full,
           exists (select from pg_publication_tables p where p.pubname = 'supabase_realtime'
                   and p.schemaname = n.nspname and p.tablename = c.relname) as published
    from pg_class c
    join pg_namespace n on n.oid = c.relnamespace
    join pg_attribute a on a.attrelid = c.oid and a.attnum > 0 and not a.attisdropped
    join pg_type t on t.oid = a.atttypid
    left join pg_index i on i.indrelid = c.oid and i.indisprimary
    where n.nspname = %s and c.relname = %s
    order by a.attnum
    """,
    class_row(CatalogColumn),
)
# The columns a role may select, column grants included: what Realtime filters a change's columns by.
SELECTABLE_COLUMNS = Query(
    "selectable_columns",
    "select a.attname from pg_attribute a"
    " where a.attrelid = format('%%I.%%I', %s::text, %s::text)::regclass and a.attnum > 0"
    "   and not a.attisdropped and has_column_privilege(%s, a.attrelid, a.attnum, 'SELECT')",
    scalar_row,
)
# A message on the topic being authorized: written as the server, it is what the subscriber's SELECT
# policies must see; written as the subscriber, what its INSERT policies must allow.
_PROBE = (
    "insert into realtime.messages (topic, extension, event, private)"
    " values (%s, 'broadcast', 'authorization-probe', true)"
)
PROBE_AS_SERVER = Query("probe_as_server", _PROBE + " returning id", scalar_row)
PROBE_AS_SUBSCRIBER = Query("probe_as_subscriber", _PROBE, scalar_row)
# realtime.topic() answers it, in the policies, for the rest of the transaction.
SET_TOPIC = Query("set_topic", "select set_config('realtime.topic', %s, true)", scalar_row)
PROBE_SEEN = Query("probe_seen", "select exists (select from realtime.messages where id = %s)", scalar_row)


# --- the feed (hub.py) -----------------------------------------------------------------------------

LISTEN_FEED = Query("listen_feed", f"listen {FEED_CHANNEL}", scalar_row)
# To every instance, this one included (each skips what it sent itself); a payload too large for
# NOTIFY is parked in realtime.feed_overflow and its id sent instead.
FEED_NOTIFY = Query("feed_notify", "select realtime.feed_notify(%s::jsonb)", scalar_row)
OVERFLOW_PAYLOAD = Query(
    "overflow_payload", "select payload from realtime.feed_overflow where id = %s", scalar_row
)
PUBLISHED_TABLES = Query(
    "published_tables",
    "select distinct format('%I.%I', schemaname, tablename)::regclass::oid::int8 as relid,"
    " schemaname as schema, tablename as name from pg_publication_tables where pubname = 'supabase_realtime'",
    class_row(PublishedTable),
)
# The tables an instance's subscribers watch (the row-change trigger is silent for the others);
# refreshed now and then, as rows not seen for 90 s stop counting.
WATCH_TABLES = Query(
    "watch_tables",
    "insert into realtime.feed_subscriptions (relid, instance) select unnest(%s::oid[]), %s"
    " on conflict (relid, instance) do update set seen_at = now()",
    scalar_row,
)
UNWATCH_TABLES = Query(
    "unwatch_tables",
    "delete from realtime.feed_subscriptions where relid = any(%s::oid[]) and instance = %s",
    scalar_row,
)
UNWATCH_ALL = Query("unwatch_all", "delete from realtime.feed_subscriptions where instance = %s", scalar_row)
# Client events parked in realtime.feed_overflow older than the seconds given (the feed keeps the
# others an hour).
PRUNE_CLIENT_OVERFLOW = Query(
    "prune_client_overflow",
    "delete from realtime.feed_overflow where created_at < now() - make_interval(secs => %s)"
    " and payload->>'k' in ('broadcast', 'presence')",
    scalar_row,
)


# --- running them ----------------------------------------------------------------------------------


async def run(pool: AsyncConnectionPool, query: Query[R], params: Params = None) -> list[R]:
    """Runs one statement on a connection of the pool: its rows, none for a statement without."""
    async with pool.connection() as conn:
        return await _run(conn, query, params)


async def first(pool: AsyncConnectionPool, query: Query[R], params: Params = None) -> R | None:
    """The statement's first row, or None when it has none."""
    rows = await run(pool, query, params)
    return rows[0] if rows else None


async def _run(conn: psycopg.AsyncConnection[Any], query: Query[R], params: Params = None) -> list[R]:
    cur = conn.cursor(row_factory=query.rows)
    await cur.execute(query.sql, params)
    return await cur.fetchall() if returns_rows(cur) else []


async def topic_rights(pool: AsyncConnectionPool, claims: Mapping[str, Any], topic: str) -> tuple[bool, bool]:
    """(read, write) on a private topic as RLS on realtime.messages decides them, as on Supabase:
    read if the subscriber's SELECT policies see a probe written as the server, write if its INSERT
    policies let it write one. Nothing of it stays: the transaction is rolled back."""
    async with pool.connection() as conn, conn.transaction(force_rollback=True):
        rows = await _run(conn, PROBE_AS_SERVER, (topic,))
        assert rows
        await act_as(conn, claims)
        await _run(conn, SET_TOPIC, (topic,))
        seen = await _run(conn, PROBE_SEEN, (rows[0],))
        write = True
        try:
            async with conn.transaction():  # a savepoint: a refused write leaves the rest standing
                await _run(conn, PROBE_AS_SUBSCRIBER, (topic,))
        except psycopg.errors.InsufficientPrivilege:
            write = False
    return bool(seen and seen[0]), write


async def row_visible(
    pool: AsyncConnectionPool, claims: Mapping[str, Any], schema: str, table: str, key: Mapping[str, Any]
) -> bool:
    """Whether the subscriber's SELECT (RLS included) finds the row whose primary key is `key`
    (column -> value, in the key's column order)."""
    async with pool.connection() as conn, conn.transaction(force_rollback=True):
        await act_as(conn, claims)
        cur = await conn.execute(_row_exists(schema, table, list(key)), (json.dumps(dict(key)),))
        row = await cur.fetchone()
    return bool(row and row[0])


def _row_exists(schema: str, table: str, primary_key: list[str]) -> Composed:
    """`select exists (...)` of the row whose key the JSON parameter holds, its values cast by the
    table's own row type."""
    relation = Identifier(schema, table)
    return SQL(
        "select exists (select from {rel} t where ({t_keys}) = "
        "(select {keys} from jsonb_populate_record(null::{rel}, %s::jsonb)))"
    ).format(
        rel=relation,
        keys=SQL(", ").join(Identifier(c) for c in primary_key),
        t_keys=SQL(", ").join(Identifier("t", c) for c in primary_key),
    )


@asynccontextmanager
async def feed(database_url: str) -> AsyncIterator[AsyncGenerator[psycopg.Notify, None]]:
    """The feed's notifications, on a connection of its own LISTENing on FEED_CHANNEL: LISTEN needs a
    session, so not one of the pool's. Its errors are psycopg's, for the hub to reconnect on."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await _run(conn, LISTEN_FEED)
        # Closed before the connection is left: between two notifications psycopg's generator
        # holds the connection's lock, which leaving the connection (its commit) waits for.
        async with aclosing(conn.notifies()) as notifies:
            yield notifies
