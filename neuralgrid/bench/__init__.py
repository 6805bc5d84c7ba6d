"""Benchmarks: each prints a table and writes JSON; none asserts a time (machines are noisy).

What they share lives here: a scratch database, services in their own processes, a fleet of nodes
at the default settings, one load generator (`send_load`: latency, refusals, queue wait,
requests/s) and one CPU meter (`CpuMeter`: CPU per request of named process trees).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psycopg
from psycopg import sql

from neuralgrid.db import migrate
from neuralgrid.gateway.journal import LEASED_EVERY_S
from neuralgrid.protocol import signing

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHAT = "/v1/chat/completions"
# The finished jobs a bench fleet's ledger starts with: a deployment in service, not a new one.
# Postgres plans by the tables' statistics, and a new database's empty, unanalyzed ledger gets
# other plans than the one a gateway meets in service (docs/benchmarks.md, 2026-11-28, db6d65a).
LEDGER_HISTORY = 50_000
# A gateway writes leased jobs' records behind, up to journal.LEASED_EVERY_S after their answers:
# a CPU reading waits this long after the requests before it, so that each window holds the
# Postgres work of its own requests (read at the last answer, a short run's read 0).
SETTLE_S = 2 * LEASED_EVERY_S
BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Benchmark me."}],
    "max_tokens": 16,
}


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    """p50, p99 and mean, interpolated between samples as numpy's default percentile does."""
    cuts = statistics.quantiles(
        samples_ms * 2 if len(samples_ms) == 1 else samples_ms, n=100, method="inclusive"
    )
    return {
        "p50_ms": round(cuts[49], 3),
        "p99_ms": round(cuts[98], 3),
        "mean_ms": round(statistics.fmean(samples_ms), 3),
    }


def write_report(path: Path, name: str, results: list[dict[str, Any]], **extra: Any) -> None:
    """The run's JSON: when, on which commit and by which command, the machine, then the results.
    The latest of each is kept in docs/figures/, which the README's figures are made from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": name,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {
            "cpus": _cpus(),
            "python": platform.python_version(),
            "system": platform.platform(),
        },
        **extra,
        "results": results,
    }
    path.write_text(json.dumps(report, indent=2) + "\n")


def _commit() -> str | None:
    """The checkout's commit, "-dirty" when its tracked files differ from it; None outside git."""
    here = Path(__file__).parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


@contextmanager
def scratch_database(admin_url: str, name: str) -> Iterator[str]:
    """A fresh, migrated database beside the platform's, for one benchmark; dropped afterwards. It is
    a copy of a template migrated once per schema (migrated_template): setting a database up took a
    second or more, and a bench compares several."""
    drop = sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
    template = migrated_template(admin_url)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(drop)
        conn.execute(
            sql.SQL("create database {} template {}").format(sql.Identifier(name), sql.Identifier(template))
        )
    try:
        yield psycopg.conninfo.make_conninfo(admin_url, dbname=name)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(drop)


TEMPLATE_PREFIX = "neuralgrid_bench_"
_TEMPLATE_LOCK = "hashtext('neuralgrid bench template')"  # one bench builds it; the others wait


def migrated_template(admin_url: str) -> str:
    """The name of a database set up as setup_database() sets one up, made on first use and kept
    for the next bench: `neuralgrid_bench_` and the schema's digest, so a checkout whose migrations
    differ makes its own (and drops the templates of other schemas). Built under another name and
    renamed once whole, under a lock: a bench stopped or running beside it never copies half a one."""
    name = TEMPLATE_PREFIX + migrate.schema_digest()[:16]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"select pg_advisory_lock({_TEMPLATE_LOCK})")
        try:
            if conn.execute("select 1 from pg_database where datname = %s", (name,)).fetchone():
                return name
            building = name + "_building"
            for (stale,) in conn.execute(
                "select datname from pg_database where starts_with(datname, %s)", (TEMPLATE_PREFIX,)
            ).fetchall():
                conn.execute(sql.SQL("drop database {} with (force)").format(sql.Identifier(stale)))
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(building)))
            with psycopg.connect(admin_url, dbname=building, autocommit=True) as made:
                migrate.setup_database(made)
            conn.execute(
                sql.SQL("alter database {} rename to {}").format(
                    sql.Identifier(building), sql.Identifier(name)
                )
            )
            return name
        finally:
            conn.execute(f"select pg_advisory_unlock({_TEMPLATE_LOCK})")


