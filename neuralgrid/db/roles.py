"""Acting as an API caller inside a transaction, exactly as PostgREST and Supabase Realtime do."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import sql


def _statements(claims: Mapping[str, Any]) -> list[tuple[sql.Composed | sql.SQL, tuple[str, ...]]]:
    return [
        (sql.SQL("set local role {}").format(sql.Identifier(claims["role"])), ()),
        (sql.SQL("select set_config('request.jwt.claims', %s, true)"), (json.dumps(dict(claims)),)),
    ]


async def act_as(conn: psycopg.AsyncConnection[Any], claims: Mapping[str, Any]) -> None:
    """Makes the open transaction run as the JWT's role with request.jwt.claims set, so the role's
    grants and RLS policies (auth.uid(), auth.jwt()) decide. Both settings end with the transaction."""
    for statement, params in _statements(claims):
        await conn.execute(statement, params)


def act_as_sync(conn: psycopg.Connection[Any], claims: Mapping[str, Any]) -> None:
    for statement, params in _statements(claims):
        conn.execute(statement, params)
