"""`neuralgrid bench health`: how fast the platform notices a dead node, and what a tunnel costs.

Real processes: a fake backend, the gateway (`neuralgrid up` on a scratch database) and node agents
(`neuralgrid node run`). For each kind of death (the agent process killed, a tunnel dropped, an agent
gone silent) it measures the time from the death to the node being offline in the database and to
the first request that no longer tries it, while a standby node keeps serving. Then it compares one
node reached directly with one reached through a tunnel.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import httpx
import psycopg

from neuralgrid.bench import BODY, MODEL, chat_body, percentiles, scratch_database, send_load, served
from neuralgrid.bench.gateway import WARMUP
from neuralgrid.server.serving import free_port, run_fast

SCRATCH_DB = "neuralgrid_bench_health"


@contextmanager
def _agent(
    cli: list[str],
    env: dict[str, str],
    gateway: str,
    key: str,
    backend: str,
    name: str,
    price: float,
    tunnel: bool,
) -> Iterator[subprocess.Popen[bytes]]:
    args = [
        *cli,
        "node",
        "run",
        "--gateway",
        gateway,
        "--token",
        key,
        "--backend",
        backend,
        "--name",
        name,
        "--region",
        "eu-west",
        "--price",
        str(price),
        "--listen-port",
        str(free_port()),
        "--gpu-model",
        "NVIDIA GeForce RTX 4090",
        "--vram-gb",
        "24",
        "--tflops",
        "165",
        "--max-concurrency",
        "64",
    ]
    proc = subprocess.Popen(
        [*args, "--tunnel"] if tunnel else args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        proc.wait(timeout=30)


def _status(conn: psycopg.Connection, name: str) -> str | None:
    row = conn.execute("select status from public.nodes where name = %s", (name,)).fetchone()
    return None if row is None else str(row[0])


def _wait(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("the benchmark's setup did not come up in time")
        time.sleep(0.02)


def _death(
    conn: psycopg.Connection, gateway: str, key: str, dead_id: str, kill: Callable[[], None], limit_s: float
) -> dict[str, float | None]:
    """Kill; then watch the database (its own thread) and send a request every 50 ms until avoided."""
    marks: dict[str, float | None] = {"offline": None, "elsewhere": None, "avoided": None}
    headers = {"authorization": f"Bearer {key}"}
    done = threading.Event()

    def watch(url: str) -> None:
        with psycopg.connect(url, autocommit=True) as watcher:
            while not done.is_set() and marks["offline"] is None:
                if _status_by_id(watcher, dead_id) == "offline":
                    marks["offline"] = time.monotonic() - t0
                time.sleep(0.01)

    with httpx.Client(headers=headers, timeout=limit_s) as client:
        kill()
        t0 = time.monotonic()
        watcher = threading.Thread(target=watch, args=(conn.info.dsn,))
        watcher.start()
        while time.monotonic() - t0 < limit_s and (marks["offline"] is None or marks["avoided"] is None):
            try:
                resp = client.post(f"{gateway}/v1/chat/completions", json={**BODY, "max_tokens": 1})
            except httpx.HTTPError:
                continue
            now = time.monotonic() - t0
            if resp.status_code == 200 and resp.headers.get("x-neuralgrid-node") != dead_id:
                if marks["elsewhere"] is None:
                    marks["elsewhere"] = now
                if resp.headers.get("x-neuralgrid-attempts") == "1" and marks["avoided"] is None:
                    marks["avoided"] = now
            time.sleep(0.05)
        done.set()
        watcher.join()
    return {
        "to_offline_s": _r(marks["offline"]),
        "to_first_served_elsewhere_s": _r(marks["elsewhere"]),
        "to_first_request_avoiding_it_s": _r(marks["avoided"]),
    }


def _status_by_id(conn: psycopg.Connection, node_id: str) -> str | None:
    row = conn.execute("select status from public.nodes where id = %s", (node_id,)).fetchone()
    return None if row is None else str(row[0])


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def run(admin_url: str, requests: int, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    with scratch_database(admin_url, SCRATCH_DB) as url:
        backend_port, gateway_port = free_port(), free_port()
        backend, gateway = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{gateway_port}"
        env = {**os.environ, "DATABASE_URL": url, "NEURALGRID_PORT": str(gateway_port)}
        cli = [sys.executable, "-m", "neuralgrid.cli"]
        with psycopg.connect(url, autocommit=True) as conn:
            key = str(
                (conn.execute("select api_key from public.create_api_key('bench')").fetchone() or [""])[0]
            )
            silence = float(
                (
                    conn.execute(
                        "select heartbeat_interval_s * missed_heartbeats_offline"
                        " from public.platform_settings"
                    ).fetchone()
                    or [15]
                )[0]
            )
            with (
                served([*cli, "fake-node", "--port", str(backend_port)], env, f"{backend}/v1/models"),
                served([*cli, "up"], env, f"{gateway}/readyz"),
            ):
                bench = _Bench(conn, cli, env, gateway, key, backend)
                deaths = {}
                # Priced well above the nodes under test, so it ranks below them whatever the
                # reputation it earns: traffic reaches each dying node until the platform notices.
                with bench.agent("standby", 2.0, tunnel=False):
                    for scenario, tunnel, how in (
                        ("process killed", False, signal.SIGKILL),
                        ("tunnel dropped", True, signal.SIGKILL),
                        ("silent (frozen)", False, signal.SIGSTOP),
                    ):
                        progress(f"death: {scenario}")
                        deaths[scenario] = bench.death(scenario.split()[0], tunnel, how, silence * 2 + 40)
                progress("tunnel vs direct")
                overhead = {
                    mode: bench.load(f"only-{mode}", mode == "tunnel", requests)
                    for mode in ("direct", "tunnel")
                }
        added = overhead["tunnel"]["sequential"]["p50_ms"] - overhead["direct"]["sequential"]["p50_ms"]
        return {
            "offline_after_silence_s": silence,
            "deaths": deaths,
            "tunnel_vs_direct": {**overhead, "added_p50_ms": round(added, 3)},
        }


class _Bench:
    def __init__(
        self,
        conn: psycopg.Connection,
        cli: list[str],
        env: dict[str, str],
        gateway: str,
        key: str,
        backend: str,
    ) -> None:
        self.conn, self.cli, self.env, self.gateway, self.key, self.backend = (
            conn,
            cli,
            env,
            gateway,
            key,
            backend,
        )

    def agent(self, name: str, price: float, tunnel: bool) -> Any:
        return _agent(self.cli, self.env, self.gateway, self.key, self.backend, name, price, tunnel)

    def online(self, *names: str) -> None:
        _wait(lambda: all(_status(self.conn, n) == "online" for n in names), 30)

    def death(self, name: str, tunnel: bool, how: signal.Signals, limit_s: float) -> dict[str, float | None]:
        with self.agent(name, 0.3, tunnel) as proc:
            self.online(name, "standby")
            row = self.conn.execute("select id from public.nodes where name = %s", (name,)).fetchone()
            assert row is not None
            return _death(
                self.conn, self.gateway, self.key, str(row[0]), partial(proc.send_signal, how), limit_s
            )

    def load(self, name: str, tunnel: bool, requests: int) -> dict[str, Any]:
        """The same load through the gateway to one node alone, reached as `tunnel` says."""
        self.conn.execute("update public.nodes set status = 'offline'")
        auth = {"authorization": f"Bearer {self.key}"}
        target = f"{self.gateway}/v1/chat/completions"
        with self.agent(name, 0.3, tunnel):
            self.online(name)
            plain, streamed = chat_body(MODEL, False), chat_body(MODEL, True)
            sequential = run_fast(send_load([target], plain, 1, requests, headers=auth, warmup=WARMUP))
            concurrent = run_fast(
                send_load([target], streamed, 16, requests * 2, headers=auth, warmup=WARMUP)
            )
        self.conn.execute("update public.nodes set status = 'offline' where name = %s", (name,))
        unserved = sequential.refused + sequential.failed + concurrent.refused + concurrent.failed
        return {
            "sequential": percentiles(sequential.latencies_ms),
            "errors": unserved,
            "stream_x16_rps": round(len(concurrent.latencies_ms) / concurrent.wall_s, 1),
        }
