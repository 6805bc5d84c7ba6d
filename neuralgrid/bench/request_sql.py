"""`neuralgrid bench sql`: the request path's SQL alone, in Postgres time and CPU per job.

What each request costs the database, without the gateway's processes around it on a shared
machine: jobs are placed with place_jobs() and ended with complete_jobs(), the two calls a request
makes, in groups of `group` (the gateway groups concurrent requests the same way: 1 when they come
one at a time, up to 16 under load), on one connection, on a scratch database shaped like `bench
gateway`'s (16 default-size nodes, a ledger of 50,000 finished jobs, analyzed). Each case reports
the client's wall time per job in each call and the CPU per job of the Postgres backend that ran
them, the median over alternating rounds. `--stream` places them as streams, whose endings measure
the node's speed (a whole answer's do not).

`--compare FILE.sql` runs a second scratch database with FILE applied after the migrations (an
index, a new version of a function): the two alternate round by round, so that a change to the SQL
is measured side by side, with the ratio, before it becomes a migration.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import psycopg
from psycopg.types.json import Jsonb

from neuralgrid.bench import MODEL, bench_fleet, scratch_database, tree_cpu_s
from neuralgrid.db import queries as q

SCRATCH_DB = "neuralgrid_bench_sql"
SLOTS = 64  # 16 default-size nodes: room for the largest group
MAX_GROUP = 16  # place_jobs()'s limit
WARMUP_JOBS = 200


class CompareFailed(Exception):
    """The SQL to compare with failed on the scratch database."""


class Database:
    """One scratch database's connection, with what a round needs to place and end jobs."""

    def __init__(self, conn: psycopg.Connection[Any], key_id: UUID, stream: bool) -> None:
        self.conn = conn
        self.backend = int(conn.execute("select pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        request = q.MatchRequest(model=MODEL, max_hourly_rate=1.0, route="chat/completions")
        hold = {"prompt_bytes": 120, "max_out": 64}
        params = q.match_params(request, key_id, stream, 2, **hold, wait=True)
        self.request = {**params, "key": str(key_id), "end_user": None}  # as the gateway sends it
        self.gateway = str(uuid4())

    def round(self, group: int, jobs: int) -> dict[str, float]:
        """Place and end at least `jobs` jobs in groups of `group`: ms per job (wall, each call) and
        the backend's CPU ms per job."""
        place_s = complete_s = 0.0
        done = 0
        cpu = tree_cpu_s(self.backend)
        while done < jobs:
            started = time.perf_counter()
            rows = self.conn.execute(
                q.PLACE_JOBS.sql, (self.gateway, Jsonb([self.request] * group))
            ).fetchall()
            placed = time.perf_counter()
            ids = [row[1] for row in rows if row[2] is not None]  # (ord, job_id, node_id, …)
            if len(ids) != group:
                raise RuntimeError(f"placed {len(ids)} of {group} jobs: {rows}")
            # 20 tokens in 4 to 5 ms after the first: a stream measures a speed a little different
            # each time, as real ones do (the node's speed moves with every stream's end).
            ends = [
                q.JobEnd(job_id, "succeeded", 10, 20, 5.0, 9.0 + (done + i) % 10 / 10, None)
                for i, job_id in enumerate(ids)
            ]
            self.conn.execute(q.COMPLETE_JOBS.sql, q.complete_jobs_params(ends)).fetchall()
            place_s += placed - started
            complete_s += time.perf_counter() - placed
            done += group
        cpu = tree_cpu_s(self.backend) - cpu
        return {
            "place_ms": 1000 * place_s / done,
            "complete_ms": 1000 * complete_s / done,
            "total_ms": 1000 * (place_s + complete_s) / done,
            "postgres_cpu_ms": 1000 * cpu / done,
        }


def run(
    admin_url: str,
    groups: list[int],
    jobs: int,
    rounds: int,
    compare: Path | None = None,
    stream: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Each group size's figures (and, with `compare`, the compared database's and the ratios)."""
    patch = compare.read_text() if compare is not None else None
    with ExitStack() as stack:
        databases = {"base": stack.enter_context(_database(admin_url, SCRATCH_DB, None, stream))}
        if patch is not None:
            compared = _database(admin_url, f"{SCRATCH_DB}_compare", patch, stream)
            databases["compare"] = stack.enter_context(compared)
        for database in databases.values():
            database.round(1, WARMUP_JOBS)
        results = []
        for group in groups:
            progress(f"groups of {group}: {', '.join(databases)}, {rounds} rounds")
            measured: dict[str, list[dict[str, float]]] = {name: [] for name in databases}
            for turn in range(rounds):
                order = list(databases) if turn % 2 == 0 else list(reversed(databases))
                for name in order:
                    measured[name].append(databases[name].round(group, jobs))
            result: dict[str, Any] = {"group": group, "stream": stream, "jobs": jobs, "rounds": rounds}
            for name, runs in measured.items():
                result[name] = {
                    field: round(statistics.median(r[field] for r in runs), 4) for field in runs[0]
                }
            if "compare" in result:
                result["ratio"] = {
                    field: round(result["compare"][field] / result["base"][field], 3)
                    for field in result["base"]
                }
            results.append(result)
    return results


@contextmanager
def _database(admin_url: str, name: str, patch: str | None, stream: bool) -> Iterator[Database]:
    with scratch_database(admin_url, name) as url:
        bench_fleet(url, ["http://127.0.0.1:9"], MODEL, slots=SLOTS)  # never called: SQL only
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("set synchronous_commit = off")  # as the gateway's request path
            if patch is not None:
                try:
                    conn.execute(patch.encode())
                except psycopg.Error as err:
                    raise CompareFailed(
                        f"the compared SQL failed: {str(err).strip().splitlines()[0]}"
                    ) from err
                conn.execute("analyze")
            key_id = conn.execute("select id from public.api_keys where name = 'bench'").fetchone()
            assert key_id is not None
            yield Database(conn, key_id[0], stream)
