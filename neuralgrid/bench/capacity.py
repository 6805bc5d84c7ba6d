"""`neuralgrid bench capacity`: the platform at its default settings under more callers than slots.

Two fake nodes with the default 4 slots each (8 in all) answer after `--work-ms` (LLM work, shrunk),
behind one gateway or several on one database (`--gateways 3`: `neuralgrid up` processes, the load
spread over them in turn). Each case sends `--requests` requests from `callers` clients that each
send one after another, and reports what was refused (503), how long requests waited for a slot
(the x-neuralgrid-queue-ms header), latency, requests/s, and the CPU the gateways and Postgres spent
per request (their processes' CPU time over the case, divided by the requests served).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from neuralgrid.bench import bench_fleet, percentiles, scratch_database, served, tree_cpu_s
from neuralgrid.server.serving import free_port, run_fast

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SCRATCH_DB = "neuralgrid_bench_capacity"
SLOTS_PER_NODE = 4  # the default max_concurrency
NODES = 2


def run(
    admin_url: str,
    callers: list[int],
    requests: int,
    work_ms: float,
    gateways: int,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    node_ports = [free_port() for _ in range(NODES)]
    gateway_ports = [free_port() for _ in range(gateways)]
    with scratch_database(admin_url, SCRATCH_DB) as db_url, ExitStack() as stack:
        key = bench_fleet(db_url, [f"http://127.0.0.1:{p}" for p in node_ports], MODEL)  # default slots
        cli = [sys.executable, "-m", "neuralgrid.cli"]
        env = {**os.environ, "DATABASE_URL": db_url}
        for port in node_ports:
            url = f"http://127.0.0.1:{port}"
            args = [*cli, "fake-node", "--port", str(port), "--latency-s", str(work_ms / 1000)]
            stack.enter_context(served(args, env, f"{url}/v1/models"))
        procs = []
        for port in gateway_ports:
            url = f"http://127.0.0.1:{port}"
            gateway_env = {**env, "NEURALGRID_PORT": str(port)}
            procs.append(stack.enter_context(served([*cli, "up"], gateway_env, f"{url}/readyz")))
        urls = [f"http://127.0.0.1:{port}/v1/chat/completions" for port in gateway_ports]
        postgres = _postmaster(db_url)
        results = []
        for stream in (False, True):
            for n in callers:
                progress(f"{'stream' if stream else 'plain'}: {n} callers on {NODES * SLOTS_PER_NODE} slots")
                before = _cpu([p.pid for p in procs]), tree_cpu_s(postgres)
                case = run_fast(_load(urls, key, stream, n, max(requests, n)))
                gateway_cpu = _cpu([p.pid for p in procs]) - before[0]
                postgres_cpu = tree_cpu_s(postgres) - before[1]
                served_n = max(case["served"], 1)
                results.append(
                    {
                        "stream": stream,
                        "callers": n,
                        "slots": NODES * SLOTS_PER_NODE,
                        "gateways": gateways,
                        **case,
                        "gateway_cpu_ms_per_request": round(gateway_cpu * 1000 / served_n, 3),
                        "postgres_cpu_ms_per_request": round(postgres_cpu * 1000 / served_n, 3),
                    }
                )
    return results


def _postmaster(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("show data_directory").fetchone()
    assert row is not None
    return int((Path(row[0]) / "postmaster.pid").read_text().split()[0])


def _cpu(pids: list[int]) -> float:
    return sum(tree_cpu_s(pid) for pid in pids)


async def _load(urls: list[str], key: str, stream: bool, callers: int, total: int) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Wait your turn."}],
            "max_tokens": 16,
            "stream": stream,
        }
    ).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    latencies: list[float] = []
    waits: list[float] = []
    refused = failed = 0
    connector = aiohttp.TCPConnector(limit=callers)
    async with aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=120)
    ) as client:

        async def caller(index: int, count: int) -> None:
            nonlocal refused, failed
            for i in range(count):
                url = urls[(index + i) % len(urls)]
                started = time.perf_counter()
                try:
                    async with client.post(url, data=body) as resp:
                        async for _ in resp.content.iter_any():
                            pass
                        status, waited = resp.status, resp.headers.get("x-neuralgrid-queue-ms")
                except (aiohttp.ClientError, TimeoutError):
                    failed += 1
                    continue
                if status == 503:
                    refused += 1
                elif status != 200:
                    failed += 1
                else:
                    latencies.append((time.perf_counter() - started) * 1000)
                    waits.append(float(waited or 0))

        started = time.perf_counter()
        await asyncio.gather(*(caller(i, total // callers) for i in range(callers)))
        wall = time.perf_counter() - started
    wait = percentiles(waits) if len(waits) > 1 else {"p50_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0}
    return {
        "requests": total // callers * callers,
        "served": len(latencies),
        "refused_503": refused,
        "failed": failed,
        **(percentiles(latencies) if len(latencies) > 1 else {}),
        "queue_wait_p50_ms": wait["p50_ms"],
        "queue_wait_p99_ms": wait["p99_ms"],
        "queue_wait_max_ms": round(max(waits, default=0.0), 3),
        "rps": round(len(latencies) / wall, 1),
    }
