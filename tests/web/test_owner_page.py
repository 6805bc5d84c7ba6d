"""The "Your nodes" page in headless Chromium, and the API behind it: an owner's nodes (status, uptime,
jobs served, reputation, warm models, each model's verification), their earnings over time and in
total (held and forfeited too), asking again for a failed model, and nothing of anyone else's."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
from playwright.sync_api import expect

from neuralgrid.server import stack
from neuralgrid.server.settings import PLACEHOLDER_SECRET
from tests.conftest import LLAMA8, make_node, make_user
from tests.db.test_earnings import set_history
from tests.db.test_verification_on_the_map import REASON, fail_model, pin_model, verification
from tests.web.test_web import Opener, screenshot, sign_in

QWEN = "Qwen/Qwen2.5-32B-Instruct-AWQ"


def earned(
    conn: psycopg.Connection, node: uuid.UUID, owner: uuid.UUID, model: str, gross: str, days_ago: int
) -> None:
    """A ledger row as a paid job's end writes it (at the default 15% fee), dated days_ago."""
    conn.execute(
        "insert into earnings (job_id, node_id, owner_id, model_id, gross_usd, fee_rate, fee_usd, net_usd,"
        " earned_at) select gen_random_uuid(), %s, %s, %s, g, 0.15, round(g * 0.15, 8), g - round(g * 0.15, 8),"
        " now() - make_interval(days => %s) from (select %s::numeric as g) x",
        (node, owner, model, days_ago, gross),
    )


def owner_world(conn: psycopg.Connection, owner: uuid.UUID) -> dict[str, uuid.UUID]:
    """Two nodes of the owner's with earnings over 30 days, and someone else's node that earned more."""
    other = make_user(conn, "other@example.test")
    mine = make_node(conn, "my-4090", owner_id=owner, models={LLAMA8: "loaded", QWEN: "available"})
    big = make_node(
        conn,
        "my-a100",
        owner_id=owner,
        status="offline",
        gpu_model="NVIDIA A100 80GB",
        vram_gb=80,
        tflops=312,
        models={LLAMA8: "available"},
    )
    theirs = make_node(conn, "someone-elses", owner_id=other)
    conn.execute("update nodes set successes = 120, failures = 3 where id = %s", (mine,))
    set_history(conn, mine, ("online", "10 days"), ("offline", "5 days"), ("online", "4 days"))
    set_history(conn, big, ("online", "2 hours"), ("offline", "1 hour"))
    earned(conn, mine, owner, LLAMA8, "1.00", 1)
    earned(conn, mine, owner, QWEN, "2.00", 3)
    earned(conn, big, owner, LLAMA8, "0.40", 0)
    earned(conn, big, owner, LLAMA8, "1.00", 10)
    earned(conn, theirs, other, LLAMA8, "5.00", 1)
    return {"other": other, "mine": mine, "big": big, "theirs": theirs}


def held(conn: psycopg.Connection, node: uuid.UUID, owner: uuid.UUID, model: str, gross: str) -> None:
    """A ledger row earned today that settles tomorrow: forfeited if its model fails meanwhile."""
    earned(conn, node, owner, model, gross, 0)
    conn.execute(
        "update earnings set settles_at = now() + interval '1 day' where node_id = %s and gross_usd = %s",
        (node, gross),
    )


def failed_world(conn: psycopg.Connection, owner: uuid.UUID) -> dict[str, uuid.UUID]:
    """owner_world() with LLAMA8 pinned: my-4090 failed it (3 failures) and forfeited a $0.60 job not
    yet settled; my-a100 is unverified, with a $0.20 job held."""
    world = owner_world(conn, owner)
    pin_model(conn)
    held(conn, world["mine"], owner, LLAMA8, "0.60")
    held(conn, world["big"], owner, LLAMA8, "0.20")
    fail_model(conn, world["mine"])
    return world


def owner_api_key(conn: psycopg.Connection, owner: uuid.UUID) -> str:
    """An API key of the owner's, made in SQL as the keys page makes it (the key `node run` takes)."""
    claims = json.dumps({"sub": str(owner), "role": "authenticated"})
    conn.execute("select set_config('request.jwt.claims', %s, false)", (claims,))
    row = conn.execute("select api_key from create_api_key('node key')").fetchone()
    conn.execute("select set_config('request.jwt.claims', '', false)")
    assert row is not None
    return str(row[0])


