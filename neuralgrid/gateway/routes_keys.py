"""API keys for signed-in Supabase users: create, list and revoke their own (RLS enforces it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from uuid import UUID

import psycopg
from fastapi import APIRouter
from psycopg.rows import dict_row
from pydantic import BaseModel, Field

from neuralgrid.admin.keys import CREATE_KEY
from neuralgrid.db.errors import DatabaseError, translate
from neuralgrid.db.roles import act_as
from neuralgrid.gateway.deps import GatewayDep, UserDep
from neuralgrid.gateway.errors import BadRequest, NotFound

router = APIRouter(prefix="/v1/keys", tags=["keys"])


class NewKey(BaseModel):
    name: str = Field(min_length=1, max_length=100)
    rpm_limit: int | None = Field(None, gt=0)
    tpm_limit: int | None = Field(None, gt=0)
    budget_usd: float | None = Field(None, ge=0)


@asynccontextmanager
async def as_user(gateway: GatewayDep, claims: dict[str, Any]) -> AsyncIterator[psycopg.AsyncConnection]:
    """A transaction acting as the user, exactly as PostgREST does: role + request.jwt.claims."""
    async with gateway.pool.connection() as conn, conn.transaction():
        await act_as(conn, claims)  # get_user_claims checked the role is authenticated
        yield conn


@router.get("")
async def list_keys(gateway: GatewayDep, claims: UserDep) -> dict[str, Any]:
    async with as_user(gateway, claims) as conn:
        cur = conn.cursor(row_factory=dict_row)
        rows = await (
            await cur.execute(
                "select id, name, prefix, rpm_limit, tpm_limit, budget_usd::float8, spent_usd::float8,"
                " created_at, last_used_at, revoked_at from public.api_keys order by created_at"
            )
        ).fetchall()
    return {"object": "list", "data": rows}


@router.post("", status_code=201)
async def create_key(new: NewKey, gateway: GatewayDep, claims: UserDep) -> dict[str, Any]:
    """Creates a key; the response holds it in clear, the only time it is ever shown."""
    try:
        async with as_user(gateway, claims) as conn:
            row = await (
                await conn.execute(
                    CREATE_KEY,
                    (new.name, new.rpm_limit, new.tpm_limit, new.budget_usd),
                )
            ).fetchone()
    except psycopg.Error as err:
        domain = translate(err)
        if isinstance(domain, DatabaseError):
            raise BadRequest(str(domain)) from err
        raise
    assert row is not None
    return {"id": row[0], "key": row[1], "prefix": row[2], "name": new.name}


@router.delete("/{key_id}")
async def revoke_key(key_id: UUID, gateway: GatewayDep, claims: UserDep) -> dict[str, Any]:
    async with as_user(gateway, claims) as conn:
        cur = await conn.execute(
            "update public.api_keys set revoked_at = now() where id = %s and revoked_at is null returning id",
            (key_id,),
        )
        if await cur.fetchone() is None:
            raise NotFound("no such active key of yours", param="key_id")
    return {"id": key_id, "revoked": True}
