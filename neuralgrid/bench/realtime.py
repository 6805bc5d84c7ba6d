"""`neuralgrid bench realtime`: delivery latency from a committed status change to its subscribers, and
the messages a second each map viewer receives while nodes change (issue 41).

A gateway (`neuralgrid up`, its own process) serves Realtime for a scratch database with a fleet of
nodes. N subscribers join the public `node-map` channel (vsn 1.0.0) over real WebSockets; a writer
flips node statuses at a fixed rate, each in its own transaction, and stamps the moment it sends the
UPDATE. Each subscriber timestamps each node_update broadcast it receives; latency is receipt minus
that stamp, so it includes the statement, the commit, NOTIFY, the hub's fan-out and the socket.

The subscribers are minimal but complete WebSocket clients (handshake, masked join frame, frame
parsing) on asyncio protocols: a full client library costs ~10x more CPU per message, and at 1,000
subscribers x 100 changes/s the load generator would measure itself on a 2-core machine instead of
the server. The writer runs in its own process so its pace never waits on them.

Map viewers (`--viewers`) are the same clients joined as a map page joins: to `map:summary`, the
summary the map reads since issue 41, or, as the map did before, to `node-map` with postgres_changes
on every UPDATE of nodes. Each counts the frames and bytes it receives while the writer changes
statuses; the figure is messages a second per viewer, against the changes a second.
"""

from __future__ import annotations

import asyncio
import base64
import json
import multiprocessing
import os
import re
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg

from neuralgrid.bench import percentiles, scratch_database, served
from neuralgrid.server.serving import free_port, run_fast
from neuralgrid.server.stack import api_key

SCRATCH_DB = "neuralgrid_bench_realtime"
NODES = 1000
# node_map_payload() is jsonb: keys sorted by length, so "id" comes before "status".
_NODE = re.compile(rb'"node":\{[^}]*?"id":"([0-9a-f-]{36})"[^}]*?"status":"(\w+)"')


def _frame(text: str) -> bytes:
    """A masked client text frame."""
    data = text.encode()
    mask = os.urandom(4)
    size = len(data)
    header = bytes([0x81]) + (
        bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + size.to_bytes(2, "big")
    )
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def _ws_payloads(buf: bytes) -> tuple[list[bytes], int]:
    """The payloads of the whole server frames (unmasked) at the start of `buf`, and how many of its
    bytes they took: a frame cut short waits for the rest."""
    payloads: list[bytes] = []
    offset = 0
    while len(buf) - offset >= 2:
        size, start = buf[offset + 1] & 0x7F, offset + 2
        if size == 126:
            if len(buf) - offset < 4:
                break
            size, start = int.from_bytes(buf[offset + 2 : offset + 4], "big"), offset + 4
        elif size == 127:
            if len(buf) - offset < 10:
                break
            size, start = int.from_bytes(buf[offset + 2 : offset + 10], "big"), offset + 10
        if len(buf) < start + size:
            break
        payloads.append(buf[start : start + size])
        offset = start + size
    return payloads, offset


