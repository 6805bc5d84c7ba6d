"""What `bench world` and `bench chaos` stand up: gateways far from their database, on one machine.

Each far gateway is a `neuralgrid up` process whose DATABASE_URL points at a delay proxy of its own
(bench/delay.py, one process for all the links) in front of Postgres's TCP port; the reference
gateway connects to that port directly ("next to the database"). Fake nodes are `neuralgrid
fake-node` processes. Processes are started together and waited for together, and any of them can
be killed (SIGKILL) and started again on the same port: the chaos run does both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import httpx
import psycopg

from neuralgrid.bench import CHAT
from neuralgrid.bench.delay import Link
from neuralgrid.server.serving import free_port

CLI = [sys.executable, "-m", "neuralgrid.cli"]
START_S = 90.0  # a gateway's start: imports, migrations checked, pools opened, over its link


@dataclass(frozen=True)
class Gateway:
    name: str  # "next to the database", "80 ms"
    rtt_ms: float  # to Postgres; 0 for the reference
    port: int = field(default_factory=free_port)
    proxy_port: int | None = None  # its delay proxy's; None for the reference

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def chat(self) -> str:
        return f"{self.url}{CHAT}"


def gateways(rtts_ms: Sequence[float], reference: bool = True) -> list[Gateway]:
    """The reference gateway (no proxy) first when asked, then one behind a proxy per RTT."""
    far = [Gateway(f"{rtt:g} ms", rtt, proxy_port=free_port()) for rtt in rtts_ms]
    return [Gateway("next to the database", 0.0), *far] if reference else far


def postgres_tcp(url: str) -> tuple[str, int]:
    """Where Postgres listens on TCP (a URL through a unix socket names the same server's port)."""
    params = psycopg.conninfo.conninfo_to_dict(url)
    host = str(params.get("host") or "127.0.0.1")
    if host.startswith("/") or host == "localhost":
        host = "127.0.0.1"
    return host, int(params.get("port") or 5432)


def gateway_database_url(db_url: str, gateway: Gateway) -> str:
    """The gateway's DATABASE_URL: over TCP, through its proxy when it has one."""
    host, port = postgres_tcp(db_url)
    if gateway.proxy_port is not None:
        host, port = "127.0.0.1", gateway.proxy_port
    return psycopg.conninfo.make_conninfo(db_url, host=host, port=port)


@dataclass
class _Proc:
    args: list[str]
    env: dict[str, str]
    ready: str  # a URL that answers 200 once it serves, or "stdout" for a first line "ready"
    proc: subprocess.Popen[str] | None = None
    log: IO[str] | None = None


class Processes:
    """Named processes (gateways, fake nodes, the proxies), each startable again after a kill."""

    def __init__(self) -> None:
        self._procs: dict[str, _Proc] = {}
        self._waves: list[list[str]] = []  # the names of each start(), in order

    def add(self, name: str, args: list[str], env: Mapping[str, str], ready: str) -> None:
        self._procs[name] = _Proc(list(args), dict(env), ready)

    def start(self, *names: str) -> None:
        """Starts them together, and returns once every one is ready (or raises with its log)."""
        self._waves.append(list(names))
        for name in names:
            p = self._procs[name]
            if p.log is not None:  # started before: its last log goes
                p.log.close()
            p.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - a file, not a pipe: never blocks
            stdout: Any = subprocess.PIPE if p.ready == "stdout" else p.log
            p.proc = subprocess.Popen(p.args, env=p.env, stdout=stdout, stderr=p.log, text=True)
        deadline = time.monotonic() + START_S
        for name in names:
            self._wait(name, deadline)

    def _wait(self, name: str, deadline: float) -> None:
        p = self._procs[name]
        assert p.proc is not None
        if p.ready == "stdout":
            assert p.proc.stdout is not None
            if p.proc.stdout.readline().strip() == "ready":
                return
        else:
            while time.monotonic() < deadline and p.proc.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(p.ready, timeout=2).status_code == 200:
                        return
                time.sleep(0.1)
        raise RuntimeError(f"{name} did not start: {self.log_tail(name)}")

    def log_tail(self, name: str) -> str:
        p = self._procs[name]
        if p.log is None:
            return ""
        p.log.seek(0)
        return p.log.read()[-2000:]

    def pid(self, name: str) -> int:
        proc = self._procs[name].proc
        assert proc is not None
        return proc.pid

    def kill(self, name: str) -> None:
        """SIGKILL: no goodbye, as a machine that dies gives none."""
        proc = self._procs[name].proc
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self) -> None:
        """Stops them a start() at a time, the last started first: a gateway stops while the proxy
        to its database still carries its goodbye (cut off, it would wait out its bounds)."""
        stopped: set[str] = set()
        for wave in [*reversed(self._waves), list(self._procs)]:
            procs = [self._procs[name] for name in wave if name not in stopped]
            stopped.update(wave)
            for p in procs:
                if p.proc is not None and p.proc.poll() is None:
                    p.proc.terminate()
            for p in procs:
                self._reap(p)

    @staticmethod
    def _reap(p: _Proc) -> None:
        if p.proc is not None:
            try:
                p.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(timeout=30)
            if p.proc.stdout is not None:
                p.proc.stdout.close()
        if p.log is not None:
            p.log.close()


