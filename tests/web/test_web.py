"""The web UI in real headless Chromium (Debian's, driven by Playwright): the fleet map and its live
updates, sign-in, API keys and the operator page; and the JSON API behind the pages.

Screenshots go to $TEST_ARTIFACTS_DIR/web (default test-artifacts/web)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import jwt
import openai
import psycopg
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from neuralgrid.server import stack
from neuralgrid.server.app import create_app
from neuralgrid.server.serving import ThreadedServer, free_port
from neuralgrid.server.settings import PLACEHOLDER_SECRET, Settings
from neuralgrid.web import signin
from tests.conftest import LLAMA8, make_node, make_user, wait_for

CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--no-first-run",
]
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR") or Path(__file__).parents[2] / "test-artifacts") / "web"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@pytest.fixture
def gateway_settings(tmp_path: Path) -> dict[str, Any]:
    """The gateway keeps its sign-in tokens under this test's own home."""
    return {
        "NEURALGRID_KEY_CACHE_TTL_S": 30,
        "NEURALGRID_FIRST_BYTE_TIMEOUT_S": 5,
        "NEURALGRID_HOME": tmp_path,
    }


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (./dev test installs it with apt)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@dataclass
class Watch:
    """What a page did that it must not: leave loopback, fail a request, log an error."""

    problems: list[str] = field(default_factory=list)

    def assert_clean(self) -> None:
        assert not self.problems, "\n".join(self.problems)


Opener = Callable[..., tuple[Page, Watch]]


@pytest.fixture
def open_page(browser: Browser) -> Iterator[Opener]:
    """Factory: a page in a fresh browser context (its own storage), watched, at a URL."""
    contexts = []

    def open_(url: str, *, width: int = 1280, height: int = 860) -> tuple[Page, Watch]:
        context = browser.new_context(viewport={"width": width, "height": height})
        contexts.append(context)
        page = context.new_page()
        watch = Watch()

        def check_host(url: str) -> None:
            if (
                urlsplit(url).scheme in ("http", "https", "ws", "wss")
                and urlsplit(url).hostname not in LOOPBACK
            ):
                watch.problems.append(f"request off loopback: {url}")

        page.on("request", lambda r: check_host(r.url))
        page.on("websocket", lambda ws: check_host(ws.url))

        # ERR_ABORTED is the browser dropping a request because the page navigated (sign-in redirects,
        # reloads), not a request that failed.
        def failed(r: Any) -> None:
            if r.failure != "net::ERR_ABORTED":
                watch.problems.append(f"request failed: {r.url} ({r.failure})")

        def answered(r: Any) -> None:
            if r.status >= 400:
                watch.problems.append(f"HTTP {r.status}: {r.url}")

        def console(m: Any) -> None:
            if m.type == "error":
                watch.problems.append(f"console error: {m.text}")

        page.on("requestfailed", failed)
        page.on("response", answered)
        page.on("console", console)
        page.on("pageerror", lambda err: watch.problems.append(f"page error: {err}"))
        page.goto(url)
        return page, watch

    yield open_
    for context in contexts:
        context.close()


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=ARTIFACTS / f"{name}.png", full_page=True)


def signin_link(gateway: str, gateway_settings: dict[str, Any]) -> str:
    """What `neuralgrid up` prints, for the same home as the gateway's."""
    link = signin.signin_link(Settings(**gateway_settings), gateway)
    assert link is not None
    return link


def sign_in(
    open_page: Opener, gateway: str, gateway_settings: dict[str, Any], **size: int
) -> tuple[Page, Watch]:
    page, watch = open_page(signin_link(gateway, gateway_settings), **size)
    page.wait_for_url(f"{gateway}/keys")
    expect(page.locator("#session")).to_contain_text("owner@localhost")
    return page, watch


def no_horizontal_overflow(page: Page) -> bool:
    return bool(page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth"))


def marker(page: Page, name: str) -> Any:
    return page.locator(f'#map g.node[aria-label^="{name}:"]')


def wait_live(page: Page) -> None:
    expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=10_000)


# The fleet map ---------------------------------------------------------------------------------------


def fleet(conn: psycopg.Connection) -> dict[str, uuid.UUID]:
    return {
        "alpha-online": make_node(conn, "alpha-online", hourly_rate=0.35),
        "bravo-busy": make_node(
            conn,
            "bravo-busy",
            inflight=2,
            max_concurrency=2,
            hourly_rate=2.1,
            gpu_model="NVIDIA H100 80GB HBM3",
        ),
        "charlie-draining": make_node(
            conn, "charlie-draining", status="draining", latitude=35.68, longitude=139.7
        ),
        "delta-offline": make_node(conn, "delta-offline", status="offline", latitude=-33.85, longitude=151.2),
        "echo-nowhere": make_node(conn, "echo-nowhere", latitude=None, longitude=None, hourly_rate=0.1),
    }


