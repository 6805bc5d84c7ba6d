"""`x-neuralgrid-overhead-ms` says what the gateway adds, as an observer outside would measure it:
the same requests sent straight to the node and through the gateway, interleaved so that both see
the same machine, and the difference of the medians compared with the header's median.

Measured before this test (issue 19): the header said 1.9 to 2.2 ms where the outside saw 3.0 to
4.5 ms (here, under load: 2.8 against 6.3). It counted only the time before the request left for the
node, not the completion written after the answer came back. Then 0.75 to 0.85 of the outside
figure, but 0.41 to 0.6 on a machine three times slower (CI at b411646: 1.1 against 2.7 ms): the
node's time was counted from before the gateway's HTTP client wrote the request to after it had
parsed the answer. Now the client's own timing (upstream.Timing) gives the node only the time
between: 0.80 to 0.87 on that slower machine. The rest is the gateway's server reading the request
before the app runs and writing the answer after it returns.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx
import psycopg

from neuralgrid.gateway.journal import LEASED_EVERY_S
from neuralgrid.server.serving import ThreadedServer
from tests.conftest import make_node

LLAMA8 = "meta-llama/Llama-3.1-8B-Instruct"
ROUNDS = 60


def test_the_overhead_header_matches_what_an_outside_observer_measures(
    gateway: str, api_key: str, fake_nodes: Any
) -> None:
    node = fake_nodes("timed", latency_s=0.005)
    body = {"model": LLAMA8, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    direct_s: list[float] = []
    through_s: list[float] = []
    said_ms: list[float] = []
    with (
        httpx.Client(base_url=node.server.url) as direct,
        httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {api_key}"}) as platform,
    ):
        for i in range(ROUNDS + 5):
            # Which goes first alternates: the first call after the pause pays for waking this
            # process's threads (the gateway and node run in it), more the slower the machine.
            first, second = (direct, platform) if i % 2 == 0 else (platform, direct)
            start = time.perf_counter()
            one = first.post("/v1/chat/completions", json=body)
            mid = time.perf_counter()
            two = second.post("/v1/chat/completions", json=body)
            end = time.perf_counter()
            resp = one if first is platform else two
            assert one.status_code == two.status_code == 200, resp.text
            # A job served from a lease is written behind, by the same event loop, LEASED_EVERY_S
            # after the write before at the soonest: the pause lets that write end before the next
            # round, which it would slow down (its cost is not the next request's, and shows in the
            # benchmarks' CPU per request). 30 ms covered it at a 10-ms cadence; at 50 it failed.
            time.sleep(LEASED_EVERY_S + 0.005)
            if i >= 5:  # the first few warm connections and caches up
                (direct_s if first is direct else through_s).append(mid - start)
                (through_s if first is direct else direct_s).append(end - mid)
                said_ms.append(float(resp.headers["x-neuralgrid-overhead-ms"]))
    outside_ms = (statistics.median(through_s) - statistics.median(direct_s)) * 1000
    said = statistics.median(said_ms)
    # What the header cannot see: the server parsing the request before the app runs, and writing the
    # response after it returns (a fraction of a millisecond on loopback).
    assert outside_ms * 0.7 - 0.3 <= said <= outside_ms + 0.3, (said, outside_ms)


SLOW_BODY_S = 0.3


async def _headers_then_a_slow_body(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A node that sends its status and headers at once and its answer SLOW_BODY_S later, as a
    proxy in front of a server may: the wait is the node's, whatever came first."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = json.dumps(
        {
            "id": "chatcmpl-slow",
            "object": "chat.completion",
            "created": 0,
            "model": LLAMA8,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await asyncio.sleep(SLOW_BODY_S)
    await send({"type": "http.response.body", "body": body})


def test_a_node_slow_to_send_its_body_after_its_headers_is_not_the_gateways_overhead(
    gateway: str, api_key: str, conn: psycopg.Connection
) -> None:
    with ThreadedServer(_headers_then_a_slow_body) as node:
        make_node(conn, endpoint_url=node.url)
        body = {"model": LLAMA8, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        resp = httpx.post(
            f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {api_key}"}
        )
    assert resp.status_code == 200, resp.text
    assert float(resp.headers["x-neuralgrid-overhead-ms"]) < SLOW_BODY_S * 1000 / 3
