"""Earnings end to end: real requests through a running gateway (the openai SDK against fake nodes)
write the ledger as their jobs end, gross equal to what the key was charged, and the owner reads it
back through the gateway with their API key."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import httpx
import openai
import psycopg
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import LLAMA8, make_user, wait_for
from tests.web.test_owner_page import owner_api_key

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello, grid!"}]
LEDGER = (
    "select e.node_id, e.owner_id, e.model_id, e.gross_usd, e.fee_usd, e.net_usd, j.cost_usd, j.status"
    " from earnings e join jobs j on j.id = e.job_id where e.job_id = %s"
)


def ledger_row(conn: psycopg.Connection, job: str) -> Any:
    # The job's end is written after the answer (in a batch): wait for it.
    return wait_for(lambda: conn.execute(LEDGER, (job,)).fetchone(), timeout=10)


def test_requests_through_the_gateway_earn_their_nodes_owner_the_charge_less_the_fee(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str
) -> None:
    owner, rival = make_user(conn), make_user(conn)
    # The first node refuses every request: the job fails over, and only the node that served earns.
    broken = fake_nodes("rivals-broken", vram_gb=24, failure_rate=1.0, owner_id=rival)
    served = fake_nodes("owners-node", vram_gb=48, owner_id=owner)
    developer = conn.execute(
        "select id, api_key from create_api_key('developer', null, null, 5::numeric)"
    ).fetchone()
    assert developer is not None
    key_id, key = developer

    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=20) as sdk:
        raw = sdk.chat.completions.with_raw_response.create(model=LLAMA8, messages=MESSAGES, max_tokens=5)
        assert raw.headers["x-neuralgrid-node"] == str(served.node_id)
        assert raw.headers["x-neuralgrid-attempts"] == "2"
        first = ledger_row(conn, raw.headers["x-neuralgrid-job"])
        stream = sdk.chat.completions.with_raw_response.create(
            model=LLAMA8, messages=MESSAGES, max_tokens=7, stream=True
        )
        assert len(list(stream.parse())) >= 7
        second = ledger_row(conn, stream.headers["x-neuralgrid-job"])

    for row in (first, second):
        node_id, owner_id, model, gross, fee, net, cost, status = row
        assert (node_id, owner_id, model, status) == (served.node_id, owner, LLAMA8, "succeeded")
        assert gross == cost > 0
        assert fee == round(gross * Decimal("0.15"), 8) and net == gross - fee
    spent = conn.execute("select spent_usd from api_keys where id = %s", (key_id,)).fetchone()
    assert spent == (first[3] + second[3],)  # the ledger's gross is exactly what the key was charged
    assert conn.execute("select count(*) from earnings where node_id = %s", (broken.node_id,)).fetchone() == (
        0,
    )
    assert conn.execute("select count(*) from earnings").fetchone() == (2,)

    # The owner reads it back through the gateway with their own key; the rival sees none of it.
    mine = httpx.get(
        f"{gateway}/api/my/earnings", headers={"authorization": f"Bearer {owner_api_key(conn, owner)}"}
    ).json()
    assert mine["totals"]["jobs"] == 2
    assert mine["totals"]["net_usd"] == float(first[5] + second[5])
    assert [(n["name"], n["jobs_served"]) for n in mine["nodes"]] == [("owners-node", 2)]
    theirs = httpx.get(
        f"{gateway}/api/my/earnings", headers={"authorization": f"Bearer {owner_api_key(conn, rival)}"}
    ).json()
    assert theirs["totals"]["jobs"] == 0 and [n["name"] for n in theirs["nodes"]] == ["rivals-broken"]
