"""`neuralgrid bench gateway`: the same load sent to a fake node, through a bare relay, through a node
agent, through the gateway, and through the gateway to a node agent.

Five processes besides this one's load generator: Postgres, the fake node, a bare relay in front of
it (bench/relay.py: one more HTTP hop through Python, nothing else), the gateway (`neuralgrid up`
against a scratch database) and a node agent (`neuralgrid node run`, registered with that gateway,
its server the fake node). Each case sends the same load, in alternating rounds, to each path:

- direct: the fake node itself;
- relay: the bare relay;
- agent: the agent's signed front, each request signed with the node's key as the gateway signs;
- gateway: the gateway (auth, match, proxy, metering), to nodes with no agent in front;
- gateway_agent: the gateway, to the agent's node: the whole way a request takes in production.

It reports the latency each path adds to the direct one, the requests per second of each, and, for
the two through the agent, the agent process's CPU time per request (its on-CPU time from /proc,
read before and after each round).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from neuralgrid.bench import bench_fleet, percentiles, scratch_database, served
from neuralgrid.protocol import signing
from neuralgrid.server.serving import free_port, run_fast

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# The gateway_agent path asks for a model only the agent's node has, and the gateway path caps the
# price below the agent's: each path's requests reach its own nodes, whatever the matcher prefers.
AGENT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
AGENT_PRICE, FLEET_MAX_PRICE = "5", "1"
AGENT_NAME = "bench-agent"
SCRATCH_DB = "neuralgrid_bench_gateway"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Benchmark me."}], "max_tokens": 16}
CHAT = "/v1/chat/completions"
PATHS = ("direct", "relay", "agent", "gateway", "gateway_agent")


@dataclass(frozen=True)
class Target:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    model: str = MODEL
    key: bytes | None = None  # each request signed with it, as the gateway signs
    pid: int | None = None  # the agent process, whose CPU time per request is reported


async def send_load(
    url: str,
    headers: dict[str, str],
    stream: bool,
    callers: int,
    total: int,
    model: str = MODEL,
    key: bytes | None = None,
    pid: int | None = None,
) -> tuple[list[float], float, int, float]:
    """Latencies of the successful requests, the wall time, how many failed, and the CPU time
    process `pid` spent meanwhile (warm-up excluded). With `key`, each request is signed as the
    gateway signs it (before its clock starts).

    The client is aiohttp on uvloop, the leanest well-kept one: on two shared cores the load
    generator's own CPU is taken from whatever it measures (httpx spent about 1 ms a request)."""
    body = json.dumps({**BODY, "model": model, "stream": stream}).encode()
    samples: list[float] = []
    failed = 0
    connector = aiohttp.TCPConnector(limit=callers)
    timeout = aiohttp.ClientTimeout(total=60)
    headers = {**headers, "content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as client:

        async def one() -> None:
            nonlocal failed
            signed = {signing.HEADER: signing.sign(key, CHAT, body)} if key is not None else None
            t0 = time.perf_counter()
            try:
                async with client.post(url, data=body, headers=signed) as resp:
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
        cpu = _cpu_s(pid) if pid else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(total // callers) for _ in range(callers)))
        took = time.perf_counter() - t0
        return samples, took, failed, _cpu_s(pid) - cpu if pid else 0.0


ROUNDS = 4  # each case alternates its targets round by round, so that drift spreads over all of them
# What each path's numbers are reported as, against the direct path: "<prefix>added_p50_ms", ….
ADDED = {"relay": "relay_", "agent": "agent_", "gateway": "", "gateway_agent": "gateway_agent_"}


def run(
    admin_url: str,
    callers: list[int],
    requests: int,
    progress: Callable[[str], None] = lambda _: None,
    paths: tuple[str, ...] = PATHS,
) -> list[dict[str, Any]]:
    """Each case's numbers for the `paths` asked (the direct one always: it is the baseline)."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}: choose from {', '.join(PATHS)}")
    names = [name for name in PATHS if name == "direct" or name in paths]
    node_port, relay_port, gateway_port, agent_port = free_port(), free_port(), free_port(), free_port()
    node_url = f"http://127.0.0.1:{node_port}"
    relay_url, gateway_url = f"http://127.0.0.1:{relay_port}", f"http://127.0.0.1:{gateway_port}"
    agent_url = f"http://127.0.0.1:{agent_port}"
    with scratch_database(admin_url, SCRATCH_DB) as db_url:
        key = bench_fleet(db_url, [node_url] * 4, MODEL, max_concurrency=256)  # plenty of slots
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
        auth = {"authorization": f"Bearer {key}"}
        results: list[dict[str, Any]] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                served([*cli, "fake-node", "--port", str(node_port)], env, f"{node_url}/v1/models")
            )
            if "relay" in names:
                stack.enter_context(served(relay, env, relay_url))
            if {"gateway", "agent", "gateway_agent"} & set(names):
                stack.enter_context(served([*cli, "up"], env, f"{gateway_url}/readyz"))
            agent = None
            if {"agent", "gateway_agent"} & set(names):
                agent = stack.enter_context(_agent(db_url, gateway_url, key, node_url, agent_port))
            targets = {
                "direct": Target(node_url),
                "relay": Target(relay_url),
                "agent": Target(agent_url, key=agent[1] if agent else None, pid=agent[0] if agent else None),
                "gateway": Target(gateway_url, {**auth, "x-neuralgrid-max-price": FLEET_MAX_PRICE}),
                "gateway_agent": Target(gateway_url, auth, AGENT_MODEL, pid=agent[0] if agent else None),
            }
            targets = {name: targets[name] for name in names}
            for stream in (False, True):
                for n in callers:
                    total = requests if n == 1 else requests * 4
                    mode = "stream" if stream else "plain"
                    progress(f"{mode} x{n}: {', '.join(names)}, {ROUNDS} rounds")
                    runs = _alternate(targets, stream, n, max(n, total // ROUNDS))
                    result: dict[str, Any] = {"stream": stream, "callers": n, "requests": total, **runs}
                    d = runs["direct"]
                    for name, prefix in ADDED.items():
                        if name in runs:
                            result[f"{prefix}added_p50_ms"] = round(runs[name]["p50_ms"] - d["p50_ms"], 3)
                            result[f"{prefix}added_p99_ms"] = round(runs[name]["p99_ms"] - d["p99_ms"], 3)
                    if "gateway" in runs and "gateway_agent" in runs:  # the agent's hop behind the gateway
                        added = runs["gateway_agent"]["p50_ms"] - runs["gateway"]["p50_ms"]
                        result["agent_behind_gateway_added_p50_ms"] = round(added, 3)
                    results.append(result)
    return results


@contextlib.contextmanager
def _agent(db_url: str, gateway_url: str, key: str, node_url: str, port: int) -> Iterator[tuple[int, bytes]]:
    """`neuralgrid node run` in front of the fake node, registered with the gateway; its process id
    and the key the gateway signs its requests with, once its node is online."""
    args = [sys.executable, "-m", "neuralgrid.cli", "node", "run", "--gateway", gateway_url, "--token", key]
    args += ["--backend", node_url, "--name", AGENT_NAME, "--region", "eu-west", "--price", AGENT_PRICE]
    args += ["--listen-port", str(port), "--max-concurrency", "256", "--gpu-model", "NVIDIA GeForce RTX 4090"]
    args += ["--vram-gb", "24", "--tflops", "165"]
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - a file, not a pipe: a chatty child must never block
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True)
    online = "select secret_hash from public.nodes where name = %s and status = 'online'"
    try:
        deadline = time.monotonic() + 60
        with psycopg.connect(db_url, autocommit=True) as conn:
            while (row := conn.execute(online, (AGENT_NAME,)).fetchone()) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the node agent did not come online: {log.read()[-2000:]}")
                time.sleep(0.1)
        yield proc.pid, bytes(row[0])
    finally:
        proc.terminate()
        proc.wait(timeout=90)  # it drains first
        log.close()


def _cpu_s(pid: int) -> float:
    """A process's time on a CPU so far: its threads' nanosecond counts where the kernel keeps them
    (the clock ticks of /proc/PID/stat are 10 ms: too coarse for a round), else those ticks."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alternate(
    targets: dict[str, Target], stream: bool, callers: int, per_round: int
) -> dict[str, dict[str, Any]]:
    """The same load sent to each target in turn, ROUNDS times, the order reversed every round;
    each target's latencies, time and (through the agent) the agent's CPU pooled over its rounds."""
    samples: dict[str, list[float]] = {name: [] for name in targets}
    wall = dict.fromkeys(targets, 0.0)
    cpu = dict.fromkeys(targets, 0.0)
    errors = dict.fromkeys(targets, 0)
    names = list(targets)
    for i in range(ROUNDS):
        for name in names if i % 2 == 0 else names[::-1]:
            t = targets[name]
            lat, took, failed, used = run_fast(
                send_load(f"{t.url}{CHAT}", t.headers, stream, callers, per_round, t.model, t.key, t.pid)
            )
            cpu[name] += used
            samples[name] += lat
            wall[name] += took
            errors[name] += failed
    runs: dict[str, dict[str, Any]] = {}
    for name, t in targets.items():
        runs[name] = {
            **percentiles(samples[name]),
            "rps": round(len(samples[name]) / wall[name], 1),
            "errors": errors[name],
        }
        if t.pid:
            runs[name]["agent_cpu_ms_per_request"] = round(cpu[name] * 1000 / max(len(samples[name]), 1), 3)
    return runs
