"""API keys from the command line (as the service): create, list, revoke."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.errors import InvalidRequest, NotFound
from neuralgrid.db.queries import CreatedKey
from neuralgrid.db.store import SyncStore
from neuralgrid.web.signin import LOCAL_OWNER_EMAIL


def create(
    conn: psycopg.Connection[Any],
    name: str,
    rpm: int | None,
    tpm: int | None,
    budget_usd: float | None,
    owner: UUID | None = None,
) -> CreatedKey:
    """A key owned by `owner`, created as that user exactly as the web page's API does (so its page
    lists it, and the nodes registered with it are theirs); with no owner, the service's own."""
    store = SyncStore(conn)
    params = (name, rpm, tpm, budget_usd)
    if owner is None:
        return store.get(q.CREATE_KEY, params)
    with store.transaction():
        store.get(q.ACT_AS_USER, (owner,))
        return store.get(q.CREATE_KEY, params)


def find_user(conn: psycopg.Connection[Any], id_or_email: str) -> UUID:
    """A user by id or email; NotFound when the database has none."""
    user: UUID | None = SyncStore(conn).one(q.USER_BY_ID_OR_EMAIL, {"who": id_or_email})
    if user is None:
        raise NotFound(
            f"no user with id or email {id_or_email!r} (a user exists once they have signed in; on the"
            " embedded stack, `neuralgrid users add EMAIL` adds one)"
        )
    return user


def local_owner(conn: psycopg.Connection[Any], *, create: bool) -> UUID | None:
    """The local owner, whom `neuralgrid signin` signs in: created if asked (the embedded stack,
    whose users are ours to make), else only found (never invent a user in someone's project)."""
    store = SyncStore(conn)
    if create:
        store.one(q.ADD_USER, {"email": LOCAL_OWNER_EMAIL})
    user: UUID | None = store.one(q.USER_ID, (LOCAL_OWNER_EMAIL,))
    return user


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
