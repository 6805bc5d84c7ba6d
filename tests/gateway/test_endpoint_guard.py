"""In production the gateway calls public node addresses only: at registration, and at connect time
for whatever a node's endpoint has become since (an owner's write, a name re-pointed inside)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from neuralgrid.server.app import create_app
from neuralgrid.server.serving import ThreadedServer
from neuralgrid.server.settings import Settings
from tests.conftest import LLAMA8

PRODUCTION: dict[str, Any] = {
    "NEURALGRID_ENV": "production",
    "NEURALGRID_JWT_SECRET": "x" * 40,
    "NEURALGRID_FIRST_BYTE_TIMEOUT_S": 5,
}
BODY = {"model": LLAMA8, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SPEC = {"name": "n", "gpu_model": "L4", "vram_gb": 24, "tflops": 121, "hourly_rate": 0.4, "region": "eu-west"}


@pytest.fixture
def production(db_url: str) -> Iterator[str]:
    with ThreadedServer(create_app(Settings(**PRODUCTION), db_url, sweep=False)) as gateway:
        yield gateway.url


def loopback_forms(port: int) -> list[str]:
    return [
        f"http://127.0.0.1:{port}",
        f"http://0x7f000001:{port}",
        f"http://127.1:{port}",
        f"http://0177.0.0.1:{port}",
        f"http://localhost:{port}",
        f"http://[::ffff:127.0.0.1]:{port}",
    ]


def test_registration_refuses_every_notation_of_loopback(production: str, api_key: str) -> None:
    auth = {"authorization": f"Bearer {api_key}"}
    for url in [*loopback_forms(8000), "http://2130706433:8000", "http://169.254.169.254"]:
        resp = httpx.post(f"{production}/v1/nodes", json={**SPEC, "endpoint_url": url}, headers=auth)
        assert resp.status_code == 400, (url, resp.text)
        assert (
            resp.json()["error"]["param"] == "endpoint_url"
            and "public address" in resp.json()["error"]["message"]
        )


@pytest.mark.parametrize("form", range(6))
def test_a_node_whose_endpoint_became_loopback_is_never_called(
    conn: psycopg.Connection, production: str, api_key: str, fake_nodes: Any, form: int
) -> None:
    """The node's row says loopback however it got there (written in SQL here, as a migration, an
    operator or a Data API write before this check would have): the gateway does not connect."""
    node = fake_nodes("inside")
    url = loopback_forms(node.server.port)[form]
    conn.execute("update public.nodes set endpoint_url = %s where id = %s", (url, node.node_id))
    resp = httpx.post(
        f"{production}/v1/chat/completions",
        json=BODY,
        headers={"authorization": f"Bearer {api_key}"},
        timeout=20,
    )
    assert resp.status_code in (502, 503), resp.text
    assert node.requests == 0


def test_development_calls_the_same_node(
    conn: psycopg.Connection, gateway: str, api_key: str, fake_nodes: Any
) -> None:
    """The control: where private endpoints are allowed (development), that node answers."""
    node = fake_nodes("inside")
    conn.execute(
        "update public.nodes set endpoint_url = %s where id = %s",
        (f"http://0x7f000001:{node.server.port}", node.node_id),
    )
    resp = httpx.post(
        f"{gateway}/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {api_key}"}
    )
    assert resp.status_code == 200 and node.requests == 1


def test_registration_refuses_an_endpoint_no_request_could_reach(gateway: str, api_key: str) -> None:
    """Found trying the API: `http://a:99999` and `http://:9` were registered, and every request
    sent to them then failed as the node's fault (502). Anywhere, not only in production."""
    auth = {"authorization": f"Bearer {api_key}"}
    for url in ("http://a:99999", "http://:9", "https://", "http://a:0", "http://a:port"):
        resp = httpx.post(
            f"{gateway}/v1/nodes", json={**SPEC, "endpoint_url": url, "models": [LLAMA8]}, headers=auth
        )
        assert resp.status_code == 400, (url, resp.text)
        assert resp.json()["error"]["param"] == "endpoint_url", resp.text