def test_the_map_shows_the_fleet_without_leaving_loopback(
    conn: psycopg.Connection, gateway: str, open_page: Opener
) -> None:
    fleet(conn)
    page, watch = open_page(gateway)
    expect(page.locator("#map g.node")).to_have_count(4)  # echo-nowhere has no location
    expect(page.locator("#nodes-body tr")).to_have_count(5)
    for name, status in [
        ("alpha-online", "online"),
        ("bravo-busy", "busy"),
        ("charlie-draining", "draining"),
        ("delta-offline", "offline"),
    ]:
        dot = marker(page, name)
        expect(dot).to_have_attribute("data-status", status)
        expect(dot).to_have_class(f"node s-{status}")
        assert f"{name}: {status}," in (dot.get_attribute("aria-label") or "")
        expect(page.locator(f'#nodes-body tr[data-status="{status}"]', has_text=name)).to_have_count(1)
    expect(page.locator("#legend li[data-status]")).to_have_count(4)
    expect(page.locator("#node-count")).to_contain_text("1 without a location")
    # The country shapes are drawn from the vendored world atlas.
    assert len(page.locator("#map path.land").get_attribute("d") or "") > 10_000
    # Stats count online and busy nodes (alpha, bravo, echo), never draining or offline ones.
    expect(page.locator("#stat-online")).to_have_text("3")
    expect(page.locator("#cheapest")).to_contain_text("$0.10")
    wait_live(page)
    screenshot(page, "map-1280")
    watch.assert_clean()


def test_the_map_shows_the_demo_fleet(conn: psycopg.Connection, gateway: str, open_page: Opener) -> None:
    """The 24 nodes a newcomer sees after `./dev up`, on the map and in the table."""
    from neuralgrid.admin import fleet as fleet_files
    from neuralgrid.dev.demo import DEMO_FLEET

    specs = fleet_files.read_fleet(DEMO_FLEET)
    fleet_files.import_fleet(conn, specs)
    page, watch = open_page(gateway)
    expect(page.locator("#map g.node")).to_have_count(len(specs))
    expect(page.locator("#nodes-body tr")).to_have_count(len(specs))
    expect(page.locator("#stat-online")).to_have_text(str(len(specs)))
    wait_live(page)
    screenshot(page, "map-demo-1280")
    watch.assert_clean()


def test_the_node_card_opens_by_keyboard_and_shows_the_node(
    conn: psycopg.Connection, gateway: str, open_page: Opener
) -> None:
    fleet(conn)
    page, watch = open_page(gateway)
    expect(page.locator("#map g.node")).to_have_count(4)
    # Tab from the top of the page reaches a marker.
    for _ in range(20):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.classList.contains('node')"):
            break
    else:
        pytest.fail("no map marker is reachable with Tab")
    marker(page, "alpha-online").focus()
    page.keyboard.press("Enter")
    card = page.locator("#card")
    expect(card).to_be_visible()
    for text in [
        "alpha-online",
        "1 \u00d7 NVIDIA GeForce RTX 4090",  # x: the multiplication sign
        "24 GB",
        "165 TFLOPS",
        "$0.35 per hour",
        "eu-west",
        LLAMA8,
        "0/4 in flight",
        "queue 0",
        "no jobs yet",
    ]:
        expect(card).to_contain_text(text)
    # The last heartbeat, as a relative time (seconds old: a loaded CI machine takes a few to get here).
    expect(card.locator("time")).to_have_text(re.compile(r"^(just now|\d+ s ago)$"))
    expect(marker(page, "alpha-online")).to_have_attribute("aria-expanded", "true")
    expect(page.locator('#nodes-body tr.selected[data-status="online"]')).to_contain_text("alpha-online")
    screenshot(page, "map-card-1280")
    page.keyboard.press("Escape")
    expect(card).to_be_hidden()
    assert page.evaluate("document.activeElement.getAttribute('aria-label')").startswith("alpha-online:")
    # Hovering opens a card too, and leaving closes it.
    marker(page, "bravo-busy").hover()
    expect(card).to_contain_text("2/2 in flight")
    page.mouse.move(5, 5)
    expect(card).to_be_hidden()
    watch.assert_clean()