def local_owner(conn: psycopg.Connection) -> uuid.UUID:
    row = conn.execute("select id from auth.users where email = 'owner@localhost'").fetchone()
    assert row is not None
    return uuid.UUID(str(row[0]))


def test_the_page_shows_my_nodes_and_earnings_and_nobody_elses(
    conn: psycopg.Connection, gateway: str, gateway_settings: dict[str, Any], open_page: Opener
) -> None:
    visitor, _ = open_page(f"{gateway}/nodes")
    expect(visitor.locator("#signin-needed")).to_contain_text("neuralgrid up")
    expect(visitor.locator("#signed-in")).to_be_hidden()

    page, watch = sign_in(open_page, gateway, gateway_settings)
    owner = local_owner(conn)
    owner_world(conn, owner)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Your nodes").click()
    page.wait_for_url(f"{gateway}/nodes")
    expect(page.get_by_role("link", name="Your nodes")).to_have_attribute("aria-current", "page")

    rows = page.locator("#nodes-body tr")
    expect(rows).to_have_count(2)
    first = page.locator('#nodes-body tr[data-name="my-4090"]')
    for text in [
        "online",
        "my-4090",
        "1 \u00d7 NVIDIA GeForce RTX 4090",
        "85.7%",
        "120",
        "96.8%",
        LLAMA8,
        "$2.55",
    ]:
        expect(first).to_contain_text(text)
    second = page.locator('#nodes-body tr[data-name="my-a100"]')
    for text in ["offline", "50.0%", "no model loaded", "$1.19"]:
        expect(second).to_contain_text(text)
    expect(second.locator("[data-label='Uptime (7 d)']")).to_have_attribute("title", "over the 2 h recorded")

    # Totals over the last 30 days (the default period): four paid jobs, 15% kept by the platform.
    expect(page.locator("#total-jobs")).to_have_text("4")
    expect(page.locator("#total-gross")).to_have_text("$4.40")
    expect(page.locator("#total-fee")).to_have_text("$0.66")
    expect(page.locator("#total-net")).to_have_text("$3.74")
    expect(page.locator("#fee-rate")).to_have_text("15%")

    # The chart: a bar per day, the days with earnings at their height, each saying what it shows.
    bars = page.locator("#chart .bar")
    expect(bars).to_have_count(30)
    paid = page.locator("#chart .bar[data-net]:not([data-net='0'])")
    expect(paid).to_have_count(4)
    assert sorted(float(b.get_attribute("data-net") or 0) for b in paid.all()) == [0.34, 0.85, 0.85, 1.7]
    tallest = page.locator("#chart .bar[data-net='1.7']")
    assert float(tallest.get_attribute("height") or 0) > float(
        page.locator("#chart .bar[data-net='0.34']").get_attribute("height") or 0
    )
    expect(tallest.locator("title")).to_contain_text("$1.70")
    expect(page.locator("#chart")).to_have_attribute(
        "aria-label", "Net earnings per day over the last 30 days: $3.74 in all"
    )

    by_model = page.locator("#earnings-body tr")
    expect(by_model).to_have_count(3)
    expect(page.locator("#earnings-body tr", has_text=QWEN)).to_contain_text("$1.70")
    screenshot(page, "owner-nodes-1280")

    # A shorter period: the job 10 days ago drops out.
    page.select_option("#period", "7")
    expect(page.locator("#total-net")).to_have_text("$2.89")
    expect(bars).to_have_count(7)
    expect(second).to_contain_text("$0.34")

    body = page.locator("main").inner_text()
    assert "someone-elses" not in body and "$4.25" not in body
    watch.assert_clean()


def test_an_owner_with_nothing_yet_is_told_what_to_do(
    gateway: str, gateway_settings: dict[str, Any], open_page: Opener
) -> None:
    page, watch = sign_in(open_page, gateway, gateway_settings)
    page.goto(f"{gateway}/nodes")
    expect(page.locator("#nodes-empty")).to_contain_text("Run a node")
    expect(page.locator("#total-net")).to_have_text("$0.00")
    expect(page.locator("#earnings-empty")).to_be_visible()
    watch.assert_clean()


def test_every_page_links_to_your_nodes(gateway: str) -> None:
    for path in ("/", "/keys", "/operator", "/nodes", "/signin"):
        reply = httpx.get(f"{gateway}{path}")
        assert reply.status_code == 200 and '<a href="/nodes"' in reply.text, path
    page = httpx.get(f"{gateway}/nodes")
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(f"{gateway}/static/js/nodes.js").status_code == 200