class Subscriber(asyncio.Protocol):
    """One subscriber: upgrade, join node-map, then note (node id, status, arrival) of each update."""

    def __init__(
        self, port: int, key: str, arrivals: list[tuple[bytes, bytes, float]], joined: Callable[[], None]
    ):
        self.port, self.key, self.arrivals, self.joined = port, key, arrivals, joined
        self.buffer = b""
        self.upgraded = False
        self.is_member = False
        self.transport: Any = None  # uvloop's transports are not asyncio.Transport subclasses

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        nonce = base64.b64encode(os.urandom(16)).decode()
        self.transport.write(
            (
                f"GET /realtime/v1/websocket?apikey={self.key}&vsn=1.0.0 HTTP/1.1\r\n"
                f"Host: 127.0.0.1:{self.port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {nonce}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )

    def data_received(self, chunk: bytes) -> None:
        now = time.monotonic()
        buf = self.buffer + chunk
        if not self.upgraded:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buf
                return
            if not buf.startswith(b"HTTP/1.1 101"):
                raise RuntimeError(f"websocket refused: {buf[:80]!r}")
            self.upgraded = True
            buf = buf[end + 4 :]
            join = {"topic": "realtime:node-map", "event": "phx_join", "ref": "1", "join_ref": "1"}
            self.transport.write(_frame(json.dumps({**join, "payload": {"config": {}}})))
        payloads, used = _ws_payloads(buf)
        for payload in payloads:
            if not self.is_member:
                if b'"phx_reply"' in payload:
                    self.is_member = True
                    self.joined()
                continue
            match = _NODE.search(payload)
            if match:
                self.arrivals.append((match[1], match[2], now))
        self.buffer = buf[used:]


def write_changes(db_url: str, rate: int, seconds: float, results: Any) -> None:
    """In its own process, so its pace never waits on the subscribers: flips node statuses at
    `rate` per second and returns when each UPDATE was sent (time.monotonic is system-wide)."""
    stamps: dict[tuple[bytes, bytes], float] = {}
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute("select id::text, status from public.nodes order by name").fetchall()
        status: dict[str, str] = {node_id: current for node_id, current in rows}
        ids = list(status)
        changes = int(rate * seconds)
        t0 = time.monotonic()
        for i in range(changes):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            node_id = ids[i % len(ids)]
            status[node_id] = "offline" if status[node_id] == "online" else "online"
            stamps[(node_id.encode(), status[node_id].encode())] = time.monotonic()
            conn.execute("update public.nodes set status = %s where id = %s", (status[node_id], node_id))
        results.put((stamps, changes / (time.monotonic() - t0)))


async def _case(
    db_url: str, port: int, key: str, subscribers: int, rate: int, seconds: float
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    arrivals: list[tuple[bytes, bytes, float]] = []
    joined = 0
    all_joined = asyncio.Event()

    def one_joined() -> None:
        nonlocal joined
        joined += 1
        if joined == subscribers:
            all_joined.set()

    transports = []
    for i in range(subscribers):
        transport, _ = await loop.create_connection(
            lambda: Subscriber(port, key, arrivals, one_joined), "127.0.0.1", port
        )
        transports.append(transport)
        if i % 50 == 49:
            await asyncio.sleep(0.05)  # do not flood the accept queue
    await asyncio.wait_for(all_joined.wait(), 60)

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    writer = context.Process(target=write_changes, args=(db_url, rate, seconds, results), daemon=True)
    writer.start()
    while results.empty():
        await asyncio.sleep(0.1)
    stamps, achieved = results.get()
    writer.join()
    changes = len(stamps)
    expected = changes * subscribers
    deadline = time.monotonic() + 10
    while len(arrivals) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    for transport in transports:
        transport.close()
    latencies = [(at - stamps[(i, s)]) * 1000 for i, s, at in arrivals if (i, s) in stamps]
    return {
        "subscribers": subscribers,
        "changes": changes,
        "changes_per_s": round(achieved, 1),
        "delivered": len(latencies),
        "expected": expected,
        "lost": expected - len(latencies),
        **(percentiles(latencies) if latencies else {}),
        "max_ms": round(max(latencies), 3) if latencies else None,
    }


class Viewer(asyncio.Protocol):
    """A map viewer: upgrade, join `topic` with `config`, then count the frames and bytes it receives."""

    def __init__(self, port: int, key: str, topic: str, config: dict[str, Any], joined: Callable[[], None]):
        self.port, self.key, self.topic, self.config, self.joined = port, key, topic, config, joined
        self.buffer = b""
        self.upgraded = False
        self.is_member = False
        self.frames = 0
        self.bytes = 0
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        nonce = base64.b64encode(os.urandom(16)).decode()
        self.transport.write(
            (
                f"GET /realtime/v1/websocket?apikey={self.key}&vsn=1.0.0 HTTP/1.1\r\n"
                f"Host: 127.0.0.1:{self.port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {nonce}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )

    def data_received(self, chunk: bytes) -> None:
        buf = self.buffer + chunk
        if not self.upgraded:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buf
                return
            self.upgraded = True
            buf = buf[end + 4 :]
            join = {"topic": f"realtime:{self.topic}", "event": "phx_join", "ref": "1", "join_ref": "1"}
            self.transport.write(_frame(json.dumps({**join, "payload": {"config": self.config}})))
        payloads, used = _ws_payloads(buf)
        for payload in payloads:
            if not self.is_member:
                if b'"phx_reply"' in payload:
                    self.is_member = True
                    self.joined()
                continue
            self.frames += 1
            self.bytes += len(payload)
        self.buffer = buf[used:]


# What a map viewer subscribes to: the summary (issue 41), or every row change as the map did before
# (node-map's broadcasts of status changes and postgres_changes of every UPDATE of nodes).
FEEDS: dict[str, tuple[str, dict[str, Any]]] = {
    "summary": ("map:summary", {}),
    "rows": ("node-map", {"postgres_changes": [{"event": "UPDATE", "schema": "public", "table": "nodes"}]}),
}


async def _viewers(
    db_url: str, port: int, key: str, feed: str, viewers: int, rate: int, seconds: float
) -> dict[str, Any]:
    """`viewers` map viewers of `feed` while `rate` node statuses a second change for `seconds`."""
    loop = asyncio.get_running_loop()
    topic, config = FEEDS[feed]
    joined = asyncio.Event()
    count = 0

    def one_joined() -> None:
        nonlocal count
        count += 1
        if count == viewers:
            joined.set()

    protocols: list[Viewer] = []
    for i in range(viewers):
        _, protocol = await loop.create_connection(
            lambda: Viewer(port, key, topic, config, one_joined), "127.0.0.1", port
        )
        protocols.append(protocol)
        if i % 50 == 49:
            await asyncio.sleep(0.05)
    await asyncio.wait_for(joined.wait(), 60)
    await asyncio.sleep(2.0)  # the summary a first viewer brings
    for protocol in protocols:
        protocol.frames = protocol.bytes = 0
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    writer = context.Process(target=write_changes, args=(db_url, rate, seconds, results), daemon=True)
    started = time.monotonic()
    writer.start()
    while results.empty():
        if not writer.is_alive() and results.empty():
            raise RuntimeError(f"the writer of changes stopped (exit code {writer.exitcode})")
        await asyncio.sleep(0.1)
    _, achieved = results.get()
    writer.join()
    await asyncio.sleep(1.2)  # the last change's summary
    window = time.monotonic() - started
    frames = [p.frames for p in protocols]
    sizes = [p.bytes for p in protocols]
    for protocol in protocols:
        protocol.transport.close()
    return {
        "feed": feed,
        "viewers": viewers,
        "changes_per_s": round(achieved, 1),
        "messages_per_s_per_viewer": round(sum(frames) / viewers / window, 2),
        "most_messages_per_s": round(max(frames) / window, 2),
        "bytes_per_s_per_viewer": round(sum(sizes) / viewers / window, 1),
    }


def _fleet(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("update public.platform_settings set heartbeat_interval_s = 86400")  # no sweeps
        conn.execute(
            "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, latitude,"
            " longitude, endpoint_url, status, last_heartbeat_at)"
            " select format('bench-%%s', lpad(g::text, 4, '0')), 'NVIDIA L4', 24, 121, 0.4, 'eu-west', 50, 8,"
            " 'http://127.0.0.1:9/', 'online', now() from generate_series(1, %s) g",
            (NODES,),
        )


def run(
    admin_url: str,
    subscriber_counts: list[int],
    rate: int,
    seconds: float,
    progress: Callable[[str], None] = lambda _: None,
    viewer_counts: list[int] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The latency cases, then (issue 41) each count of map viewers on each feed: the summary the map
    reads now and the row changes it heard before."""
    port = free_port()
    secret = secrets.token_urlsafe(48)
    key = api_key(secret, "anon")
    with scratch_database(admin_url, SCRATCH_DB) as db_url:
        _fleet(db_url)
        env = {
            **os.environ,
            "DATABASE_URL": db_url,
            "NEURALGRID_PORT": str(port),
            "NEURALGRID_JWT_SECRET": secret,
        }
        results, viewers = [], []
        with served([sys.executable, "-m", "neuralgrid.cli", "up"], env, f"http://127.0.0.1:{port}/readyz"):
            for n in subscriber_counts:
                progress(f"{n} subscribers, {rate} status changes/s for {seconds:g}s")
                results.append(run_fast(_case(db_url, port, key, n, rate, seconds)))
            for n in viewer_counts or []:
                for feed in FEEDS:
                    progress(f"{n} map viewers of the {feed} feed, {rate} status changes/s for {seconds:g}s")
                    viewers.append(run_fast(_viewers(db_url, port, key, feed, n, rate, seconds)))
    return results, viewers