def test_the_node_table_sorts_by_click_and_by_keyboard(
    conn: psycopg.Connection, gateway: str, open_page: Opener
) -> None:
    fleet(conn)
    page, watch = open_page(gateway)
    rows = page.locator("#nodes-body tr th")
    expect(rows).to_have_count(5)
    price = page.locator("#nodes-head th", has_text="$/h")
    expect(price).to_have_attribute("aria-sort", "none")
    price.locator("button").click()
    expect(price).to_have_attribute("aria-sort", "ascending")
    expect(rows.first).to_have_text("echo-nowhere")  # sorted by the database: the page is read again
    expect(rows.last).to_have_text("bravo-busy")
    page.keyboard.press("Enter")  # the header button keeps focus after sorting
    expect(price).to_have_attribute("aria-sort", "descending")
    expect(rows.first).to_have_text("bravo-busy")
    expect(page.locator("#nodes-head th", has_text="Node")).to_have_attribute("aria-sort", "none")
    watch.assert_clean()


def test_a_node_set_offline_turns_red_within_three_seconds(
    conn: psycopg.Connection, gateway: str, open_page: Opener
) -> None:
    """The fleet's summary on map:summary (at most a second after the change) tells the page that a
    tile in its view changed; it reads the view again."""
    nodes = fleet(conn)
    page, watch = open_page(gateway)
    wait_live(page)
    dot = marker(page, "alpha-online")
    expect(dot).to_have_attribute("data-status", "online")
    started = time.monotonic()
    conn.execute("update public.nodes set status = 'offline' where id = %s", (nodes["alpha-online"],))
    expect(dot).to_have_attribute("data-status", "offline", timeout=3000)
    expect(dot).to_have_class("node s-offline")
    assert "alpha-online: offline," in (dot.get_attribute("aria-label") or "")
    assert time.monotonic() - started < 3.0
    expect(page.locator('#nodes-body tr[data-status="offline"]', has_text="alpha-online")).to_have_count(1)
    expect(page.locator("#stat-online")).to_have_text("2")  # the summary's totals
    watch.assert_clean()


def test_nodes_appear_and_disappear_live(conn: psycopg.Connection, gateway: str, open_page: Opener) -> None:
    fleet(conn)
    page, watch = open_page(gateway)
    wait_live(page)
    expect(page.locator("#map g.node")).to_have_count(4)
    new = make_node(conn, "foxtrot-new", latitude=48.86, longitude=2.35)
    expect(marker(page, "foxtrot-new")).to_have_attribute("data-status", "online", timeout=3000)
    expect(page.locator("#nodes-body tr")).to_have_count(6)
    # The view's rows are node_map's: the card lists the warm model.
    marker(page, "foxtrot-new").click()
    expect(page.locator("#card")).to_contain_text(LLAMA8)
    conn.execute("delete from public.nodes where id = %s", (new,))
    expect(marker(page, "foxtrot-new")).to_have_count(0, timeout=3000)
    expect(page.locator("#nodes-body tr")).to_have_count(5)
    expect(page.locator("#card")).to_be_hidden()
    watch.assert_clean()


def test_a_heartbeat_pulses_the_node_and_updates_its_load(
    conn: psycopg.Connection, gateway: str, open_page: Opener
) -> None:
    """A heartbeat is no message (issue 41): the page reads the nodes it shows again every 5 s, and
    pulses those that beat since."""
    nodes = fleet(conn)
    conn.execute(
        "update public.nodes set last_heartbeat_at = now() - interval '20 seconds' where id = %s",
        (nodes["alpha-online"],),
    )
    page, watch = open_page(gateway)
    wait_live(page)
    ring = marker(page, "alpha-online").locator(".pulse")
    expect(ring).not_to_have_class("pulse pulsing")
    marker(page, "alpha-online").focus()
    page.keyboard.press("Enter")
    expect(page.locator("#card time")).to_contain_text("s ago")
    close = page.get_by_role("button", name="Close node details")
    close.focus()
    conn.execute(
        "update public.nodes set last_heartbeat_at = now(), gpu_utilization = 0.5, queue_depth = 3 where id = %s",
        (nodes["alpha-online"],),
    )
    expect(ring).to_have_class("pulse pulsing", timeout=8000)
    expect(page.locator("#card")).to_contain_text("GPU 50%")
    expect(page.locator("#card")).to_contain_text("queue 3")
    expect(page.locator("#card time")).to_have_text(re.compile(r"^(just now|\d s ago)$"))  # not 20 s ago
    expect(close).to_be_focused()  # the live update did not take keyboard focus away
    watch.assert_clean()


