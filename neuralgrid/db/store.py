"""The one seam between Python and Postgres: run a named query (db/queries/), get typed rows.

Every Postgres error leaves here already translated into the domain's (db/errors.py). `Store` is
the async face the gateway, web and server use; `SyncStore` the thin sync face of the CLI and tests.
`Store` takes a pool or one connection; its `as_role()` runs a block as a Supabase role with its
claims, exactly as PostgREST does, so grants and row-level security decide. Text parameters go out
without NUL characters (`without_nul()`), which Postgres text cannot hold.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import pq
from psycopg_pool import AsyncConnectionPool

from neuralgrid.db.errors import translate
from neuralgrid.db.queries import Query
from neuralgrid.db.roles import act_as

R = TypeVar("R")
Params = Mapping[str, Any] | Sequence[Any] | None

NUL = "\x00"
REPLACEMENT = "\ufffd"  # what a decoder puts in place of what it cannot read


def without_nul(params: Params) -> Params:
    """The parameters with each NUL in their text (strings, text arrays) replaced by U+FFFD.

    Postgres text cannot hold NUL, and text from outside can (a node's error message): psycopg would
    refuse the whole statement, a job's completion with it. Replaced rather than dropped, so that
    distinct inputs stay distinct (a model name with a NUL matches no model). The parameters come
    back unchanged, not copied, when there is none: the usual case costs one look at each value.
    """
    if params is None:
        return None
    values = params.values() if isinstance(params, Mapping) else params
    if not any(map(_has_nul, values)):
        return params
    if isinstance(params, Mapping):
        return {name: _replace_nul(value) for name, value in params.items()}
    return [_replace_nul(value) for value in params]


def _has_nul(value: object) -> bool:
    if isinstance(value, str):
        return NUL in value
    # An array holds one type: one that starts with a number, a UUID... holds no text.
    if isinstance(value, list) and value and (value[0] is None or isinstance(value[0], str)):
        return NUL in "".join(item for item in value if isinstance(item, str))
    return False


def _replace_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace(NUL, REPLACEMENT)
    if isinstance(value, list):
        return [_replace_nul(item) for item in value]
    return value


def returns_rows(cur: psycopg.AsyncCursor[Any] | psycopg.Cursor[Any]) -> bool:
    """Whether the statement returned rows (a SELECT, a function's result; not a LISTEN). Asked of
    the result's status: `cursor.description` says the same, but builds a Column per column to say
    it, on every statement (a few percent of the gateway's CPU per request)."""
    result = cur.pgresult
    return result is not None and result.status == pq.ExecStatus.TUPLES_OK


class Store:
    """Async: each call takes a connection from the pool (or uses the one it was given)."""

    def __init__(self, source: AsyncConnectionPool | psycopg.AsyncConnection[Any]) -> None:
        self._source = source

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if isinstance(self._source, AsyncConnectionPool):
            # Not pool.connection(): on the way out it commits, under the connection's lock, what an
            # autocommit connection never holds (a transaction block, as_role's, ends itself), about
            # 9 µs of CPU per statement. putconn() still rolls back and checks what a failure left.
            conn = await self._source.getconn()
            try:
                yield conn
                if not conn.autocommit:  # a pool of another kind: what it wrote is kept
                    await conn.commit()
            finally:
                await self._source.putconn(conn)
        else:
            yield self._source

    async def all(self, query: Query[R], params: Params = None) -> list[R]:
        try:
            async with self._connection() as conn:
                cur = conn.cursor(row_factory=query.rows)
                await cur.execute(query.sql, without_nul(params))
                return await cur.fetchall() if returns_rows(cur) else []
        except psycopg.Error as err:
            raise translate(err, query.subject) from err

    async def one(self, query: Query[R], params: Params = None) -> R | None:
        """The first row, or None when there is none."""
        rows = await self.all(query, params)
        return rows[0] if rows else None

    async def get(self, query: Query[R], params: Params = None) -> R:
        """The row a query always returns (a function's result)."""
        rows = await self.all(query, params)
        assert rows, f"{query.name} returned no row"
        return rows[0]

    @asynccontextmanager
    async def as_role(self, claims: Mapping[str, Any]) -> AsyncIterator[Store]:
        """One transaction acting as claims['role'] with these JWT claims."""
        async with self._connection() as conn, conn.transaction():
            await act_as(conn, claims)
            yield Store(conn)


class SyncStore:
    """The sync face over one connection (the CLI, scripts, tests)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def all(self, query: Query[R], params: Params = None) -> list[R]:
        try:
            with self.conn.cursor(row_factory=query.rows) as cur:
                cur.execute(query.sql, without_nul(params))
                return cur.fetchall() if returns_rows(cur) else []
        except psycopg.Error as err:
            raise translate(err, query.subject) from err

    def one(self, query: Query[R], params: Params = None) -> R | None:
        rows = self.all(query, params)
        return rows[0] if rows else None

    def get(self, query: Query[R], params: Params = None) -> R:
        rows = self.all(query, params)
        assert rows, f"{query.name} returned no row"
        return rows[0]

    @contextmanager
    def transaction(self) -> Iterator[SyncStore]:
        with self.conn.transaction():
            yield self
