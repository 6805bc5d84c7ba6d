"""`neuralgrid bench heartbeats`: what agents' heartbeats cost Postgres, batched (issue 41) against one
`agent_heartbeat()` a beat, and what they do to the matcher while they run.

No real agents: one process (this one) beats for many node ids, registered in SQL in bulk, each with
its own secret, each beating `interval` seconds after its last beat ended, as the agent does, saying
what an idle node says every beat (its warm model, no load: the steady state). Three parts, side by
side in one run:

1. **Through a gateway** (`neuralgrid up`, a process of its own), `--nodes` nodes over HTTP, an
   agent's connection each: the gateway writing each beat at once (NEURALGRID_HEARTBEAT_FLUSH_S=0,
   `agent_heartbeat()` a beat) against batching (the default), in alternating rounds: beats/s
   delivered against those offered, Postgres's and the gateway's CPU per beat, WAL bytes per beat,
   the beat's latency. The agents (beating_agents.py) beat from a thread of this process at nice
   10, as machines of their own.
2. **In SQL alone**, the same fleet and offered rate, without the gateway's and this process's HTTP
   on the machine: `agent_heartbeat()` a beat from 4 connections (as a gateway's pool sends them)
   against `node_heartbeats()` once a second; and the per-beat path of the code before issue 41, on a
   database built from the migrations before it.
3. **At scale**, `--fleet` nodes in SQL alone: what gateways would send for them, `node_heartbeats()`
   once a second in statements of 5,000. (One `agent_heartbeat()` a beat cannot keep a fleet that size
   beating here: parts 1 and 2 say how many nodes it can.)

Each part then runs `match_job()` (50 a second, each ended at once, untimed; its caller a process of
its own, committing as the gateway's request path does, without waiting for the WAL flush) for twice
the window while its beats are turned on and off in turns of a heartbeat interval (every node stays
fresh): its p99 under beats against without them, as seen and in Postgres alone.

Postgres's CPU is its whole process tree's (backends, the gateway's sweeper, autovacuum, the WAL
writer), read from /proc around each window as the other benchmarks read it; WAL is the distance
pg_current_wal_lsn() moved. A node's first beat (which makes its node_liveness row) is outside the
windows: at scale the rows are made in bulk first, as the nodes' first beats would have.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from neuralgrid.bench import CpuMeter, percentiles, postmaster_pid, scratch_database, served
from neuralgrid.bench.beating_agents import Beats, beating_elsewhere, secret
from neuralgrid.db import migrate
from neuralgrid.server.serving import free_port, run_fast

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SCRATCH_DB = "neuralgrid_bench_heartbeats"
BEFORE_DB = "neuralgrid_bench_heartbeats_before"
# The first migration of issue 41: a database built from those before it runs the per-beat path as
# it was when the issue measured it.
ISSUE_41 = "20261204000100"
CHUNK = 5_000  # beats per node_heartbeats() statement, as the gateway sends them
MATCH_EVERY_S = 0.02  # the matcher's caller: 50 placements a second, each ended at once (untimed)
PER_BEAT_CONNECTIONS = 4  # a gateway's request pool

# A synthetic fleet in one statement (as `bench matching` makes one), each node with a secret of its
# own ('bench-node-<i>', kept as its SHA-256) and the benchmark's model warm.
FILL = """
with gpu(k, model, vram, tflops, rate) as (values
  (0, 'NVIDIA GeForce RTX 3090', 24, 71, 0.20), (1, 'NVIDIA GeForce RTX 4090', 24, 165, 0.35),
  (2, 'NVIDIA A10', 24, 125, 0.60), (3, 'NVIDIA L4', 24, 121, 0.45),
  (4, 'NVIDIA A100 40GB', 40, 312, 1.10), (5, 'NVIDIA A100 80GB', 80, 312, 1.50),
  (6, 'NVIDIA H100 80GB', 80, 989, 2.50)
), ins as (
  insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, latitude, longitude,
                            endpoint_url, status, max_concurrency, last_heartbeat_at, secret_hash)
  select 'bench-' || i, g.model, g.vram, g.tflops, g.rate,
         (array['us-east', 'us-west', 'eu-west', 'eu-central', 'ap-northeast', 'ap-south'])[1 + i %% 6],
         -60 + (i %% 120), -180 + (i %% 360), 'https://bench.example.com', 'online', 8, now(),
         sha256(convert_to('bench-node-' || i, 'UTF8'))
  from generate_series(%(first)s::int, %(last)s::int) i join gpu g on g.k = i %% 7
  returning id
)
insert into public.node_models (node_id, model_id, state) select id, %(model)s, 'loaded' from ins
"""


@dataclass
class Fleet:
    url: str
    ids: list[str] = field(default_factory=list)  # node i's id at [i - 1]

    def fill(self, size: int) -> None:
        """Nodes 1..size (those missing), analyzed."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(FILL, {"first": len(self.ids) + 1, "last": size, "model": MODEL})
            rows = conn.execute(
                "select id::text, substr(name, 7)::int from public.nodes where name like 'bench-%'"
            )
            found = sorted(rows.fetchall(), key=lambda r: r[1])
            self.ids = [r[0] for r in found]
            conn.execute("vacuum analyze public.nodes, public.node_models, public.node_scores")

    def refresh(self) -> None:
        """Every node fresh and online again, as beating nodes are (before a window without beats):
        its liveness row, or its row where it has none (or the database predates them)."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(
                "update public.nodes set status = 'online', missed_heartbeats = 0, inflight = 0"
                " where status <> 'online' or inflight > 0 or missed_heartbeats > 0"
            )
            if conn.execute("select to_regclass('public.node_liveness') is null").fetchone() == (True,):
                conn.execute("update public.nodes set last_heartbeat_at = now()")
                return
            conn.execute("update public.node_liveness set last_heartbeat_at = now()")
            conn.execute(
                "update public.nodes n set last_heartbeat_at = now()"
                " where not exists (select from public.node_liveness l where l.node_id = n.id)"
            )

    def beat_json(self, i: int) -> str:
        """Node i's beat as a gateway sends it to node_heartbeats(): an idle node's steady state."""
        key = hashlib.sha256(secret(i).encode()).hexdigest()
        return (
            f'{{"node_id":"{self.ids[i - 1]}","key":"{key}","age_ms":500,"status":"online","queue_depth":0,'
            f'"gpu_utilization":null,"free_vram_gb":null,"models":["{MODEL}"],"specs":null,"backend_up":true,'
            f'"backend":null,"available":null,"loaded":[],"refused":[]}}'
        )


class Window:
    """CPU of named process trees and the WAL written, between start() and stop()."""

    def __init__(self, url: str, meter: CpuMeter) -> None:
        self.url, self.meter = url, meter

    def start(self) -> None:
        self.cpu, self.lsn, self.at = self.meter.read(), self._lsn(), time.perf_counter()

    def stop(self) -> dict[str, float]:
        cpu, lsn, at = self.meter.read(), self._lsn(), time.perf_counter()
        with psycopg.connect(self.url) as conn:
            row = conn.execute("select pg_wal_lsn_diff(%s, %s)::float8", (lsn, self.lsn)).fetchone()
        used = {f"{name}_cpu_s": cpu[name] - self.cpu[name] for name in cpu}
        return {"wall_s": at - self.at, "wal_bytes": float(row[0]) if row else 0.0, **used}

    def _lsn(self) -> str:
        with psycopg.connect(self.url) as conn:
            row = conn.execute("select pg_current_wal_lsn()::text").fetchone()
        return str(row[0]) if row else "0/0"


# A placement: its job, and how long match_job() ran in Postgres (from the statement's start to its
# row: what the database took, without the round trip, the commit or this side's scheduling).
PLACE = (
    "select m.job_id, (extract(epoch from clock_timestamp() - statement_timestamp()) * 1000)::float8"
    " from public.match_job(%s, null, 'balanced', null, 'eu-west') m"
)
Sample = tuple[
    float, float, float
]  # a placement's start (perf_counter), its latency here and in Postgres, ms


def _place(url: str, stop: Any, sink: Any) -> None:
    """The matcher's caller, in a process of its own (matcher()): says it is ready once its plans
    are cached, places until `stop`, then sends its samples."""
    samples: list[Sample] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("set synchronous_commit = off")  # as the gateway's request path commits
        for _ in range(5):  # plans and caches, as a gateway's connection has them
            _end(conn, conn.execute(PLACE, (MODEL,)).fetchone())
        sink.send("ready")
        while not stop.is_set():
            started = time.perf_counter()
            row = conn.execute(PLACE, (MODEL,)).fetchone()
            samples.append((started, (time.perf_counter() - started) * 1000, float(row[1]) if row else 0.0))
            _end(conn, row)
            stop.wait(max(0.0, MATCH_EVERY_S - (time.perf_counter() - started)))
    sink.send(samples)


@contextmanager
def matcher(url: str) -> Iterator[list[Sample]]:
    """A caller placing a job every MATCH_EVERY_S (match_job(), ended at once) while the block runs,
    in a process of its own (as a thread here it counted its waits for this process's GIL); the list
    yielded holds each placement's start (perf_counter: one clock) and ms, once the block ends."""
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    received, sink = spawn.Pipe(duplex=False)
    caller = spawn.Process(target=_place, args=(url, stop, sink), daemon=True)
    caller.start()
    samples: list[Sample] = []
    try:
        if not received.poll(60) or received.recv() != "ready":
            raise RuntimeError("the matcher's process did not start")
        yield samples
    finally:
        stop.set()
        if received.poll(60):
            samples.extend(received.recv())
        caller.join(30)


@dataclass
class Toggle:
    """Beats on and off in turns of a heartbeat interval (nodes stay fresh: the sweep waits three),
    so that the matcher's latency under beats and without them is measured in the same minute."""

    on: bool = True
    spans: list[tuple[float, float, bool]] = field(default_factory=list)

    def turns(self, seconds: float, turn_s: float) -> Iterator[float]:
        """Flip every turn_s for `seconds` (on first); yields each turn's length to wait out."""
        for k in range(max(2, round(seconds / turn_s))):
            self.on = k % 2 == 0
            started = time.perf_counter()
            yield turn_s
            self.spans.append((started, time.perf_counter(), self.on))
        self.on = True

    def split(self, samples: list[Sample]) -> dict[str, float]:
        """The matcher's p50/p99 under beats (match_) and without them (quiet_match_), as its caller
        saw them and in Postgres (match_pg_, quiet_match_pg_)."""
        under = [s for s in samples if any(a <= s[0] < b and on for a, b, on in self.spans)]
        quiet = [s for s in samples if any(a <= s[0] < b and not on for a, b, on in self.spans)]
        return {
            **_prefixed("match", [s[1] for s in under]),
            **_prefixed("quiet_match", [s[1] for s in quiet]),
            **_prefixed("match_pg", [s[2] for s in under]),
            **_prefixed("quiet_match_pg", [s[2] for s in quiet]),
        }


def _end(conn: psycopg.Connection[Any], row: Any) -> None:
    if row is not None and row[0] is not None:
        conn.execute("select * from public.complete_job(%s)", (row[0],))


def _prefixed(prefix: str, samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    cut = percentiles(samples)
    return {f"{prefix}_p50_ms": cut["p50_ms"], f"{prefix}_p99_ms": cut["p99_ms"]}


def _per_beat(used: dict[str, float], beats: int, interval_s: float) -> dict[str, Any]:
    """CPU and WAL per beat, and how many nodes one core of Postgres keeps beating at this cost."""
    cpu_us = used["postgres_cpu_s"] * 1e6 / max(beats, 1)
    result: dict[str, Any] = {
        "beats_per_s": round(beats / used["wall_s"], 1),
        "postgres_cpu_us_per_beat": round(cpu_us, 1),
        "wal_bytes_per_beat": round(used["wal_bytes"] / max(beats, 1), 1),
        "nodes_per_postgres_core": int(interval_s * 1e6 / cpu_us) if cpu_us else None,
    }
    if "gateway_cpu_s" in used:
        result["gateway_cpu_us_per_beat"] = round(used["gateway_cpu_s"] * 1e6 / max(beats, 1), 1)
    return result


# 1. Through a gateway --------------------------------------------------------------------------------


def _through_gateway(
    fleet: Fleet, code: str, seconds: float, interval_s: float, progress: Callable[[str], None]
) -> dict[str, Any]:
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": fleet.url,
        "NEURALGRID_PORT": str(port),
        "NEURALGRID_HEARTBEAT_FLUSH_S": "0" if code == "per-beat" else "1",
    }
    gateway = f"http://127.0.0.1:{port}"
    cli = [sys.executable, "-m", "neuralgrid.cli", "up", "--demo", "0"]
    fleet.refresh()
    with served(cli, env, f"{gateway}/readyz") as proc:
        meter = CpuMeter({"postgres": [postmaster_pid(fleet.url)], "gateway": [proc.pid]})
        window = Window(fleet.url, meter)
        beats = Beats()

        toggle = Toggle()

        async def run() -> tuple[dict[str, float], list[Sample]]:
            halt = beating_elsewhere(gateway, fleet.ids, MODEL, interval_s, beats, toggle)
            progress(f"through a gateway, {code}: {len(fleet.ids):,} nodes, their first beats")
            await asyncio.sleep(interval_s + 1)  # every node's first beat, outside the windows
            progress(f"through a gateway, {code}: beats alone for {seconds:.0f} s")
            window.start()
            await asyncio.sleep(seconds)
            used = window.stop()
            progress(f"through a gateway, {code}: the matcher, beats on and off, for {2 * seconds:.0f} s")
            with matcher(fleet.url) as samples:
                for turn in toggle.turns(2 * seconds, interval_s):
                    await asyncio.sleep(turn)
            await asyncio.to_thread(halt)
            return used, samples

        used, samples = run_fast(run())
    end = window.at + used["wall_s"]
    count, latencies, failed = beats.between(window.at, end)
    return {
        "path": "gateway",
        "code": code,
        "nodes": len(fleet.ids),
        "offered_beats_per_s": round(len(fleet.ids) / interval_s, 1),
        **_per_beat(used, count, interval_s),
        "failed": failed,
        "agents_nice": beats.nice,
        **(
            {"beat_p50_ms": percentiles(latencies)["p50_ms"], "beat_p99_ms": percentiles(latencies)["p99_ms"]}
            if latencies
            else {}
        ),
        **toggle.split(samples),
    }


# 2 and 3. In SQL alone -------------------------------------------------------------------------------

PER_BEAT = (
    "select status, load from public.agent_heartbeat(%s, %s, 'online', 0, null::real, null::real,"
    " %s::text[], null::jsonb, true, null::jsonb, null::text[], '{}'::text[], '[]'::jsonb)"
)


def _per_beat_sql(fleet: Fleet, seconds: float, rate: float, toggle: Toggle | None = None) -> int:
    """agent_heartbeat() a beat from PER_BEAT_CONNECTIONS connections, as a gateway sent them: each
    connection beats its share of the nodes in turn, at `rate` beats/s in all, for `seconds`. Returns
    the beats written."""
    done = [0] * PER_BEAT_CONNECTIONS
    keys = {i: hashlib.sha256(secret(i).encode()).digest() for i in range(1, len(fleet.ids) + 1)}

    def beat(k: int) -> None:
        mine = list(range(1 + k, len(fleet.ids) + 1, PER_BEAT_CONNECTIONS))
        pace = PER_BEAT_CONNECTIONS / rate
        with psycopg.connect(fleet.url, autocommit=True) as conn:
            began = time.perf_counter()
            n = 0
            while time.perf_counter() - began < seconds:
                i = mine[n % len(mine)]
                if toggle is None or toggle.on:
                    conn.execute(PER_BEAT, (fleet.ids[i - 1], keys[i], [MODEL])).fetchall()
                    done[k] += 1
                n += 1
                time.sleep(max(0.0, began + n * pace - time.perf_counter()))

    threads = [threading.Thread(target=beat, args=(k,)) for k in range(PER_BEAT_CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done)


def _batched_sql(fleet: Fleet, seconds: float, interval_s: float, toggle: Toggle | None = None) -> int:
    """What gateways send for the whole fleet: each second, the beats of the nodes whose turn it is
    (a node every interval_s), in statements of CHUNK. The statements are made once (a node says the
    same every beat): what this process spends a second is sending them. Returns the beats written."""
    beats = [fleet.beat_json(i) for i in range(1, len(fleet.ids) + 1)]
    per_second = max(1, round(len(beats) / interval_s))
    cycle = -(-len(beats) // per_second)  # seconds until every node has beaten
    payloads = []
    for second in range(cycle):
        turn = beats[second * per_second : (second + 1) * per_second]
        payloads.append(["[" + ",".join(turn[i : i + CHUNK]) + "]" for i in range(0, len(turn), CHUNK)])
    count = "select count(*) filter (where error_code is null) from public.node_heartbeats(%s::jsonb)"
    written = 0
    with psycopg.connect(fleet.url, autocommit=True) as conn:
        began = time.perf_counter()
        second = 0
        while time.perf_counter() - began < seconds:
            for payload in payloads[second % cycle] if toggle is None or toggle.on else []:
                row = conn.execute(count, (payload,)).fetchone()
                written += int(row[0]) if row else 0
            second += 1
            time.sleep(max(0.0, began + second - time.perf_counter()))
    return written


def _in_sql(
    fleet: Fleet,
    code: str,
    seconds: float,
    interval_s: float,
    rate: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    meter = CpuMeter({"postgres": [postmaster_pid(fleet.url)]})
    window = Window(fleet.url, meter)
    fleet.refresh()

    def drive(duration: float, toggle: Toggle | None = None) -> int:
        if code == "batched":
            return _batched_sql(fleet, duration, interval_s, toggle)
        return _per_beat_sql(fleet, duration, rate, toggle)

    progress(f"in SQL, {code}: {len(fleet.ids):,} nodes, beats alone for {seconds:.0f} s")
    window.start()
    beats = drive(seconds)
    used = window.stop()
    result = {
        "path": "sql",
        "code": code,
        "nodes": len(fleet.ids),
        "offered_beats_per_s": round(rate, 1),
        **_per_beat(used, beats, interval_s),
    }
    progress(f"in SQL, {code}: the matcher, beats on and off, for {2 * seconds:.0f} s")
    fleet.refresh()
    toggle = Toggle()
    driver = threading.Thread(target=drive, args=(2 * seconds + interval_s, toggle))
    with matcher(fleet.url) as samples:
        driver.start()
        for turn in toggle.turns(2 * seconds, interval_s):
            time.sleep(turn)
    driver.join()
    result.update(toggle.split(samples))
    return result


@contextmanager
def database_before(admin_url: str) -> Iterator[str]:
    """A scratch database built from the migrations before issue 41's (the per-beat path as it was)."""
    drop = sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(BEFORE_DB))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(drop)
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(BEFORE_DB)))
    url = psycopg.conninfo.make_conninfo(admin_url, dbname=BEFORE_DB)
    older = Path(tempfile.mkdtemp(prefix="ng-before-41-"))
    try:
        for path in migrate.discover(migrate.default_migrations_dir()):
            if path.version < ISSUE_41:
                shutil.copy(path.path, older)
        with psycopg.connect(url, autocommit=True) as conn:
            migrate.apply_compat_layer(conn)
            migrate.migrate(conn, older)
            migrate.apply_realtime_feed(conn)
        yield url
    finally:
        shutil.rmtree(older, ignore_errors=True)
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(drop)


# The run -----------------------------------------------------------------------------------------


def run(
    admin_url: str,
    nodes: int,
    fleet_size: int,
    seconds: float,
    interval_s: float = 5.0,
    rounds: int = 1,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    rate = nodes / interval_s
    with scratch_database(admin_url, SCRATCH_DB) as url:
        fleet = Fleet(url)
        progress(f"registering {nodes:,} nodes")
        fleet.fill(nodes)
        for _ in range(rounds):  # alternating, so that the machine's drift falls on both
            for code in ("per-beat", "batched"):
                results.append(_through_gateway(fleet, code, seconds, interval_s, progress))
        # The same beats in SQL alone: what the database does, without the gateway's and this
        # process's HTTP beside it on the machine (the matcher's figures mean the database's share).
        for code in ("per-beat", "batched"):
            results.append(_in_sql(fleet, code, seconds, interval_s, rate, progress))
        with database_before(admin_url) as old_url:
            before = Fleet(old_url)
            before.fill(nodes)
            results.append(_in_sql(before, "per-beat, before issue 41", seconds, interval_s, rate, progress))
        if fleet_size > nodes:
            progress(f"registering {fleet_size:,} nodes")
            fleet.fill(fleet_size)
            with psycopg.connect(url, autocommit=True) as conn:  # as the nodes' first beats leave them
                conn.execute(
                    "insert into public.node_liveness select id, now() from public.nodes"
                    " on conflict do nothing"
                )
                conn.execute("vacuum analyze public.node_liveness")
            results.append(_in_sql(fleet, "batched", seconds, interval_s, fleet_size / interval_s, progress))
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets, from the run: a batched beat's Postgres CPU over the per-beat path's (through the
    gateway, in SQL alone, and over the code before issue 41's), the beats the batching gateway
    delivered over those offered, and `match_job`'s p99 under batched beats over quiet (through the
    gateway, in SQL alone at --nodes, and at --fleet)."""

    def mean(path: str, code: str, key: str, nodes: int | None = None) -> float | None:
        found = [
            r[key]
            for r in results
            if (r["path"], r["code"]) == (path, code)
            and (nodes is None or r["nodes"] == nodes)
            and r.get(key) is not None
        ]
        return statistics.fmean(found) if found else None

    def ratio(a: float | None, b: float | None, digits: int) -> float | None:
        return None if a is None or not b else round(a / b, digits)

    cpu, p99, quiet = "postgres_cpu_us_per_beat", "match_p99_ms", "quiet_match_p99_ms"
    small = min((r["nodes"] for r in results), default=None)
    large = max((r["nodes"] for r in results), default=None)
    return {
        "batched_over_per_beat_cpu_gateway": ratio(
            mean("gateway", "batched", cpu), mean("gateway", "per-beat", cpu), 4
        ),
        "batched_over_per_beat_cpu_sql": ratio(
            mean("sql", "batched", cpu, small), mean("sql", "per-beat", cpu, small), 4
        ),
        "batched_over_before_cpu_sql": ratio(
            mean("sql", "batched", cpu, small), mean("sql", "per-beat, before issue 41", cpu), 4
        ),
        "delivered_over_offered": ratio(
            mean("gateway", "batched", "beats_per_s"), mean("gateway", "batched", "offered_beats_per_s"), 3
        ),
        "match_p99_under_beats_over_quiet_gateway": ratio(
            mean("gateway", "batched", p99), mean("gateway", "batched", quiet), 2
        ),
        "match_p99_under_beats_over_quiet_sql": ratio(
            mean("sql", "batched", p99, small), mean("sql", "batched", quiet, small), 2
        ),
        "match_p99_under_beats_over_quiet_at_scale": None
        if large == small
        else ratio(mean("sql", "batched", p99, large), mean("sql", "batched", quiet, large), 2),
        # The same in Postgres alone (match_job()'s own time, without the round trip and commit).
        "match_pg_p99_under_beats_over_quiet_gateway": ratio(
            mean("gateway", "batched", "match_pg_p99_ms"),
            mean("gateway", "batched", "quiet_match_pg_p99_ms"),
            2,
        ),
        "match_pg_p99_under_beats_over_quiet_at_scale": None
        if large == small
        else ratio(
            mean("sql", "batched", "match_pg_p99_ms", large),
            mean("sql", "batched", "quiet_match_pg_p99_ms", large),
            2,
        ),
    }