@contextmanager
def served(args: list[str], env: dict[str, str], ready_url: str) -> Iterator[subprocess.Popen[str]]:
    """A neuralgrid command (`up`, `fake-node`) in its own process, for the duration of the block,
    once `ready_url` answers 200; its output is shown if it fails to start."""
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - a file, not a pipe: a chatty child must never block
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(ready_url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"{args[3:5]} did not start: {log.read()[-2000:]}")
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def postmaster_pid(url: str) -> int:
    """The process id of the Postgres server behind `url` (its backends are its children)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("show data_directory").fetchone()
    assert row is not None
    return int((Path(row[0]) / "postmaster.pid").read_text().split()[0])


def _tree(*pids: int) -> tuple[dict[int, float], float]:
    """CPU seconds so far of processes and their live descendants, each (from /proc/PID/task/*/
    schedstat: nanoseconds; the clock ticks of /proc/PID/stat are 10 ms, too coarse for a round of a
    few hundred requests), and of the children the roots have reaped, together (clock ticks: all
    /proc keeps of them). Threads that ended are not counted."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
    children: dict[int, list[int]] = {}
    for child, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(child)
    live: dict[int, float] = {}
    reaped, todo = 0.0, list(pids)
    while todo:
        current = todo.pop()
        if current not in stats:
            continue
        fields = stats[current]
        live[current] = _on_cpu_s(current, fields, tick)
        if current in pids:  # cutime and cstime
            reaped += (int(fields[13]) + int(fields[14])) / tick
        todo += children.get(current, [])
    return live, reaped


def _on_cpu_s(pid: int, fields: list[str], tick: int) -> float:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks) / 1e9
    except (OSError, ValueError, IndexError):  # no schedstat, or gone meanwhile: utime and stime
        return (int(fields[11]) + int(fields[12])) / tick


@dataclass
class _Seen:
    """What a CpuMeter last saw of one group: its live processes' CPU, the reaped children's, and
    the CPU of the processes that have ended since it started reading."""

    live: dict[int, float] = field(default_factory=dict)
    reaped: float | None = None
    ended: float = 0.0


class CpuMeter:
    """CPU seconds so far of named groups of process trees ("gateway": its processes, "postgres":
    the postmaster), read before and after the part of a load that counts.

    A group's total never goes backwards: a process that ends counts for the more of what it was
    last seen to have used and what its parent's reaped-children total grew by since (in 10 ms
    ticks, rounded down: a process seen live at 15 ms and reaped since would otherwise drop the
    total by 5 ms, more than a short window of cheap work uses)."""

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self.groups = groups
        self._seen = {name: _Seen() for name in groups}
        self._lock = threading.Lock()

    def read(self) -> dict[str, float]:
        with self._lock:
            return {name: self._read(name, pids) for name, pids in self.groups.items()}

    def _read(self, name: str, pids: Sequence[int]) -> float:
        seen = self._seen[name]
        live, reaped = _tree(*pids)
        if seen.reaped is None:
            seen.ended = reaped  # children reaped before the first reading
        else:
            gone = sum(cpu for pid, cpu in seen.live.items() if pid not in live)
            seen.ended += max(gone, reaped - seen.reaped)
        seen.live, seen.reaped = live, reaped
        return seen.ended + sum(live.values())


@dataclass
class Fleet:
    key: str
    nodes: int
    slots: int  # the nodes' max_concurrency, summed: their default
    history: int  # finished jobs in the ledger before the first request (LEDGER_HISTORY)


def bench_fleet(
    url: str, node_urls: Sequence[str], model: str, slots: int = 0, more_models: Sequence[str] = ()
) -> Fleet:
    """Online nodes (RTX 4090s) serving `model` at the default settings, one per URL, or more in
    turn over the URLs until they hold at least `slots` slots (enough default-size nodes for that
    many callers; never a node's concurrency raised); as many again for each of `more_models` (a
    path of its own); heartbeats that never go stale, and a key."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("update public.platform_settings set heartbeat_interval_s = 86400")
        nodes, total = _nodes(conn, node_urls, model, slots, "bench")
        for i, other in enumerate(more_models):
            _nodes(conn, node_urls, other, slots, f"bench-{i + 1}")
        key = conn.execute("select id, api_key from public.create_api_key('bench')").fetchone()
        assert key is not None
        history = ledger_history(conn, key[0], model, LEDGER_HISTORY)
        conn.execute("analyze")  # the statistics autovacuum would have gathered by then
    return Fleet(str(key[1]), nodes, total, history)


def _nodes(
    conn: psycopg.Connection, node_urls: Sequence[str], model: str, slots: int, name: str
) -> tuple[int, int]:
    """bench_fleet()'s nodes for one model: how many, and their slots."""
    nodes = total = 0
    while nodes < len(node_urls) or total < slots:
        row = conn.execute(
            "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region,"
            " endpoint_url, status, last_heartbeat_at) values (%s, 'NVIDIA GeForce RTX 4090', 24,"
            " 165, 0.35, 'eu-west', %s, 'online', now()) returning id, max_concurrency",
            (f"{name}-{nodes}", node_urls[nodes % len(node_urls)]),
        ).fetchone()
        assert row is not None
        conn.execute("insert into public.node_models (node_id, model_id) values (%s, %s)", (row[0], model))
        nodes, total = nodes + 1, total + int(row[1])
    return nodes, total


def ledger_history(conn: psycopg.Connection, key_id: Any, model: str, jobs: int) -> int:
    """`jobs` finished jobs of the key over all the nodes, one a second back from now, each with its
    one attempt; how many were written."""
    written = conn.execute(
        """
        with fleet as (select array_agg(n.id order by n.id) as ids from public.nodes n),
        history as (
          insert into public.jobs as j (api_key_id, owner_id, model_id, policy, status, node_id,
            attempts, stream, min_vram_gb, prompt_tokens, completion_tokens, cost_usd, latency_ms,
            created_at, finished_at)
          select k.id, k.owner_id, %s, 'balanced', 'succeeded', f.ids[1 + i %% cardinality(f.ids)],
            1, false, 16, 10, 16, 0.00001, 20, now() - make_interval(secs => i),
            now() - make_interval(secs => i)
          from fleet f, public.api_keys k, generate_series(1, %s) i where k.id = %s
          returning j.id, j.node_id, j.created_at)
        insert into public.job_attempts (job_id, attempt, node_id, status, started_at, ended_at,
          latency_ms)
        select h.id, 1, h.node_id, 'succeeded', h.created_at, h.created_at, 20 from history h
        """,
        (model, jobs, key_id),
    ).rowcount
    return written


def chat_body(model: str = MODEL, stream: bool = False) -> bytes:
    return json.dumps({**BODY, "model": model, "stream": stream}).encode()


@dataclass
class Load:
    """What a load saw (or several, pooled with `add`)."""

    requests: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # of the requests served (200)
    waits_ms: list[float] = field(default_factory=list)  # their wait for a slot (0 where not said)
    refused: int = 0  # 503
    failed: int = 0  # any other status, or no answer
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # each CpuMeter group's

    def add(self, other: Load) -> None:
        self.requests += other.requests
        self.latencies_ms += other.latencies_ms
        self.waits_ms += other.waits_ms
        self.refused += other.refused
        self.failed += other.failed
        self.wall_s += other.wall_s
        for name, used in other.cpu_s.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + used

    def summary(self) -> dict[str, Any]:
        """The numbers every benchmark reports: served, refused (503) and failed; latency; the
        wait for a slot (the gateway's x-neuralgrid-queue-ms); requests/s; CPU per request served."""
        served = len(self.latencies_ms)
        no_wait = {"p50_ms": 0.0, "p99_ms": 0.0}
        wait = percentiles(self.waits_ms) if self.waits_ms else no_wait
        return {
            "requests": self.requests,
            "served": served,
            "refused_503": self.refused,
            "failed": self.failed,
            **(percentiles(self.latencies_ms) if self.latencies_ms else {}),
            "queue_wait_p50_ms": wait["p50_ms"],
            "queue_wait_p99_ms": wait["p99_ms"],
            "queue_wait_max_ms": round(max(self.waits_ms, default=0.0), 3),
            "rps": round(served / self.wall_s, 1) if self.wall_s else 0.0,
            **{
                f"{name}_cpu_ms_per_request": round(used * 1000 / max(served, 1), 3)
                for name, used in self.cpu_s.items()
            },
        }


async def send_load(
    urls: Sequence[str],
    body: bytes,
    callers: int,
    total: int,
    *,
    headers: Mapping[str, str] | None = None,
    sign_keys: Mapping[str, bytes] | None = None,
    warmup: int = 0,
    warmup_s: float = 0.0,
    meter: CpuMeter | None = None,
) -> Load:
    """`total` requests (rounded down to a multiple of `callers`) from `callers` clients that each
    send one after another, caller i's j-th to urls[(i + j) % len(urls)], after `warmup` requests
    that do not count (connections, caches, plans), then `warmup_s` seconds of the same load, which
    do not count either (what adapts to a load, a gateway's leases say, has then seen it). A request
    to a URL in `sign_keys` is signed with its key as the gateway signs (before its clock starts).
    `meter`'s groups' CPU over the part that counts, each reading taken SETTLE_S after the
    requests before it, once what they left to write behind has been written.

    The client is aiohttp on uvloop (serving.run_fast), the leanest well-kept one: on two shared
    cores the load generator's own CPU is taken from whatever it measures (httpx spent about 1 ms a
    request)."""
    load = Load(requests=total // callers * callers)
    all_headers = {**(headers or {}), "content-type": "application/json"}
    keys = sign_keys or {}
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=callers)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=all_headers) as client:

        async def one(url: str) -> None:
            key = keys.get(url)
            signed = {signing.HEADER: signing.sign(key, CHAT, body)} if key is not None else None
            started = time.perf_counter()
            try:
                async with client.post(url, data=body, headers=signed) as resp:
                    async for _ in resp.content.iter_any():
                        pass
                    status, waited = resp.status, resp.headers.get("x-neuralgrid-queue-ms")
            except (aiohttp.ClientError, TimeoutError):
                load.failed += 1
                return
            if status == 503:
                load.refused += 1
            elif status != 200:
                load.failed += 1
            else:
                load.latencies_ms.append((time.perf_counter() - started) * 1000)
                load.waits_ms.append(float(waited or 0))

        async def caller(index: int) -> None:
            for i in range(total // callers):
                await one(urls[(index + i) % len(urls)])

        for i in range(warmup):
            await one(urls[i % len(urls)])
        warm_until = time.perf_counter() + warmup_s

        async def warming(index: int) -> None:
            i = 0
            while time.perf_counter() < warm_until:
                await one(urls[(index + i) % len(urls)])
                i += 1

        await asyncio.gather(*(warming(i) for i in range(callers)))
        load.latencies_ms.clear()
        load.waits_ms.clear()
        load.refused = load.failed = 0
        settle = SETTLE_S if meter and meter.groups else 0.0
        await asyncio.sleep(settle)  # the warm-up's tail written outside the window
        before = meter.read() if meter else {}
        started = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        load.wall_s = time.perf_counter() - started
        if meter:
            await asyncio.sleep(settle)  # and the load's own tail inside it
            after = meter.read()
            load.cpu_s = {name: after[name] - before[name] for name in before}
    return load
