"""`neuralgrid bench gateway`: the same load sent to a fake node, through a bare relay, through the gateway.

Four processes besides this one's load generator: Postgres, the fake node, a bare relay in front of it
(bench/relay.py: one more HTTP hop through Python, nothing else) and the gateway (`neuralgrid up`
against a scratch database). Each case sends the same load straight to the node, through the relay
and through the gateway (auth, match, proxy, metering), in alternating rounds, and reports the latency
the relay and the gateway add and the requests per second of each.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import psycopg

from neuralgrid.bench import percentiles, scratch_database, served
from neuralgrid.server.serving import free_port, run_fast

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SCRATCH_DB = "neuralgrid_bench_gateway"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Benchmark me."}], "max_tokens": 16}


def _fill(url: str, node_url: str) -> str:
    """A small fleet in front of one fake node, and a key; returns the key."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("update public.platform_settings set heartbeat_interval_s = 86400")
        for i in range(4):  # a small fleet in front of one fake node, plenty of slots
            row = conn.execute(
                "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region,"
                " endpoint_url, status, max_concurrency, last_heartbeat_at) values (%s,"
                " 'NVIDIA GeForce RTX 4090', 24, 165, 0.35, 'eu-west', %s, 'online', 256, now())"
                " returning id",
                (f"bench-{i}", node_url),
            ).fetchone()
            assert row is not None
            conn.execute(
                "insert into public.node_models (node_id, model_id) values (%s, %s)", (row[0], MODEL)
            )
        key = conn.execute("select api_key from public.create_api_key('bench')").fetchone()
    assert key is not None
    return str(key[0])


async def send_load(
    url: str, headers: dict[str, str], stream: bool, callers: int, total: int
) -> tuple[list[float], float, int]:
    """Latencies of the successful requests, the wall time, and how many failed.

    The client is aiohttp on uvloop, the leanest well-kept one: on two shared cores the load
    generator's own CPU is taken from whatever it measures (httpx spent about 1 ms a request)."""
    body = json.dumps({**BODY, "stream": stream}).encode()
    samples: list[float] = []
    failed = 0
    connector = aiohttp.TCPConnector(limit=callers)
    timeout = aiohttp.ClientTimeout(total=60)
    headers = {**headers, "content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as client:

        async def one() -> None:
            nonlocal failed
            t0 = time.perf_counter()
            try:
                async with client.post(url, data=body) as resp:
                    async for _ in resp.content.iter_any():
                        pass
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if not ok:
                failed += 1
                return
            samples.append((time.perf_counter() - t0) * 1000)

        async def worker(n: int) -> None:
            for _ in range(n):
                await one()

        for _ in range(20):  # warm connections, caches and plans
            await one()
        samples.clear()
        failed = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(total // callers) for _ in range(callers)))
        return samples, time.perf_counter() - t0, failed


ROUNDS = 4  # each case alternates its targets round by round, so that drift spreads over all three


def run(
    admin_url: str, callers: list[int], requests: int, progress: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    node_port, relay_port, gateway_port = free_port(), free_port(), free_port()
    node_url = f"http://127.0.0.1:{node_port}"
    relay_url, gateway_url = f"http://127.0.0.1:{relay_port}", f"http://127.0.0.1:{gateway_port}"
    with scratch_database(admin_url, SCRATCH_DB) as db_url:
        key = _fill(db_url, node_url)
        env = {**os.environ, "DATABASE_URL": db_url, "NEURALGRID_PORT": str(gateway_port)}
        cli = [sys.executable, "-m", "neuralgrid.cli"]
        relay = [
            sys.executable,
            "-m",
            "neuralgrid.bench.relay",
            "--node",
            node_url,
            "--port",
            str(relay_port),
        ]
        targets = {
            "direct": (node_url, {}),
            "relay": (relay_url, {}),
            "gateway": (gateway_url, {"authorization": f"Bearer {key}"}),
        }
        results: list[dict[str, Any]] = []
        with (
            served([*cli, "fake-node", "--port", str(node_port)], env, f"{node_url}/v1/models"),
            served(relay, env, relay_url),
            served([*cli, "up"], env, f"{gateway_url}/readyz"),
        ):
            for stream in (False, True):
                for n in callers:
                    total = requests if n == 1 else requests * 4
                    progress(
                        f"{'stream' if stream else 'plain'} x{n}: direct, relay and gateway, {ROUNDS} rounds"
                    )
                    runs = _alternate(targets, stream, n, max(n, total // ROUNDS))
                    d, r, g = (runs[name] for name in targets)
                    results.append(
                        {
                            "stream": stream,
                            "callers": n,
                            "requests": total,
                            **runs,
                            "added_p50_ms": round(g["p50_ms"] - d["p50_ms"], 3),
                            "added_p99_ms": round(g["p99_ms"] - d["p99_ms"], 3),
                            "relay_added_p50_ms": round(r["p50_ms"] - d["p50_ms"], 3),
                            "relay_added_p99_ms": round(r["p99_ms"] - d["p99_ms"], 3),
                        }
                    )
    return results


def _alternate(
    targets: dict[str, tuple[str, dict[str, str]]], stream: bool, callers: int, per_round: int
) -> dict[str, dict[str, Any]]:
    """The same load sent to each target in turn, ROUNDS times, the order reversed every round;
    each target's latencies and time pooled over its rounds."""
    samples: dict[str, list[float]] = {name: [] for name in targets}
    wall = dict.fromkeys(targets, 0.0)
    errors = dict.fromkeys(targets, 0)
    names = list(targets)
    for i in range(ROUNDS):
        for name in names if i % 2 == 0 else names[::-1]:
            url, headers = targets[name]
            lat, took, failed = run_fast(
                send_load(f"{url}/v1/chat/completions", headers, stream, callers, per_round)
            )
            samples[name] += lat
            wall[name] += took
            errors[name] += failed
    return {
        name: {
            **percentiles(samples[name]),
            "rps": round(len(samples[name]) / wall[name], 1),
            "errors": errors[name],
        }
        for name in targets
    }