# The API -------------------------------------------------------------------------------------------


def test_api_my_earnings_reads_as_the_owner_by_token_or_by_key(
    conn: psycopg.Connection, gateway: str
) -> None:
    url = f"{gateway}/api/my/earnings"
    assert httpx.get(url).status_code == 401
    owner = make_user(conn)
    world = owner_world(conn, owner)

    def get(credential: str, **params: Any) -> httpx.Response:
        return httpx.get(url, params=params, headers={"authorization": f"Bearer {credential}"})

    token = stack.user_token(PLACEHOLDER_SECRET, owner, None)
    mine = get(token).json()
    assert mine["days"] == 30 and mine["uptime_days"] == 7 and mine["fee_rate"] == 0.15
    # The period is whole UTC days: today and the 29 before it.
    assert mine["first_day"] == str(datetime.now(UTC).date() - timedelta(days=29))
    assert mine["totals"] == {
        "jobs": 4,
        "gross_usd": 4.4,
        "fee_usd": 0.66,
        "net_usd": 3.74,
        "held_usd": 0.0,
        "forfeited_usd": 0.0,
    }
    assert mine["checks"] == []  # no model of theirs is pinned
    assert [n["name"] for n in mine["nodes"]] == ["my-4090", "my-a100"]
    assert {(r["node_name"], r["model_id"]) for r in mine["by_day"]} == {
        ("my-4090", LLAMA8),
        ("my-4090", QWEN),
        ("my-a100", LLAMA8),
    }
    node = mine["nodes"][0]
    assert node["uptime"] == 6 / 7 or abs(node["uptime"] - 6 / 7) < 1e-6
    assert (node["jobs_served"], node["failures"], node["warm_models"]) == (120, 3, [LLAMA8])
    assert node["net_usd"] == 2.55
    assert "endpoint_url" not in node

    # The owner's API key (the one their nodes run with) reads the same; the period is a parameter.
    week = get(owner_api_key(conn, owner), days=7).json()
    assert week["days"] == 7 and week["totals"]["net_usd"] == 2.89
    assert [(n["name"], n["net_usd"]) for n in week["nodes"]] == [("my-4090", 2.55), ("my-a100", 0.34)]

    # Someone else sees only their own; a key of no user's, a bad token, a bad period: clear refusals.
    theirs = get(stack.user_token(PLACEHOLDER_SECRET, world["other"], None)).json()
    assert [n["name"] for n in theirs["nodes"]] == ["someone-elses"] and theirs["totals"]["net_usd"] == 4.25
    operator_key = conn.execute("select api_key from create_api_key('operator')").fetchone()
    assert operator_key is not None
    refused = get(operator_key[0])
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "key_without_owner"
    assert get("ng-not-a-key").status_code == 401
    assert get("not-a-token").status_code == 401
    for days in ("0", "3661", "week"):
        bad = get(token, days=days)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.days", days


def test_api_my_earnings_says_what_is_held_and_forfeited_and_each_models_verification(
    conn: psycopg.Connection, gateway: str
) -> None:
    owner = make_user(conn)
    failed_world(conn, owner)
    token = stack.user_token(PLACEHOLDER_SECRET, owner, None)
    mine = httpx.get(f"{gateway}/api/my/earnings", headers={"authorization": f"Bearer {token}"}).json()
    # The forfeited job is in none of the sums but its own; the held one is in the net, and said held.
    assert mine["totals"] == {
        "jobs": 5,
        "gross_usd": 4.6,
        "fee_usd": 0.69,
        "net_usd": 3.91,
        "held_usd": 0.17,
        "forfeited_usd": 0.51,
    }
    checks = [
        {k: c[k] for k in ("node_name", "model_id", "state", "challenges", "failures", "last_failure")}
        | {"held": c["held_usd"], "forfeited": c["forfeited_usd"]}
        for c in mine["checks"]
    ]
    assert checks == [
        {
            "node_name": "my-4090",
            "model_id": LLAMA8,
            "state": "failed",
            "challenges": 2,
            "failures": 2,
            "last_failure": REASON,
            "held": 0.0,
            "forfeited": 0.51,
        },
        {
            "node_name": "my-a100",
            "model_id": LLAMA8,
            "state": "unverified",
            "challenges": 0,
            "failures": 0,
            "last_failure": None,
            "held": 0.17,
            "forfeited": 0.0,
        },
    ]
    assert datetime.fromisoformat(mine["checks"][0]["state_since"]) <= datetime.now(UTC)
    # someone-elses holds LLAMA8 too: under verification, and none of this owner's business.
    assert {c["node_name"] for c in mine["checks"]} == {"my-4090", "my-a100"}


