"""Benchmarks: each prints a table and writes JSON; none asserts a time (machines are noisy)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql

from neuralgrid.db import migrate


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
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": name,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": _cpus(),
            "python": platform.python_version(),
            "system": platform.platform(),
        },
        **extra,
        "results": results,
    }
    path.write_text(json.dumps(report, indent=2) + "\n")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


@contextmanager
def scratch_database(admin_url: str, name: str) -> Iterator[str]:
    """A fresh, migrated database beside the platform's, for one benchmark; dropped afterwards."""
    drop = sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(drop)
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    url = psycopg.conninfo.make_conninfo(admin_url, dbname=name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            migrate.setup_database(conn)
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(drop)


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


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process, of its live descendants and of the children it has reaped (a
    server's whole work: Postgres's backends, say), from /proc in clock ticks."""
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
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        if current not in stats:
            continue
        fields = stats[current]
        # utime, stime, and for the root only cutime and cstime (a reaped child's, once)
        total += (
            int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if current == pid else 0)
        )
        todo += children.get(current, [])
    return total / tick


def bench_fleet(url: str, node_urls: list[str], model: str, max_concurrency: int = 4) -> str:
    """Online nodes (RTX 4090s, one per URL) serving `model`, heartbeats that never go stale, and a
    key; returns the key."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("update public.platform_settings set heartbeat_interval_s = 86400")
        for i, node_url in enumerate(node_urls):
            row = conn.execute(
                "insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region,"
                " endpoint_url, status, max_concurrency, last_heartbeat_at) values (%s,"
                " 'NVIDIA GeForce RTX 4090', 24, 165, 0.35, 'eu-west', %s, 'online', %s, now()) returning id",
                (f"bench-{i}", node_url, max_concurrency),
            ).fetchone()
            assert row is not None
            conn.execute(
                "insert into public.node_models (node_id, model_id) values (%s, %s)", (row[0], model)
            )
        key = conn.execute("select api_key from public.create_api_key('bench')").fetchone()
    assert key is not None
    return str(key[0])
