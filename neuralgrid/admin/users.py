"""Users of a stack that signs its users in with one-time links (the embedded one), as the service:
add one, list them. On a hosted Supabase project, Supabase Auth makes the users."""

from __future__ import annotations

import re
from typing import Any
from uuid import UUID

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.errors import InvalidRequest
from neuralgrid.db.store import SyncStore

_EMAIL = re.compile(r"[^@\s]+@[^@\s]+")


def email_address(text: str) -> str:
    """The address as Supabase Auth keeps it (lower-case); InvalidRequest for what is not one."""
    address = text.strip().lower()
    if not _EMAIL.fullmatch(address):
        raise InvalidRequest(f"not an email address: {text!r} (a user is added by email: NAME@DOMAIN)")
    return address


def add_user(conn: psycopg.Connection[Any], email: str) -> tuple[UUID, bool]:
    """The user with this email, made if new as a first sign-in makes the local owner (an auth.users
    row, as the service); and whether it was made now."""
    store = SyncStore(conn)
    with store.transaction():
        found: UUID | None = store.one(q.USER_ID, (email,))
        if found is not None:
            return found, False
        store.one(q.ADD_USER, {"email": email})
        made: UUID = store.get(q.USER_ID, (email,))
        return made, True


def list_users(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    return SyncStore(conn).all(q.USERS)
