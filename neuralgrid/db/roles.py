"""Acting as an API caller inside a transaction, exactly as PostgREST and Supabase Realtime do."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import sql


async def act_as(conn: psycopg.AsyncConnection[Any], claims: Mapping[str, Any]) -> None:
    """Makes the open transaction run as the JWT's role with request.jwt.claims set, so the role's
    grants and RLS policies (auth.uid(), auth.jwt()) decide. Both settings end with the transaction."""
    await conn.execute(sql.SQL("set local role {}").format(sql.Identifier(claims["role"])))
    await conn.execute("select set_config('request.jwt.claims', %s, true)", (json.dumps(dict(claims)),))