def test_the_map_marks_the_nodes_that_failed_verification(
    conn: psycopg.Connection, gateway: str, open_page: Opener
) -> None:
    """A node that failed verification is ringed on the map, said so in its marker's name, its card and
    the table; one that fails while the page is open is marked when its row is read again."""
    from tests.db.test_verification_on_the_map import fail_model, pin_model

    nodes = fleet(conn)
    pin_model(conn)
    fail_model(conn, nodes["alpha-online"])
    page, watch = open_page(gateway)
    cheat = marker(page, "alpha-online")
    expect(cheat).to_have_attribute("data-verification", "failed")
    expect(cheat).to_have_class("node s-online verify-failed")
    expect(cheat.locator(".verify-ring")).to_be_visible()
    assert "alpha-online: online, failed verification," in (cheat.get_attribute("aria-label") or "")
    honest = marker(page, "charlie-draining")
    expect(honest).to_have_attribute("data-verification", "unverified")
    expect(honest.locator(".verify-ring")).to_be_hidden()
    expect(page.locator("#legend [data-key='verify-failed']")).to_contain_text("failed verification")
    row = page.locator(f'#nodes-body tr[data-id="{nodes["alpha-online"]}"]')
    expect(row.locator("[data-label='Status']")).to_contain_text("failed verification")
    expect(page.locator(f'#nodes-body tr[data-id="{nodes["charlie-draining"]}"] .check')).to_have_count(0)
    cheat.click()
    expect(page.locator("#card")).to_contain_text("failed: a model it serves did not pass")
    screenshot(page, "map-verification-failed-1280")
    page.keyboard.press("Escape")

    fail_model(conn, nodes["delta-offline"])  # the rows on show are read again every 5 s
    expect(marker(page, "delta-offline")).to_have_class("node s-offline verify-failed", timeout=12_000)
    expect(page.locator(f'#nodes-body tr[data-id="{nodes["delta-offline"]}"]')).to_contain_text(
        "failed verification"
    )
    watch.assert_clean()


