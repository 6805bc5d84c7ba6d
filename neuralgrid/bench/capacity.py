"""`neuralgrid bench capacity`: the platform at its default settings under more callers than slots.

Two fake nodes with the default slots (the `nodes` table's max_concurrency, 4: 8 in all) answer after
`--work-ms` (LLM work, shrunk), behind one gateway or several on one database (`--gateways 3`:
`neuralgrid up` processes, the load spread over them in turn). Each case sends `--requests` requests
from `callers` clients that each send one after another, and reports what was refused (503), how
long requests waited for a slot (the x-neuralgrid-queue-ms header), latency, requests/s, and the CPU
the gateways and Postgres spent per request (their processes' CPU time over the case, divided by
the requests served). The load and the numbers are `bench gateway`'s (bench.send_load, Load.summary).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from neuralgrid.bench import (
    CHAT,
    MODEL,
    CpuMeter,
    bench_fleet,
    chat_body,
    postmaster_pid,
    scratch_database,
    send_load,
    served,
)
from neuralgrid.server.serving import free_port, run_fast

SCRATCH_DB = "neuralgrid_bench_capacity"
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
        fleet = bench_fleet(db_url, [f"http://127.0.0.1:{p}" for p in node_ports], MODEL)  # default slots
        cli = [sys.executable, "-m", "neuralgrid.cli"]
        env = {**os.environ, "DATABASE_URL": db_url}
        for port in node_ports:
            url = f"http://127.0.0.1:{port}"
            args = [*cli, "fake-node", "--port", str(port), "--latency-s", str(work_ms / 1000)]
            stack.enter_context(served(args, env, f"{url}/v1/models"))
        pids = []
        for port in gateway_ports:
            url = f"http://127.0.0.1:{port}"
            gateway_env = {**env, "NEURALGRID_PORT": str(port)}
            pids.append(stack.enter_context(served([*cli, "up"], gateway_env, f"{url}/readyz")).pid)
        urls = [f"http://127.0.0.1:{port}{CHAT}" for port in gateway_ports]
        meter = CpuMeter({"gateway": pids, "postgres": [postmaster_pid(db_url)]})
        auth = {"authorization": f"Bearer {fleet.key}"}
        results = []
        for stream in (False, True):
            for n in callers:
                progress(f"{'stream' if stream else 'plain'}: {n} callers on {fleet.slots} slots")
                body = chat_body(MODEL, stream)
                load = run_fast(send_load(urls, body, n, max(requests, n), headers=auth, meter=meter))
                case = {"stream": stream, "callers": n, "slots": fleet.slots, "gateways": gateways}
                results.append({**case, **load.summary()})
    return results
