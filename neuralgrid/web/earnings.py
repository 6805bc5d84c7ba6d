"""What a GPU owner earns, and how their nodes do: the API behind the "Your nodes" page,
`neuralgrid node earnings` and `neuralgrid node verify`.

Everything is read as the owner, so row-level security keeps it to their own nodes. The page sends a
signed-in user's access token; the CLI sends the owner's API key (the one `node run` registers nodes
with), which stands for the user it belongs to.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from decimal import Decimal
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from neuralgrid.db import queries as q
from neuralgrid.gateway.errors import Forbidden, GatewayError, NotFound
from neuralgrid.server.deps import ServicesDep, user_claims
from neuralgrid.verify.owners import nothing_restarted

router = APIRouter(tags=["web"])

KEY_PREFIX = "ng-"  # what create_api_key() gives every key
UPTIME_DAYS = 7


class KeyWithoutOwner(Forbidden):
    code = "key_without_owner"


async def owner_claims(request: Request, services: ServicesDep) -> dict[str, Any]:
    """The claims to read as: a user's access token's own, or those of the user an API key belongs to."""
    header = request.headers.get("authorization") or ""
    if not header[7:].strip().startswith(KEY_PREFIX):
        return await user_claims(request, services)
    key = await services.keys.authenticate(header)
    if key.owner_id is None:
        raise KeyWithoutOwner(
            "this API key belongs to no user (it is an operator's): use a key of yours, such as the"
            " one your nodes run with or one from the API keys page"
        )
    return {"role": "authenticated", "aud": "authenticated", "sub": str(key.owner_id)}


OwnerDep = Annotated[dict[str, Any], Depends(owner_claims)]


@router.get("/api/my/earnings")
async def my_earnings(
    services: ServicesDep,
    claims: OwnerDep,
    days: Annotated[int, Query(ge=1, le=3660, description="The period: the last this many days.")] = 30,
) -> dict[str, Any]:
    """The owner's earnings over the period (today and the days before it, in UTC: per day, node and
    model, and totals, with what is still held and what was forfeited), their nodes (status, uptime
    over the last 7 days, jobs served, reputation, warm models, net earned in the period) and the
    verification of each (node, model) under it (state, challenges and failures, since when, the last
    failure's reason, net held and forfeited, whatever the period)."""
    async with services.store.as_role(claims) as store:
        by_day = await store.all(q.MY_EARNINGS, {"days": days})
        totals = dict(await store.get(q.MY_EARNINGS_TOTALS, {"days": days}))
        nodes = await store.all(q.MY_NODE_STATS, {"days": UPTIME_DAYS})
        fee_rate = await store.get(q.PLATFORM_FEE_RATE)
        checks = await store.all(q.MY_MODEL_CHECKS)
    earned: dict[Any, float] = {}
    for row in by_day:
        earned[row["node_id"]] = earned.get(row["node_id"], 0.0) + row["net_usd"]
    for node in nodes:
        node["net_usd"] = earned.get(node["node_id"], 0.0)
    return {
        "object": "earnings",
        "days": days,
        "first_day": totals.pop("first_day"),
        "uptime_days": UPTIME_DAYS,
        "fee_rate": fee_rate,
        "totals": totals,
        "by_day": by_day,
        "nodes": nodes,
        "checks": [_as_json(asdict(check)) for check in checks],
    }


def _as_json(row: dict[str, Any]) -> dict[str, Any]:
    """Money as floats, as the rest of this JSON has it (the ledger keeps the exact figures)."""
    return {k: float(v) if isinstance(v, Decimal) else v for k, v in row.items()}


# Asking again ------------------------------------------------------------------------------------


class NothingFailed(GatewayError):
    status, type, code = 409, "invalid_request_error", "nothing_failed"


class VerificationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: str = Field(min_length=1, max_length=100, description="The name or id of a node of yours.")


@router.post("/api/my/verification")
async def request_verification(
    body: VerificationRequest, services: ServicesDep, claims: OwnerDep
) -> dict[str, Any]:
    """The owner asks for their node's failed models to be verified again (request_verification()):
    each starts over, unverified, and is challenged at once. 404 for a node that is not theirs, 409
    when none of its models may start over (none failed, or not an hour ago)."""
    async with services.store.as_role(claims) as store:
        node = _find(await store.all(q.MY_NODES), body.node)
        started = await store.all(q.REQUEST_VERIFICATION, (node["id"],))
        if not started:
            checks = [
                (c.model_id, c.state) for c in await store.all(q.MY_MODEL_CHECKS) if c.node_id == node["id"]
            ]
            raise NothingFailed(nothing_restarted(node["name"], checks), param="node")
    return {
        "object": "verification",
        "node_id": node["id"],
        "node_name": node["name"],
        "models": [{"model_id": s.model_id, "state": s.state} for s in started],
    }


def _find(nodes: list[dict[str, Any]], name_or_id: str) -> dict[str, Any]:
    """One of the owner's nodes by id, else by name (an owner's names are unique)."""
    try:
        wanted: uuid.UUID | None = uuid.UUID(name_or_id)
    except ValueError:
        wanted = None
    found = next((n for n in nodes if n["id"] == wanted), None) or next(
        (n for n in nodes if n["name"] == name_or_id), None
    )
    if found is None:
        raise NotFound(f"you have no node named {name_or_id!r} (nor with that id)", param="node")
    return found
