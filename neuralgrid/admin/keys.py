"""API keys from the command line (as the service): create, list, revoke."""

from __future__ import annotations

from typing import Any

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.errors import InvalidRequest
from neuralgrid.db.queries import CreatedKey
from neuralgrid.db.store import SyncStore


def create(
    conn: psycopg.Connection[Any], name: str, rpm: int | None, tpm: int | None, budget_usd: float | None
) -> CreatedKey:
    return SyncStore(conn).get(q.CREATE_KEY, (name, rpm, tpm, budget_usd))


def list_keys(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    return SyncStore(conn).all(q.LIST_KEYS)


def revoke(conn: psycopg.Connection[Any], id_or_prefix: str) -> str:
    """Revoke one active key by id or by its shown prefix; ambiguity and absence are errors."""
    store = SyncStore(conn)
    found = store.all(q.ACTIVE_KEYS_MATCHING, (id_or_prefix, id_or_prefix))
    if not found:
        raise InvalidRequest(f"no active key with id or prefix {id_or_prefix!r}")
    if len(found) > 1:
        raise InvalidRequest(f"{id_or_prefix!r} matches {len(found)} keys: use the id")
    store.one(q.REVOKE_KEY, (found[0].id,))
    return f"{found[0].prefix}… ({found[0].id})"