def test_an_owner_asks_again_for_a_failed_node_and_bad_requests_are_refused(
    conn: psycopg.Connection, gateway: str
) -> None:
    url = f"{gateway}/api/my/verification"
    owner = make_user(conn)
    world = failed_world(conn, owner)
    key = owner_api_key(conn, owner)

    def post(body: Any, credential: str = key) -> httpx.Response:
        return httpx.post(url, json=body, headers={"authorization": f"Bearer {credential}"})

    assert httpx.post(url, json={"node": "my-4090"}).status_code == 401
    operator_key = conn.execute("select api_key from create_api_key('operator')").fetchone()
    assert operator_key is not None
    assert post({"node": "my-4090"}, operator_key[0]).json()["error"]["code"] == "key_without_owner"
    bad_bodies: list[Any] = [
        {},
        {"node": ""},
        {"node": "x" * 101},
        {"node": 7},
        {"node": "my-4090", "also": 1},
        [],
    ]
    for body in bad_bodies:
        refused = post(body)
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", body
    for theirs in ("someone-elses", str(world["theirs"]), str(uuid.uuid4())):
        refused = post({"node": theirs})
        assert refused.status_code == 404, theirs
        assert refused.json()["error"]["param"] == "node" and theirs in refused.json()["error"]["message"]
    none_failed = post({"node": "my-a100"})
    assert none_failed.status_code == 409 and none_failed.json()["error"]["code"] == "nothing_failed"
    assert f"{LLAMA8} unverified" in none_failed.json()["error"]["message"]

    started = post({"node": "my-4090"})
    assert started.status_code == 200, started.text
    assert started.json() == {
        "object": "verification",
        "node_id": str(world["mine"]),
        "node_name": "my-4090",
        "models": [{"model_id": LLAMA8, "state": "unverified"}],
    }
    assert verification(conn, world["mine"]) == "unverified"
    assert post({"node": "my-4090"}).status_code == 409  # nothing failed any more

    # By id, with a signed-in user's token as the page sends it.
    fail_model(conn, world["mine"])
    token = stack.user_token(PLACEHOLDER_SECRET, owner, None)
    again = post({"node": str(world["mine"])}, token)
    assert again.status_code == 200 and again.json()["models"] == [
        {"model_id": LLAMA8, "state": "unverified"}
    ]


def test_the_page_shows_each_models_verification_and_asks_again_for_a_failed_one(
    conn: psycopg.Connection, gateway: str, gateway_settings: dict[str, Any], open_page: Opener
) -> None:
    page, watch = sign_in(open_page, gateway, gateway_settings)
    world = failed_world(conn, local_owner(conn))
    page.goto(f"{gateway}/nodes")
    expect(page.locator("#total-held")).to_have_text("$0.17")
    expect(page.locator("#total-forfeited")).to_have_text("$0.51")
    expect(page.locator("#total-net")).to_have_text("$3.91")

    failed = page.locator('#nodes-body tr[data-name="my-4090"] li[data-state="failed"]')
    expect(failed).to_contain_text(LLAMA8)
    expect(failed).to_contain_text("0 passed, 2 failed")
    expect(failed.locator(".last-failure")).to_have_text(f"Last failure: {REASON}")
    unverified = page.locator('#nodes-body tr[data-name="my-a100"] li[data-state="unverified"]')
    expect(unverified).to_contain_text(LLAMA8)
    expect(page.locator('#nodes-body tr[data-name="my-a100"] button')).to_have_count(0)  # nothing to ask
    screenshot(page, "owner-nodes-verification-1280")

    failed.get_by_role("button", name=f"Verify {LLAMA8} on my-4090 again").click()
    expect(page.locator("#verify-status")).to_contain_text(f"my-4090: {LLAMA8} starts over, unverified")
    expect(page.locator('#nodes-body tr[data-name="my-4090"] li[data-model]')).to_have_attribute(
        "data-state", "unverified"
    )
    expect(page.locator('#nodes-body tr[data-name="my-4090"] button')).to_have_count(0)
    assert verification(conn, world["mine"]) == "unverified"
    watch.assert_clean()
