"""`neuralgrid bench sql`: the request path's SQL alone, in Postgres time and CPU per job.

What each request costs the database, without the gateway's processes around it on a shared
machine, by both of the ways a gateway writes a job, in alternating rounds:

- placed: place_jobs() claims a slot and complete_jobs() ends the job, the two calls a request
  makes when SQL places it (leases off, or no leased slot free);
- leased: record_jobs() writes the job's start, then, in a later call, its end, as a gateway
  serving from its leases writes them behind (gateway/journal.py; each JobRecord as it sends it);
- once: record_jobs() writes a leased job's start and end in one call, as the journal writes a job
  that ended before its start was sent;
- renew: renew_leases() of a gateway's `group` lanes, models it asked for lately and needs no slot
  of now (each wants a spare), on two nodes that serve them all besides the fleet's model: at most
  a spare a node, so most of them hold nothing. A gateway renews every model asked for within 10 s,
  twice a second; per lane renewed.

Jobs go in groups of `group` (the gateway groups concurrent requests the same way: 1 when they come
one at a time, up to 16 under load), on one connection, on a scratch database shaped like `bench
gateway`'s (16 default-size nodes, a ledger of 50,000 finished jobs, analyzed). Each case reports
the client's wall time per job in each call and the CPU per job of the Postgres backend that ran
them, the median over the rounds, and leased over placed. `--stream` makes them streams, whose
endings measure the node's speed (a whole answer's do not).

`--compare FILE.sql` runs a second scratch database with FILE applied after the migrations (an
index, a new version of a function): the two alternate round by round, so that a change to the SQL
is measured side by side, with the ratio, before it becomes a migration.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import psycopg
from psycopg.types.json import Jsonb

from neuralgrid.bench import MODEL, CpuMeter, bench_fleet, scratch_database
from neuralgrid.bench.world_stack import add_models
from neuralgrid.db import queries as q
from neuralgrid.gateway.journal import JobRecord, as_array

SCRATCH_DB = "neuralgrid_bench_sql"
SLOTS = 64  # 16 default-size nodes: room for the largest group
MAX_GROUP = 16  # place_jobs()'s limit
WARMUP_JOBS = 200
PATHS = ("placed", "leased", "once", "renew")
LANE_MODELS = [f"bench/lane-{i}" for i in range(MAX_GROUP)]  # the renew path's: on two nodes


class CompareFailed(Exception):
    """The SQL to compare with failed on the scratch database."""


class RoundFailed(Exception):
    """A round's calls did not place or record every job they were given."""


