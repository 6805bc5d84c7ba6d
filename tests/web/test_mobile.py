"""Every page at a phone's width (390 x 844, in headless Chromium): nothing runs off the right edge,
and every table's content can be read without scrolling sideways (the tables reflow into a card per
row); the map's table still sorts."""

from __future__ import annotations

from typing import Any

import psycopg
from playwright.sync_api import Page, expect

from tests.conftest import make_node
from tests.web.test_owner_page import local_owner, owner_world
from tests.web.test_web import Opener, fleet, marker, screenshot, sign_in

PHONE = {"width": 390, "height": 844}


def assert_fits(page: Page, name: str) -> None:
    """No horizontal overflow anywhere, and each cell of each visible table inside the viewport."""
    screenshot(page, f"{name}-390")
    width = page.evaluate("window.innerWidth")
    assert width == PHONE["width"]
    assert page.evaluate("document.documentElement.scrollWidth") <= width, name
    outside = page.evaluate(
        """(width) => [...document.querySelectorAll('table')].filter((t) => t.offsetParent !== null)
            .flatMap((t) => [...t.querySelectorAll('tbody td, tbody th, thead button, caption')])
            .filter((cell) => {
              const box = cell.getBoundingClientRect();
              return box.width > 0 && (box.left < 0 || box.right > width + 0.5);
            })
            .map((cell) => `${cell.closest('table').id || cell.closest('section')?.id || '?'}: ${cell.textContent.trim().slice(0, 40)}`)""",
        width,
    )
    assert outside == [], f"{name}: cells beyond the right edge: {outside}"
    wide = page.evaluate(
        """() => [...document.querySelectorAll('.table-wrap, .panel, header, main')]
            .filter((el) => el.offsetParent !== null && el.scrollWidth > el.clientWidth + 1)
            .map((el) => el.id || el.className)"""
    )
    assert wide == [], f"{name}: scrolls sideways: {wide}"
    nav = page.get_by_role("navigation", name="Main").get_by_role("link")
    for link in nav.all():
        box = link.bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width, name


def test_every_page_fits_a_phone(
    conn: psycopg.Connection, gateway: str, gateway_settings: dict[str, Any], open_page: Opener
) -> None:
    fleet(conn)
    page, watch = open_page(gateway, **PHONE)
    expect(page.locator("#nodes-body tr")).to_have_count(5)
    assert_fits(page, "phone-map")
    # The table's header stays a row of sort buttons, and sorting works.
    price = page.locator("#nodes-head th", has_text="$/h")
    price.locator("button").click()
    expect(price).to_have_attribute("aria-sort", "ascending")
    expect(page.locator("#nodes-body tr").first).to_contain_text("echo-nowhere")
    row = page.locator("#nodes-body tr", has_text="bravo-busy")
    last = row.locator("[data-label='Last heartbeat']")
    last.scroll_into_view_if_needed()
    expect(last).to_be_in_viewport(ratio=1)
    expect(row.locator("[data-label='Load']")).to_have_text("2/2")
    marker(page, "alpha-online").click()
    expect(page.locator("#card")).to_be_visible()
    assert_fits(page, "phone-map-card")

    signin_error, _ = open_page(f"{gateway}/signin", **PHONE)
    expect(signin_error.locator("#signin-error")).to_contain_text("neuralgrid up prints")
    assert_fits(signin_error, "phone-signin")

    keys, _ = sign_in(open_page, gateway, gateway_settings, **PHONE)
    keys.fill("#key-name", "a phone with a rather long key name")
    keys.fill("#key-budget", "5")
    keys.click("#create-form button[type=submit]")
    expect(keys.locator("#keys-body tr")).to_have_count(1)
    expect(keys.locator("#keys-body [data-label='State'] button.danger")).to_be_visible()
    assert_fits(keys, "phone-keys")

    owner = local_owner(conn)
    owner_world(conn, owner)
    make_node(conn, "a-node-with-a-long-name-of-forty-chars-x", owner_id=owner)
    keys.goto(f"{gateway}/operator")
    expect(keys.locator("#mine-body tr")).to_have_count(3)
    assert_fits(keys, "phone-operator")

    keys.goto(f"{gateway}/nodes")
    expect(keys.locator("#nodes-body tr")).to_have_count(3)
    expect(keys.locator("#earnings-body tr")).to_have_count(3)
    row = keys.locator('#nodes-body tr[data-name="my-4090"]')
    expect(row.locator("[data-label='Earned']")).to_have_text("$2.55")
    expect(row.locator("[data-label='Warm models']")).to_contain_text("meta-llama/Llama-3.1-8B-Instruct")
    assert_fits(keys, "phone-nodes")
    watch.assert_clean()
