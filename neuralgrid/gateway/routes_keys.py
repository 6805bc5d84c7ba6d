"""API keys for signed-in Supabase users: create, list and revoke their own (RLS enforces it)."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt

from neuralgrid.db import queries as q
from neuralgrid.gateway.errors import NotFound
from neuralgrid.server.deps import ServicesDep, UserDep
from neuralgrid.validation import KEY_BUDGET_MAX_USD, KEY_LIMIT_MAX

router = APIRouter(prefix="/v1/keys", tags=["keys"])


def _json_number(value: object) -> object:
    """A budget as a JSON number: a string (" 5 ", "1_000") or a boolean is refused, not converted."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        raise ValueError("budget_usd must be a number")
    return value


class NewKey(BaseModel):
    # A field it does not know is refused: a misspelt limit would otherwise make a key without one.
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$")  # no control characters
    # Numbers as JSON writes them: not true, "10" or 1.0, which pydantic's lax mode would take.
    rpm_limit: StrictInt | None = Field(None, gt=0, le=KEY_LIMIT_MAX)
    tpm_limit: StrictInt | None = Field(None, gt=0, le=KEY_LIMIT_MAX)
    # Within what the ledger holds (numeric(12,4)); create_api_key() refuses a budget it would round.
    budget_usd: Annotated[Decimal, BeforeValidator(_json_number)] | None = Field(
        None, ge=0, lt=KEY_BUDGET_MAX_USD, allow_inf_nan=False
    )


@router.get("")
async def list_keys(services: ServicesDep, claims: UserDep) -> dict[str, Any]:
    async with services.store.as_role(claims) as store:
        rows = await store.all(q.LIST_KEYS)
    return {"object": "list", "data": rows}


@router.post("", status_code=201)
async def create_key(new: NewKey, services: ServicesDep, claims: UserDep) -> dict[str, Any]:
    """Creates a key; the response holds it in clear, the only time it is ever shown."""
    async with services.store.as_role(claims) as store:
        row = await store.get(q.CREATE_KEY, (new.name, new.rpm_limit, new.tpm_limit, new.budget_usd))
    return {"id": row.id, "key": row.api_key, "prefix": row.prefix, "name": new.name}


@router.delete("/{key_id}")
async def revoke_key(key_id: UUID, services: ServicesDep, claims: UserDep) -> dict[str, Any]:
    async with services.store.as_role(claims) as store:
        if await store.one(q.REVOKE_KEY, (key_id,)) is None:
            raise NotFound("no such active key of yours", param="key_id")
    return {"id": key_id, "revoked": True}
