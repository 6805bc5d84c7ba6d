"""What a GPU owner earns, and how their nodes do: the API behind the "Your nodes" page and
`neuralgrid node earnings`.

Everything is read as the owner, so row-level security keeps it to their own nodes. The page sends a
signed-in user's access token; the CLI sends the owner's API key (the one `node run` registers nodes
with), which stands for the user it belongs to.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from neuralgrid.db import queries as q
from neuralgrid.gateway.errors import Forbidden
from neuralgrid.server.deps import ServicesDep, user_claims

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
    model, and totals) and their nodes (status, uptime over the last 7 days, jobs served, reputation,
    warm models, net earned in the period)."""
    async with services.store.as_role(claims) as store:
        by_day = await store.all(q.MY_EARNINGS, {"days": days})
        totals = dict(await store.get(q.MY_EARNINGS_TOTALS, {"days": days}))
        nodes = await store.all(q.MY_NODE_STATS, {"days": UPTIME_DAYS})
        fee_rate = await store.get(q.PLATFORM_FEE_RATE)
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
    }
