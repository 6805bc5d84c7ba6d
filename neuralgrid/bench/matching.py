"""`neuralgrid bench matching`: latency of match_job() and score_nodes() as the fleet grows.

Builds a scratch database (dropped afterwards) on the same server, fills it with N online nodes that
all hold the benchmark model (the worst case: every node is a candidate), then times the calls from
one caller and from 16 concurrent callers, each on its own connection, as gateways would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from neuralgrid.bench import percentiles, scratch_database

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SCRATCH_DB = "neuralgrid_bench_matching"

# A synthetic fleet in one statement: GPU classes as in the demo fleet, random places and prices,
# 30% of nodes with the model warm, 8 slots each.
FILL_FLEET = """
with gpu(k, model, vram, tflops, rate) as (values
  (0, 'NVIDIA GeForce RTX 3090', 24, 71, 0.20), (1, 'NVIDIA GeForce RTX 4090', 24, 165, 0.35),
  (2, 'NVIDIA A10', 24, 125, 0.60), (3, 'NVIDIA L4', 24, 121, 0.45),
  (4, 'NVIDIA A100 40GB', 40, 312, 1.10), (5, 'NVIDIA A100 80GB', 80, 312, 1.50),
  (6, 'NVIDIA H100 80GB', 80, 989, 2.50)
), ins as (
  insert into public.nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region, latitude, longitude,
                            endpoint_url, status, max_concurrency, last_heartbeat_at, successes, failures)
  select 'bench-' || i, g.model, g.vram, g.tflops, round((g.rate * (0.7 + random() * 0.6))::numeric, 4),
         (array['us-east', 'us-west', 'eu-west', 'eu-central', 'ap-northeast', 'ap-south'])[1 + i %% 6],
         -60 + random() * 120, -180 + random() * 360, 'http://127.0.0.1:9/', 'online', 8, now(),
         (random() * 100)::int, (random() * 5)::int
  from generate_series(%(first)s::int, %(last)s::int) i join gpu g on g.k = i %% 7
  returning id
)
insert into public.node_models (node_id, model_id, state)
select id, %(model)s, case when random() < 0.3 then 'loaded' else 'available' end from ins
"""


def _timed_calls(
    url: str, call: Callable[[psycopg.Connection], None], callers: int, per_caller: int
) -> tuple[list[float], float]:
    samples: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(callers + 1)

    def worker() -> None:
        mine: list[float] = []
        with psycopg.connect(url, autocommit=True) as conn:
            for _ in range(10):  # warm the plan cache and prepared statements
                call(conn)
            barrier.wait()
            for _ in range(per_caller):
                t0 = time.perf_counter()
                call(conn)
                mine.append((time.perf_counter() - t0) * 1000)
        with lock:
            samples.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(callers)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return samples, time.perf_counter() - t0


def _score(conn: psycopg.Connection) -> None:
    conn.execute(
        "select * from public.score_nodes(%s, null, 'balanced', 'eu-west', null, null, null, false, 32)",
        (MODEL,),
    ).fetchall()


def _match(conn: psycopg.Connection) -> None:
    conn.execute("select * from public.match_job(%s, null, 'balanced', null, 'eu-west')", (MODEL,)).fetchall()


# Big-VRAM nodes in demand: 70B jobs (42 GB) hold three quarters of the slots they can use, so the
# reserve component sets 80 GB nodes apart from the rest and score_nodes() walks the index
# (private.top_by_total) instead of taking the top k by base score.
UNDER_PRESSURE = """
insert into private.vram_pressure (level_gb, busy, slots, pressure) values (42, 0, 0, 0.75)
on conflict (level_gb) do update set pressure = excluded.pressure
"""
NO_PRESSURE = "delete from private.vram_pressure"
CASES = (
    ("score_nodes", _score, NO_PRESSURE),
    ("score_nodes, big VRAM in demand", _score, UNDER_PRESSURE),
    ("match_job", _match, NO_PRESSURE),
    ("match_job, big VRAM in demand", _match, UNDER_PRESSURE),
)


def run(
    admin_url: str,
    sizes: list[int],
    callers: list[int],
    calls: int,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Time each function at each fleet size and caller count; returns one dict per case."""
    results: list[dict[str, Any]] = []
    with scratch_database(admin_url, SCRATCH_DB) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            # Keep the synthetic fleet fresh for the whole run; the bench is not about the sweeper.
            conn.execute("update public.platform_settings set heartbeat_interval_s = 86400")
        loaded = 0
        for size in sorted(sizes):
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(FILL_FLEET, {"first": loaded + 1, "last": size, "model": MODEL})
                loaded = size
                # node_scores too: autovacuum analyzes it within a minute of such a change, and the
                # matcher's plans differ with statistics (a fleet in service has them).
                conn.execute("vacuum analyze public.nodes, public.node_models, public.node_scores")
            for function, call, pressure in CASES:
                for n_callers in callers:
                    progress(f"{function} at {size:,} nodes, {n_callers} caller(s)")
                    with psycopg.connect(url, autocommit=True) as conn:  # free every slot again
                        conn.execute(
                            "update public.nodes set inflight = 0, status = 'online' where inflight > 0"
                        )
                        conn.execute(pressure)
                    per_caller = max(calls // n_callers, 20)
                    samples, wall = _timed_calls(url, call, n_callers, per_caller)
                    results.append(
                        {
                            "nodes": size,
                            "function": function,
                            "callers": n_callers,
                            "calls": len(samples),
                            **percentiles(samples),
                            "calls_per_s": round(len(samples) / wall, 1),
                        }
                    )
    return results