class Database:
    """One scratch database's connection, with what a round needs to place and end jobs."""

    def __init__(self, conn: psycopg.Connection[Any], key_id: UUID, stream: bool) -> None:
        self.conn = conn
        self.backend = int(conn.execute("select pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        self.meter = CpuMeter({"backend": [self.backend]})
        request = q.MatchRequest(model=MODEL, max_hourly_rate=1.0, route="chat/completions")
        hold = {"prompt_bytes": 120, "max_out": 64}
        params = q.match_params(request, key_id, stream, 2, **hold, wait=True)
        self.request = {**params, "key": str(key_id), "end_user": None}  # as the gateway sends it
        self.gateway = str(uuid4())
        self.renewer = str(uuid4())  # the renew path's gateway: it places and records nothing
        self.key_id = key_id
        self.stream = stream
        nodes = conn.execute("select id, max_concurrency from public.nodes order by id").fetchall()
        self.nodes = [row[0] for row in nodes]
        self.slots = int(nodes[0][1])  # each node's: the default

    def round(self, path: str, group: int, jobs: int) -> dict[str, float]:
        if path == "placed":
            return self.placed(group, jobs)
        if path == "renew":
            return self.renew(group, jobs)
        return self.leased(group, jobs, once=path == "once")

    def placed(self, group: int, jobs: int) -> dict[str, float]:
        """Place and end at least `jobs` jobs in groups of `group`: ms per job (wall, each call) and
        the backend's CPU ms per job."""
        place_s = complete_s = 0.0
        done = 0
        cpu = self.meter.read()["backend"]
        while done < jobs:
            started = time.perf_counter()
            rows = self.conn.execute(
                q.PLACE_JOBS.sql, (self.gateway, Jsonb([self.request] * group))
            ).fetchall()
            placed = time.perf_counter()
            ids = [row[1] for row in rows if row[2] is not None]  # (ord, job_id, node_id, …)
            if len(ids) != group:  # a request's failure is its row's last column
                failure = next((row[-1] for row in rows if row[-1]), rows)
                raise RoundFailed(f"placed {len(ids)} of {group} jobs: {failure}")
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
        cpu = self.meter.read()["backend"] - cpu
        return _per_job(place_s, complete_s, cpu, done)

    def leased(self, group: int, jobs: int, once: bool = False) -> dict[str, float]:
        """Record at least `jobs` jobs' starts in groups of `group`, each group's ends in the call
        after, or (`once`) with them (a group's jobs on as few nodes as their slots allow, as
        renew_leases() leases a lane from its best ranked node down): ms per job (wall, each call)
        and the backend's CPU ms per job."""
        start_s = end_s = 0.0
        done = 0
        cpu = self.meter.read()["backend"]
        while done < jobs:
            records = [
                JobRecord(
                    uuid4(),
                    self.key_id,
                    MODEL,
                    "balanced",
                    None,
                    self.stream,
                    self.nodes[i // self.slots % len(self.nodes)],
                    datetime.now(UTC),
                    Decimal(0),
                    None,
                )
                for i in range(group)
            ]
            started = time.perf_counter()
            if not once:
                self._record(records)
            recorded = time.perf_counter()
            for i, record in enumerate(records):
                record.end = q.JobEnd(record.id, "succeeded", 10, 20, 5.0, 9.0 + (done + i) % 10 / 10, None)
            self._record(records)
            start_s += recorded - started
            end_s += time.perf_counter() - recorded
            done += group
        cpu = self.meter.read()["backend"] - cpu
        return _per_job(start_s, end_s, cpu, done)

    def renew(self, group: int, lanes: int) -> dict[str, float]:
        """Renew `group` idle lanes at a time until at least `lanes` are renewed: ms per lane (wall)
        and the backend's CPU ms per lane."""
        idle: list[dict[str, Any]] = [
            {"model": model, "policy": "balanced", "region": None, "want": 1, "need": 0, "in_use": {}}
            for model in LANE_MODELS[:group]
        ]
        done = 0
        cpu = self.meter.read()["backend"]
        started = time.perf_counter()
        while done < lanes:
            self.conn.execute(q.RENEW_LEASES.sql, (self.renewer, Jsonb(idle))).fetchall()
            done += group
        took = time.perf_counter() - started
        cpu = self.meter.read()["backend"] - cpu
        return _per_job(took, 0.0, cpu, done)

    def _record(self, records: list[JobRecord]) -> None:
        rows = self.conn.execute(q.RECORD_JOBS.sql, (self.gateway, as_array(records))).fetchall()
        if len(rows) != len(records):
            raise RoundFailed(f"recorded {len(rows)} of {len(records)} jobs: {rows}")


def _per_job(first_s: float, second_s: float, cpu_s: float, jobs: int) -> dict[str, float]:
    """Each call's wall time, theirs together and the backend's CPU, in ms per job."""
    return {
        "first_ms": 1000 * first_s / jobs,
        "second_ms": 1000 * second_s / jobs,
        "total_ms": 1000 * (first_s + second_s) / jobs,
        "postgres_cpu_ms": 1000 * cpu_s / jobs,
    }


def run(
    admin_url: str,
    groups: list[int],
    jobs: int,
    rounds: int,
    compare: Path | None = None,
    stream: bool = False,
    paths: tuple[str, ...] = PATHS,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Each (group size, path)'s figures: the base database's, with `compare` the compared
    database's and their ratio, and on the leased path (both measured) leased over placed."""
    patch = compare.read_text() if compare is not None else None
    with ExitStack() as stack:
        lanes = "renew" in paths
        databases = {"base": stack.enter_context(_database(admin_url, SCRATCH_DB, None, stream, lanes))}
        if patch is not None:
            compared = _database(admin_url, f"{SCRATCH_DB}_compare", patch, stream, lanes)
            databases["compare"] = stack.enter_context(compared)
        for name in databases:
            for path in paths:
                _round(databases, name, path, 1, WARMUP_JOBS)
        cases = [(name, path) for path in paths for name in databases]
        results = []
        for group in groups:
            progress(f"groups of {group}: {', '.join(paths)} on {', '.join(databases)}, {rounds} rounds")
            measured: dict[tuple[str, str], list[dict[str, float]]] = {case: [] for case in cases}
            for turn in range(rounds):
                for name, path in cases if turn % 2 == 0 else list(reversed(cases)):
                    measured[(name, path)].append(_round(databases, name, path, group, jobs))
            medians = {
                case: {field: round(statistics.median(r[field] for r in runs), 4) for field in runs[0]}
                for case, runs in measured.items()
            }
            for path in paths:
                result: dict[str, Any] = {
                    "group": group,
                    "path": path,
                    "stream": stream,
                    "jobs": jobs,
                    "rounds": rounds,
                }
                for name in databases:
                    result[name] = medians[(name, path)]
                if "compare" in result:
                    result["ratio"] = _ratio(result["compare"], result["base"])
                if path in ("leased", "once") and "placed" in paths:
                    result["leased_over_placed"] = _ratio(result["base"], medians[("base", "placed")])
                results.append(result)
    return results


def _round(databases: dict[str, Database], name: str, path: str, group: int, jobs: int) -> dict[str, float]:
    """One round on one database; the compared SQL's failure there is the user's, said in a line."""
    try:
        return databases[name].round(path, group, jobs)
    except (psycopg.Error, RoundFailed) as err:
        if name != "compare":
            raise
        raise CompareFailed(f"the compared SQL failed when run: {str(err).strip().splitlines()[0]}") from err


def _ratio(over: dict[str, float], under: dict[str, float]) -> dict[str, float]:
    """Field by field; a field that is 0 below (the once path's first call) has none."""
    return {field: round(over[field] / under[field], 3) for field in under if under[field]}


@contextmanager
def _database(
    admin_url: str, name: str, patch: str | None, stream: bool, lanes: bool = False
) -> Iterator[Database]:
    with scratch_database(admin_url, name) as url:
        bench_fleet(url, ["http://127.0.0.1:9"], MODEL, slots=SLOTS)  # never called: SQL only
        # As the gateway's request path: nothing prepared (db/pool.py), no waiting for the WAL flush.
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
            conn.execute("set synchronous_commit = off")
            if lanes:  # the renew path's models, on the fleet's first two nodes
                add_models(conn, LANE_MODELS)
                conn.execute(
                    "insert into public.node_models (node_id, model_id)"
                    " select n.id, m from (select id from public.nodes order by id limit 2) n,"
                    " unnest(%s::text[]) m",
                    (LANE_MODELS,),
                )
            if patch is not None:
                try:
                    conn.execute(patch.encode())
                except psycopg.Error as err:
                    raise CompareFailed(
                        f"the compared SQL failed: {str(err).strip().splitlines()[0]}"
                    ) from err
            conn.execute("analyze")  # both databases alike (the compared one alone was: 1.08x alone)
            key_id = conn.execute("select id from public.api_keys where name = 'bench'").fetchone()
            assert key_id is not None
            yield Database(conn, key_id[0], stream)