def test_the_map_without_its_libraries_says_what_to_run(
    conn: psycopg.Connection, gateway: str, open_page: Opener, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet(conn)
    monkeypatch.setenv("NEURALGRID_WEB_VENDOR_DIR", str(tmp_path / "empty"))
    page, _ = open_page(gateway)
    expect(page.locator("#map-error")).to_contain_text("npm install")
    expect(page.locator("#nodes-body tr")).to_have_count(5)  # the table works without the map


# Sign-in, keys and the operator page -----------------------------------------------------------------


def test_the_signin_link_works_once(
    gateway: str, gateway_settings: dict[str, Any], open_page: Opener
) -> None:
    link = signin_link(gateway, gateway_settings)
    page, watch = open_page(link)
    page.wait_for_url(f"{gateway}/keys")
    expect(page.locator("#session")).to_contain_text("owner@localhost")
    expect(page.locator("#create-form")).to_be_visible()
    page.get_by_role("button", name="Sign out").click()
    expect(page.locator("#signin-needed")).to_contain_text("neuralgrid up")
    watch.assert_clean()

    again, _ = open_page(link)
    expect(again.locator("#signin-error")).to_contain_text("already used")
    assert "token" not in again.url  # the fragment is cleared at once
    token = link.split("#token=")[1]
    reply = httpx.post(f"{gateway}/api/auth/signin", json={"token": token})
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "invalid_signin_token"

    # Without a session the keys page says how to get one.
    visitor, _ = open_page(f"{gateway}/keys")
    expect(visitor.locator("#signin-needed")).to_contain_text("neuralgrid up")
    expect(visitor.locator("#signed-in")).to_be_hidden()


def test_signin_tokens_expire_and_are_stored_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(NEURALGRID_HOME=tmp_path)
    token = signin.issue_signin_token(settings)
    assert token not in signin.tokens_file(settings).read_text()
    later = time.time() + signin.TOKEN_TTL_S + 1
    monkeypatch.setattr(time, "time", lambda: later)  # the clock signin reads
    assert not signin.consume_signin_token(settings, token)
    monkeypatch.undo()
    fresh = signin.issue_signin_token(settings)
    assert signin.consume_signin_token(settings, fresh)
    assert not signin.consume_signin_token(settings, fresh)
    assert (
        signin.signin_link(settings.model_copy(update={"supabase_url": "https://x.supabase.co"}), "h") is None
    )


def test_a_key_created_on_the_keys_page_works_with_the_sdk_and_can_be_revoked(
    fake_nodes: Any, gateway: str, gateway_settings: dict[str, Any], open_page: Opener
) -> None:
    fake_nodes("web-node")
    page, watch = sign_in(open_page, gateway, gateway_settings)
    posts: list[str] = []

    def posted(r: Any) -> None:
        if r.method == "POST":
            posts.append(r.url)

    page.on("request", posted)

    # Bad input is explained next to each field, and nothing is sent.
    page.fill("#key-rpm", "0")
    page.fill("#key-budget", "-1")
    page.click("#create-form button[type=submit]")
    expect(page.locator("#key-name-error")).to_contain_text("Give the key a name")
    expect(page.locator("#key-rpm-error")).to_contain_text("whole number")
    expect(page.locator("#key-budget-error")).to_contain_text("0 or more")
    expect(page.locator("#key-name")).to_be_focused()
    assert posts == []
    # The gateway's own refusals show too (a budget beyond what the column holds).
    page.fill("#key-name", "too rich")
    page.fill("#key-rpm", "")
    page.fill("#key-budget", "1000000000000")
    page.click("#create-form button[type=submit]")
    expect(page.locator("#create-error")).to_contain_text("Could not create the key")

    page.fill("#key-name", "web test")
    page.fill("#key-rpm", "600")
    page.fill("#key-budget", "5")
    page.click("#create-form button[type=submit]")
    expect(page.locator("#new-key")).to_be_visible()
    key = page.locator("#new-key-value").inner_text()
    assert key.startswith("ng-")
    expect(page.locator("#snippet")).to_contain_text(f'base_url="{gateway}/v1"')
    row = page.locator("#keys-body tr", has_text="web test")
    expect(row).to_contain_text("600 req/min")
    expect(row).to_contain_text("of $5.00")
    screenshot(page, "keys-created-1280")

    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=20) as sdk:
        assert LLAMA8 in {m.id for m in sdk.models.list()}
        reply = sdk.chat.completions.create(model=LLAMA8, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content

        # Last used: just now, once the job's end is written (behind the answer, with leases: the page
        # read before that says "never", and a clean-clone run once reloaded that soon).
        deadline = time.monotonic() + 10
        page.reload()
        while "never" in row.inner_text() and time.monotonic() < deadline:
            time.sleep(0.3)
            page.reload()
        expect(row).not_to_contain_text("never")
        row.get_by_role("button", name="Revoke web test").click()
        row.get_by_role("button", name="Confirm: revoke web test").click()
        expect(page.locator("#keys-status")).to_contain_text('Revoked "web test"')
        expect(page.locator('#keys-body tr[data-revoked="true"]')).to_contain_text("web test")

        def refused() -> bool:
            try:
                sdk.models.list()
            except openai.AuthenticationError:
                return True
            return False

        wait_for(refused, timeout=5)
    # The one refusal above (400 from POST /v1/keys, which Chromium also logs) was the point.
    refusal = (
        f"HTTP 400: {gateway}/v1/keys",
        "console error: Failed to load resource: the server responded with a status of 400",
    )
    assert [p for p in watch.problems if not p.startswith(refusal)] == []


def test_the_operator_page_builds_the_command_and_lists_my_nodes(
    conn: psycopg.Connection, gateway: str, gateway_settings: dict[str, Any], open_page: Opener
) -> None:
    visitor, _ = open_page(f"{gateway}/operator")
    expect(visitor.locator("#mine-signin")).to_contain_text("neuralgrid up")
    page, watch = sign_in(open_page, gateway, gateway_settings)
    row = conn.execute("select id from auth.users where email = 'owner@localhost'").fetchone()
    assert row is not None
    make_node(conn, "my-node", owner_id=row[0], hourly_rate=0.42)
    make_node(conn, "someone-elses")
    page.goto(f"{gateway}/operator")
    expect(page.locator("#mine-body tr")).to_have_count(1)
    expect(page.locator("#mine-body")).to_contain_text("my-node")
    expect(page.locator("#mine-body")).to_contain_text("$0.42")

    page.fill("#node-name", "lab box")
    page.fill("#node-region", "us-east")
    page.fill("#node-price", "0.5")
    page.fill("#node-token", "ng-abc123")
    command = page.locator("#command")
    for part in [
        "export NEURALGRID_NODE_TOKEN=ng-abc123",  # not --token: ps would show it
        "neuralgrid node run",
        f"--gateway {gateway}",
        "--backend http://127.0.0.1:8000",
        "--name 'lab box'",
        "--region us-east",
        "--price 0.5",
        "--tunnel",
    ]:
        expect(command).to_contain_text(part)
    page.fill("#node-price", "cheap")
    expect(page.locator("#node-price-error")).to_contain_text("USD per hour")
    expect(command).to_contain_text("--price <USD per hour>")
    screenshot(page, "operator-1280")
    watch.assert_clean()


def test_phone_width_has_no_horizontal_overflow(
    conn: psycopg.Connection, gateway: str, gateway_settings: dict[str, Any], open_page: Opener
) -> None:
    fleet(conn)
    page, watch = open_page(gateway, width=390, height=844)
    expect(page.locator("#map g.node")).to_have_count(4)
    marker(page, "alpha-online").click()
    expect(page.locator("#card")).to_be_visible()
    assert no_horizontal_overflow(page)
    screenshot(page, "map-390")
    keys, _ = sign_in(open_page, gateway, gateway_settings, width=390, height=844)
    keys.fill("#key-name", "phone")
    keys.click("#create-form button[type=submit]")
    expect(keys.locator("#new-key")).to_be_visible()
    assert no_horizontal_overflow(keys)
    screenshot(keys, "keys-390")
    keys.goto(f"{gateway}/operator")
    expect(keys.locator("#command")).to_contain_text("--tunnel")
    assert no_horizontal_overflow(keys)
    screenshot(keys, "operator-390")
    watch.assert_clean()


# The API and files behind the pages -------------------------------------------------------------------


def test_pages_and_files_are_served_with_their_types(gateway: str) -> None:
    for path in ("/", "/keys", "/operator", "/signin"):
        reply = httpx.get(f"{gateway}{path}")
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "text/html; charset=utf-8"
        assert reply.headers["cache-control"] == "no-cache"
        assert "default-src 'self'" in reply.headers["content-security-policy"]
    assert (
        httpx.get(f"{gateway}/static/js/map.js").headers["content-type"] == "text/javascript; charset=utf-8"
    )
    assert httpx.get(f"{gateway}/static/app.css").headers["content-type"] == "text/css; charset=utf-8"
    assert httpx.get(f"{gateway}/vendor/d3-geo.min.js").status_code == 200
    assert httpx.get(f"{gateway}/vendor/countries-110m.json").headers["content-type"] == "application/json"
    for path in ("/static/nope.js", "/static/%2e%2e/routes.py", "/vendor/package.json"):
        reply = httpx.get(f"{gateway}{path}")
        assert reply.status_code == 404
        assert reply.json()["error"]["code"] == "not_found"


def test_a_missing_vendor_file_is_a_clear_404_and_a_log_line(
    gateway: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NEURALGRID_WEB_VENDOR_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="neuralgrid.web.routes"):
        reply = httpx.get(f"{gateway}/vendor/d3-geo.min.js")
    assert reply.status_code == 404
    assert "npm install" in reply.json()["error"]["message"]
    assert any("./dev up" in r.getMessage() for r in caplog.records)


def test_api_nodes_shows_public_columns_only(conn: psycopg.Connection, gateway: str) -> None:
    node = make_node(conn, "public-one")
    conn.execute("update public.nodes set gpu_utilization = 0.25, queue_depth = 2 where id = %s", (node,))
    rows = httpx.get(f"{gateway}/api/nodes").json()["data"]
    assert [r["name"] for r in rows] == ["public-one"]
    row = rows[0]
    assert row["warm_models"] == [LLAMA8] and row["gpu_utilization"] == 0.25 and row["queue_depth"] == 2
    assert row["hourly_rate"] == 0.35
    assert not {"endpoint_url", "owner_id", "secret_hash"} & set(row)


def test_api_nodes_refuses_an_offset_past_what_sql_counts(gateway: str) -> None:
    """The fuzz sent offset=61750567224: node_list() takes an integer, and the gateway answered 500."""
    reply = httpx.get(f"{gateway}/api/nodes", params={"offset": 61750567224})
    assert reply.status_code in (400, 422), reply.text
    assert reply.json()["error"]["param"] == "offset" or "offset" in reply.json()["error"]["message"]
    assert httpx.get(f"{gateway}/api/nodes", params={"offset": 2**31 - 1}).status_code == 200


def test_api_stats_aggregates_the_fleet_and_recent_jobs(conn: psycopg.Connection, gateway: str) -> None:
    make_node(conn, "s1", vram_gb=24, tflops=165, hourly_rate=0.40)
    make_node(conn, "s2", vram_gb=24, tflops=165, hourly_rate=0.30)
    make_node(
        conn, "s3", vram_gb=80, tflops=989, hourly_rate=2.50, gpu_model="NVIDIA H100 80GB HBM3", status="busy"
    )
    make_node(conn, "s4", vram_gb=80, tflops=989, hourly_rate=0.01, status="offline")
    for latency, age in [(100, "10 seconds"), (200, "20 seconds"), (300, "30 seconds"), (900, "10 minutes")]:
        conn.execute(
            "insert into public.jobs (model_id, policy, min_vram_gb, status, latency_ms, created_at, finished_at)"
            " values (%s, 'balanced', 8, 'succeeded', %s, now() - %s::interval, now() - %s::interval)",
            (LLAMA8, latency, age, age),
        )
    conn.execute("select public.sweep()")  # the gateway's sweeper measures the jobs (every 5 s)
    stats = httpx.get(f"{gateway}/api/stats").json()
    assert stats["online_nodes"] == 3
    assert (stats["online_vram_gb"], stats["online_tflops"]) == (128, 1319)
    assert stats["jobs_last_minute"] == 3
    assert stats["p50_latency_ms"] == 200
    assert stats["cheapest"] == [
        {"gpu_model": "NVIDIA GeForce RTX 4090", "hourly_rate": 0.30},
        {"gpu_model": "NVIDIA H100 80GB HBM3", "hourly_rate": 2.50},
    ]


def test_api_config_points_supabase_js_at_the_gateway_or_a_hosted_project(
    gateway: str, gateway_settings: dict[str, Any], db_url: str
) -> None:
    cfg = httpx.get(f"{gateway}/api/config").json()
    assert cfg["mode"] == "embedded" and cfg["supabase_url"] == gateway
    secret = Settings(**gateway_settings).jwt_secret
    assert jwt.decode(cfg["anon_key"], secret, algorithms=["HS256"])["role"] == "anon"

    hosted = Settings(
        **gateway_settings,
        NEURALGRID_SUPABASE_URL="https://abcd.supabase.co",
        NEURALGRID_SUPABASE_ANON_KEY="anon-key-of-the-project",
    )
    with ThreadedServer(create_app(hosted, db_url, sweep=False)) as server:
        assert httpx.get(f"{server.url}/api/config").json() == {
            "supabase_url": "https://abcd.supabase.co",
            "anon_key": "anon-key-of-the-project",
            "mode": "supabase",
        }
        assert "wss://abcd.supabase.co" in httpx.get(server.url).headers["content-security-policy"]
        refused = httpx.post(f"{server.url}/api/auth/signin", json={"token": "x"})
        assert refused.status_code == 400 and "Supabase Auth" in refused.json()["error"]["message"]


def test_on_a_hosted_project_the_pages_sign_in_by_email(
    gateway_settings: dict[str, Any], db_url: str, open_page: Opener
) -> None:
    # A stand-in for the hosted project that stays on loopback: the gateway itself, which has no
    # Supabase Auth, so sending the email fails, and the page must say so.
    port = free_port()
    project = f"http://127.0.0.1:{port}"
    hosted = Settings(
        **gateway_settings,
        NEURALGRID_SUPABASE_URL=project,
        NEURALGRID_SUPABASE_ANON_KEY=stack.api_key(PLACEHOLDER_SECRET, "anon"),
    )
    with ThreadedServer(create_app(hosted, db_url, sweep=False), port=port):
        page, watch = open_page(f"{project}/keys")
        form = page.locator("#signin-needed")
        form.get_by_role("button", name="Email me a sign-in link").click()
        expect(form.locator("#signin-msg")).to_contain_text("Enter the email address")
        expect(page.locator("#signin-email")).to_have_attribute("aria-invalid", "true")
        page.fill("#signin-email", "dev@example.test")
        form.get_by_role("button", name="Email me a sign-in link").click()
        expect(form.locator("#signin-msg")).to_contain_text("Could not send the link")
        assert not [p for p in watch.problems if "off loopback" in p]


def test_on_a_hosted_project_the_map_reads_the_fleet_through_the_data_api(
    conn: psycopg.Connection, gateway_settings: dict[str, Any], db_url: str, open_page: Opener
) -> None:
    """supabase-js reads the map's functions (map_summary(), map_view(), node_list()) and the rows it
    shows (node_map by id) from the project's PostgREST, as anon. PostgREST cannot run here: its
    answers are made by the query it runs for them (a function called with the request's arguments
    by name, rows json_agg'd, in a transaction as the key's role), where the page sends the requests."""
    fleet(conn)
    port = free_port()
    project = f"http://127.0.0.1:{port}"
    anon_key = stack.api_key(PLACEHOLDER_SECRET, "anon")
    hosted = Settings(
        **gateway_settings, NEURALGRID_SUPABASE_URL=project, NEURALGRID_SUPABASE_ANON_KEY=anon_key
    )
    asked: list[tuple[str, str | None]] = []

    def postgrest(route: Any) -> None:
        request = route.request
        path = urlsplit(request.url).path
        asked.append((path, request.headers.get("apikey")))
        with psycopg.connect(db_url) as db, db.transaction():
            db.execute("set local role anon")
            if path.startswith("/rest/v1/rpc/"):  # a function returning jsonb: its value is the body
                function, args = path.removeprefix("/rest/v1/rpc/"), json.loads(request.post_data or "{}")
                assert function in ("map_summary", "map_view", "node_list"), function
                named = psycopg.sql.SQL(", ").join(
                    psycopg.sql.SQL("{} => {}").format(psycopg.sql.Identifier(k), psycopg.sql.Placeholder(k))
                    for k in args
                )
                call = psycopg.sql.SQL("select public.{}({})").format(psycopg.sql.Identifier(function), named)
                row = db.execute(call, args).fetchone()
            else:  # node_map?select=*&id=in.(...): the rows on show, read again
                assert path == "/rest/v1/node_map", path
                (ids,) = parse_qs(urlsplit(request.url).query)["id"]
                wanted = ids.removeprefix("in.(").removesuffix(")").split(",")
                row = db.execute(
                    "select coalesce(json_agg(m order by m.name), '[]') from public.node_map m"
                    " where m.id = any(%s::uuid[])",
                    (wanted,),
                ).fetchone()
        route.fulfill(
            status=200,
            content_type="application/json; charset=utf-8",
            body=json.dumps(row[0] if row else None),
        )

    with ThreadedServer(create_app(hosted, db_url, sweep=False), port=port):
        page, _ = open_page("about:blank")
        page.route(f"{project}/rest/v1/**", postgrest)
        gateway_reads: list[str] = []
        page.on(
            "request",
            lambda r: gateway_reads.append(r.url) if "/api/" in r.url and "/config" not in r.url else None,
        )
        page.goto(project)
        expect(page.locator("#nodes-body tr")).to_have_count(5)
        expect(page.locator('#nodes-body tr[data-status="busy"]', has_text="bravo-busy")).to_have_count(1)
        expect(page.locator("#map g.node")).to_have_count(4)
        expect(page.locator("#stat-online")).to_have_text("3")
        expect(page.locator("#cheapest")).to_contain_text("$0.10")
        # The page's rows are read again by id (their load and heartbeats), through the Data API too.
        page.wait_for_timeout(6000)
    for function in ("map_summary", "map_view", "node_list"):
        assert (f"/rest/v1/rpc/{function}", anon_key) in asked, asked
    assert ("/rest/v1/node_map", anon_key) in asked, asked
    assert gateway_reads == []  # the fleet came through the Data API only


def test_api_my_nodes_needs_a_user_and_shows_only_theirs(conn: psycopg.Connection, gateway: str) -> None:
    assert httpx.get(f"{gateway}/api/my/nodes").status_code == 401
    owner = make_user(conn)
    make_node(conn, "theirs", owner_id=owner)
    make_node(conn, "not-theirs")
    token = stack.user_token(PLACEHOLDER_SECRET, owner, None)
    rows = httpx.get(f"{gateway}/api/my/nodes", headers={"authorization": f"Bearer {token}"}).json()["data"]
    assert [r["name"] for r in rows] == ["theirs"]
    assert "endpoint_url" not in rows[0]


def test_the_api_docs_render_without_leaving_loopback(gateway: str, open_page: Opener) -> None:
    """/docs (Swagger UI) loads its script and styles from the gateway, as the map does its
    libraries: it had asked a CDN for them, and offline it never rendered (a new user's trial)."""
    page, watch = open_page(f"{gateway}/docs")
    expect(page.locator(".swagger-ui .opblock-summary-path", has_text="/v1/chat/completions")).to_have_count(
        1
    )
    watch.assert_clean()