@contextlib.contextmanager
def processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop()


def add_fake_node(procs: Processes, name: str, work_s: float = 0.0) -> str:
    """A fake node process (`neuralgrid fake-node`), its base URL; started by `procs.start(name)`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs.add(
        name,
        [*CLI, "fake-node", "--port", str(port), "--latency-s", str(work_s)],
        os.environ,
        f"{url}/v1/models",
    )
    return url


def add_proxies(procs: Processes, db_url: str, far: Sequence[Gateway], name: str = "proxies") -> None:
    """One delay-proxy process with a link per far gateway, to Postgres's TCP port."""
    host, port = postgres_tcp(db_url)
    links = [Link(g.proxy_port, host, port, g.rtt_ms).arg() for g in far if g.proxy_port is not None]
    args = [sys.executable, "-m", "neuralgrid.bench.delay", *(f"--link={link}" for link in links)]
    procs.add(name, args, os.environ, "stdout")


def add_gateway(
    procs: Processes, db_url: str, gateway: Gateway, env: Mapping[str, str] | None = None
) -> None:
    """`neuralgrid up` on the gateway's port, its database through its link."""
    gateway_env = {
        **os.environ,
        **(env or {}),
        "DATABASE_URL": gateway_database_url(db_url, gateway),
        "NEURALGRID_PORT": str(gateway.port),
        "NEURALGRID_INTERNAL_URL": gateway.url,  # how bench chaos tells the gateways' rows apart
    }
    gateway_env.pop("NEURALGRID_SESSION_DATABASE_URL", None)  # the same link as the rest
    procs.add(gateway.name, [*CLI, "up"], gateway_env, f"{gateway.url}/readyz")


def add_node(
    conn: psycopg.Connection,
    name: str,
    endpoint: str,
    models: Sequence[str],
    hourly_rate: float = 0.35,
) -> str:
    """An online node (an RTX 4090, the default slots) serving `models` at `endpoint`; its id."""
    row = conn.execute(
        "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, endpoint_url,"
        " status, last_heartbeat_at) values (%s, 'NVIDIA GeForce RTX 4090', 24, 165, %s, 'eu-west', %s,"
        " 'online', now()) returning id",
        (name, hourly_rate, endpoint),
    ).fetchone()
    assert row is not None
    for model in models:
        conn.execute("insert into public.node_models (node_id, model_id) values (%s, %s)", (row[0], model))
    return str(row[0])


def add_models(conn: psycopg.Connection, models: Sequence[str]) -> None:
    """Small chat models in the catalog (any fake node answers them)."""
    for model in models:
        conn.execute(
            "insert into public.models (id, min_vram_gb, kind, input_usd_per_mtok, output_usd_per_mtok)"
            " values (%s, 2, 'chat', 0.05, 0.10) on conflict (id) do nothing",
            (model,),
        )


def add_key(conn: psycopg.Connection, name: str, budget_usd: float | None = None) -> tuple[str, str]:
    """A key made by the operator: its id and the key itself."""
    budget = None if budget_usd is None else str(budget_usd)  # numeric, exactly as given
    row = conn.execute(
        "select id, api_key from public.create_api_key(%s, null, null, %s::numeric)", (name, budget)
    ).fetchone()
    assert row is not None
    return str(row[0]), str(row[1])
