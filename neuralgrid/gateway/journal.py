"""Jobs dispatched from leases, written behind: record_jobs() in batches, one call in flight at a
time (the group commit of completions.py), starts and ends alike; and the ends of jobs SQL placed
(their starts in Postgres already), so that no answer waits for a write.

A job's id is made here when it is dispatched. Its start and its end are appended to a spool file
before they are queued, and kept in memory until Postgres has committed them: record_jobs() is
idempotent (a job recorded or ended twice is recorded or ended once), so a record is retried
through a database outage until it lands, and a gateway that dies leaves its records in its spool.
A gateway that starts writes the spools of dead gateways first (a live gateway holds a lock on its
own), under the dead gateway's id, so that the sweep ends what that gateway left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.queries import JobEnd
from neuralgrid.db.store import Store
from neuralgrid.events import any_set

log = logging.getLogger(__name__)

BATCH = 500  # records per record_jobs() call
SEGMENT_BYTES = 4 << 20  # a spool file is closed and a new one begun past this size
RETRY_S = (0.05, 0.2, 1.0, 2.0)  # pauses between tries while the database is unavailable
# Records are written in batches, one write in flight (what comes meanwhile joins the next), each
# GATHER_S after the record that woke it (the answer that queued it goes out first). A start waits
# START_AFTER_S, so that a job that ends sooner is written once, ended (record_jobs() then inserts
# its job and attempt ended rather than inserting them running and updating both): the ledger shows
# a running leased job that much later, and up to LEASED_EVERY_S more (the sweep has the spool;
# failover and hand-over write with no wait to gather). Side by side (bench gateway, 16 callers,
# 2026-12-04, alternating runs): with no wait and the new SQL, Postgres CPU a leased request 0.34 to
# 0.39 ms plain, 0.42 to 0.48 streaming; with the wait, 0.28 to 0.35 and 0.36 to 0.39; before both,
# 0.41 to 0.46 and 0.42 to 0.49 (a wait alone had changed nothing: a leased job cost the rows it
# wrote). A job longer than the wait is written twice, as before. A write begins WRITE_EVERY_S after
# the one before at the soonest: a call costs Postgres about 1.4 ms whatever it holds and a job 0.12
# ms more (2026-12-06), and the journal wrote each batch as soon as the one before was in, so one
# caller's jobs, ending a millisecond or so apart, went a job or two a call. bench gateway, one
# caller, Postgres CPU a request: 0.60 to 0.71 ms before, 0.36 to 0.37 at 10 ms, 0.28 to 0.42 at 20
# ms; at 20 ms the added p99 rose by a millisecond (a bigger write holds one of this machine's two
# cores longer), at 10 ms it did not. That cadence is kept for writes an end of a job SQL placed is
# in (its slot in SQL is free once written: a request may be waiting for it). Writes of leased jobs
# alone free nothing and no answer waits for them, so they begin LEASED_EVERY_S apart: bench
# capacity, one gateway, 64 callers on 8 slots (2026-12-07), record_jobs() went from 973 calls of 4
# jobs to 277 of 14, and Postgres CPU a request from 0.83-1.05 ms to 0.44-0.61 (alternating runs).
GATHER_S = 0.002
WRITE_EVERY_S = 0.01
LEASED_EVERY_S = 0.05
START_AFTER_S = 0.1
ORPHANS_EVERY_S = 1.0  # how often a live gateway looks for dead ones' spools (one folder listing)


@dataclass
class JobRecord:
    """A leased job as record_jobs() takes it: its start, and its end once it has one."""

    id: UUID
    key: UUID | None
    model: str
    policy: str
    region: str | None
    stream: bool
    node: UUID
    started_at: datetime
    hold_usd: Decimal
    end_user: str | None
    end: JobEnd | None = None
    segment: int = -1  # the spool file its last line went to (-1: none, or committed)
    queued_at: float = 0.0  # when its start was queued (time.monotonic())
    now: bool = False  # to be written at once: SQL is about to act on the job
    frees_slot: bool = False  # SQL placed it: its end, once written, frees its slot in SQL
    start_written: bool = False
    dirty: bool = True  # something of it is not yet committed
    written: asyncio.Future[Decimal | None] | None = field(default=None, repr=False)

    _start: str = field(default="", repr=False)  # the start's JSON, made once (line())
    _ended: tuple[JobEnd, str] | None = field(default=None, repr=False)  # the end and its line

    def line(self) -> str:
        """The record as one JSON object, as record_jobs() and the spool take it: made once for its
        start and once for its end, though each is written twice (spool, Postgres), and written out
        by hand, its strings escaped by json's own encoder: json.dumps of the two dicts, each time,
        was a twentieth of a request's CPU in the gateway."""
        if not self._start:
            self._start = (
                f'{{"id": "{self.id}", "key": {_uuid(self.key)}, "model": {_text(self.model)},'
                f' "policy": {_text(self.policy)}, "region": {_text(self.region)},'
                f' "stream": {"true" if self.stream else "false"}, "node": "{self.node}",'
                f' "started_at": "{self.started_at.isoformat()}", "hold_usd": "{self.hold_usd}",'
                f' "end_user": {_text(self.end_user)}'
            )
        end = self.end
        if end is None:
            return self._start + ', "end": null}'
        if self._ended is None or self._ended[0] is not end:
            self._ended = (
                end,
                (
                    f'{self._start}, "end": {{"status": {_text(end.status)},'
                    f' "prompt_tokens": {int(end.prompt_tokens)},'
                    f' "completion_tokens": {int(end.completion_tokens)},'
                    f' "ttft_ms": {_number(end.ttft_ms)}, "latency_ms": {_number(end.latency_ms)},'
                    f' "error": {_text(end.error)}}}}}'
                ),
            )
        return self._ended[1]


def _text(value: str | None) -> str:
    return "null" if value is None else encode_basestring_ascii(value)


def _uuid(value: UUID | None) -> str:
    return "null" if value is None else f'"{value}"'


def _number(value: float | None) -> str:
    """A number as JSON writes it; null for none, and for NaN or infinity, which JSON has not."""
    return "null" if value is None or not math.isfinite(value) else repr(float(value))


def as_array(records: list[JobRecord]) -> str:
    """Records as record_jobs() takes them: a JSON array."""
    return "[" + ",".join(record.line() for record in records) + "]"


class Spool:
    """Append-only files of what is not yet committed, one set per gateway, locked while it lives."""

    def __init__(self, folder: Path, gateway_id: UUID) -> None:
        self.folder = folder
        self.gateway_id = gateway_id
        folder.mkdir(parents=True, exist_ok=True)
        self.segment = 0
        self._open: dict[int, int] = {}  # segment -> records in it not yet committed
        self._size = 0  # the current file's, kept here (set by _begin()): no fstat a line
        self._fd = self._begin(0)

    def _path(self, segment: int) -> Path:
        return self.folder / f"{self.gateway_id}.{segment}.jsonl"

    def _begin(self, segment: int) -> int:
        fd = os.open(self._path(segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until this process ends, however
        self._open[segment] = 0
        self._size = os.fstat(fd).st_size
        return fd

    def append(self, record: JobRecord) -> None:
        """The record's line, in the current file. os.write reaches the kernel at once: a killed
        process loses nothing written; sync() makes it survive the machine too."""
        if self._size > SEGMENT_BYTES:
            old = self._fd
            self.segment += 1
            self._fd = self._begin(self.segment)
            self._retire(self.segment - 1, old)
        self._size += os.write(self._fd, (record.line() + "\n").encode())
        if record.segment != self.segment:  # its latest line is here now: an older file may go
            self._open[self.segment] = self._open.get(self.segment, 0) + 1
            self._committed(record.segment)
            record.segment = self.segment

    def sync(self) -> None:
        os.fsync(self._fd)

    def committed(self, record: JobRecord) -> None:
        """A record Postgres now holds whole: its files may go once nothing else in them waits."""
        self._committed(record.segment)
        record.segment = -1

    def _committed(self, segment: int) -> None:
        if segment < 0 or segment not in self._open:
            return
        self._open[segment] -= 1
        if self._open[segment] <= 0 and segment != self.segment:
            self._remove(segment)
        elif self._open[segment] <= 0 and segment == self.segment:
            os.ftruncate(self._fd, 0)  # everything in it is in Postgres
            self._open[segment], self._size = 0, 0

    def _retire(self, segment: int, fd: int) -> None:
        os.close(fd)
        if self._open.get(segment, 0) <= 0:
            self._remove(segment)

    def _remove(self, segment: int) -> None:
        self._open.pop(segment, None)
        with contextlib.suppress(FileNotFoundError):
            self._path(segment).unlink()

    def close(self, empty: bool) -> None:
        os.close(self._fd)
        if empty:
            for segment in list(self._open):
                self._remove(segment)


def orphaned_spools(folder: Path) -> dict[UUID, list[Path]]:
    """The spool files of gateways that are gone (nobody holds their lock), per gateway."""
    found: dict[UUID, list[Path]] = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.jsonl")):
        gateway, _, _ = path.name.partition(".")
        try:
            gateway_id = UUID(gateway)
        except ValueError:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live gateway's
        finally:
            os.close(fd)
        found.setdefault(gateway_id, []).append(path)
    return found


def read_spool(paths: list[Path]) -> list[dict[str, Any]]:
    """The last line of each job in the files (a later line has all an earlier one had)."""
    latest: dict[str, dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by a crash
                record = json.loads(line)
                if isinstance(record, dict) and isinstance(record.get("id"), str):
                    if record.get("end") is None and record["id"] in latest:
                        continue  # never let a start undo an end
                    latest[record["id"]] = record
    return list(latest.values())


class Journal:
    def __init__(self, store: Store, gateway_id: UUID, spool: Spool | None) -> None:
        self.store = store
        self.gateway_id = gateway_id
        self.spool = spool
        self._records: dict[UUID, JobRecord] = {}
        self._writing: set[UUID] = set()  # the batch in Postgres now
        self._wake = asyncio.Event()
        self._sooner = asyncio.Event()  # queued: a record to write at the shorter cadence, or at once
        self._flushed = asyncio.Condition()
        self.lock = asyncio.Lock()  # one write at a time, and no escrow renewal during one (escrow.py)
        # Told of each record committed, and whether its start is new to Postgres.
        self.on_commit: list[Callable[[JobRecord, bool], None]] = []
        # Told of each record SQL refused, dropped (its start never written: its hold is free).
        self.on_refused: list[Callable[[JobRecord], None]] = []

    def start(self, record: JobRecord) -> None:
        record.queued_at = time.monotonic()
        self._records[record.id] = record
        self._queue(record)

    def end(self, job_id: UUID, end: JobEnd) -> asyncio.Future[Decimal | None]:
        """Queue a leased job's end; the future gets its cost once Postgres has written it."""
        written: asyncio.Future[Decimal | None] = asyncio.get_running_loop().create_future()
        record = self._records.get(job_id)
        if record is None:  # refused when its start was written (logged then)
            written.set_result(None)
            return written
        record.end = end
        record.written = written
        self._queue(record)
        return written

    def ended(self, record: JobRecord) -> asyncio.Future[Decimal | None]:
        """Queue the end of a job SQL placed (its start is in Postgres); the future gets its cost
        once Postgres has written it."""
        written: asyncio.Future[Decimal | None] = asyncio.get_running_loop().create_future()
        record.start_written = True
        record.frees_slot = True
        record.written = written
        self.start(record)
        return written

    def leased(self, job_id: UUID) -> bool:
        record = self._records.get(job_id)
        return record is not None and record.end is None

    def _queue(self, record: JobRecord) -> None:
        record.dirty = True
        if self.spool is not None:
            self.spool.append(record)
        self._wake.set()
        if record.frees_slot:
            self._sooner.set()

    async def written(self, job_id: UUID) -> None:
        """Wait until the job's start is in Postgres (before SQL moves the job on)."""
        async with self._flushed:
            await self._flushed.wait_for(lambda: self._start_written(job_id))

    async def hand_over(self, job_id: UUID) -> None:
        """The job leaves the journal for the database's own path (failover_job() moves it on, and
        complete_jobs() ends it): its start written, it is forgotten here."""
        record = self._records.get(job_id)
        if record is not None:
            record.now = True
        self._wake.set()
        self._sooner.set()
        await self.written(job_id)
        record = self._records.pop(job_id, None)
        if record is not None and self.spool is not None:
            self.spool.committed(record)

    def _start_written(self, job_id: UUID) -> bool:
        record = self._records.get(job_id)
        return record is None or record.start_written

    async def run(self, stop: asyncio.Event) -> None:
        """Write what is queued until stop is set. Every ORPHANS_EVERY_S, also what gateways that died
        on this machine left in the spool folder (they share it), before the sweep, judging them
        silent, ends their jobs as abandoned."""
        loop = asyncio.get_running_loop()
        scanned = began = loop.time()
        while not stop.is_set():
            await any_set(stop, self._wake, timeout=self._due())
            self._wake.clear()
            await self._gather(began, stop)
            began = loop.time()
            await self.flush(whole=False, until=stop, once=True)
            if self.spool is not None and loop.time() - scanned >= ORPHANS_EVERY_S:
                scanned = loop.time()
                with contextlib.suppress(psycopg.Error, DatabaseError, OSError):  # tried again next time
                    await replay_orphans(self.store, self.spool.folder)

    async def _gather(self, began: float, stop: asyncio.Event) -> None:
        """Let what comes meanwhile join the batch: until GATHER_S from now, and WRITE_EVERY_S after
        the last write `began` if an end that frees a slot in SQL is queued, else LEASED_EVERY_S;
        no wait for a record SQL is about to act on, for a full batch (a backlog, after an outage,
        drains at a batch a write), nor once `stop` is set."""
        loop = asyncio.get_running_loop()
        soonest = loop.time() + GATHER_S
        while not stop.is_set():
            self._sooner.clear()
            now = time.monotonic()
            queued = [r for r in self._records.values() if self._ready(r, False, now)]
            if len(queued) >= BATCH or any(r.now for r in queued):
                return
            every = WRITE_EVERY_S if any(r.frees_slot for r in queued) else LEASED_EVERY_S
            left = max(soonest, began + every) - loop.time()
            if left <= 0:
                return
            await any_set(self._sooner, stop, timeout=left)  # one that frees a slot shortens the wait

    def _due(self) -> float:
        """Seconds until the next young start is due to be written (at most ORPHANS_EVERY_S)."""
        young = [r.queued_at for r in self._records.values() if r.dirty and r.end is None and not r.now]
        if not young:
            return ORPHANS_EVERY_S
        return min(max(min(young) + START_AFTER_S - time.monotonic(), 0.0), ORPHANS_EVERY_S)

    def _ready(self, record: JobRecord, whole: bool, now: float) -> bool:
        return record.dirty and (
            whole or record.now or record.end is not None or now - record.queued_at >= START_AFTER_S
        )

    async def flush(self, whole: bool = True, until: asyncio.Event | None = None, once: bool = False) -> None:
        """Write the queued records, a batch at a time, retrying while the database is away (until
        `until` is set: shutdown's drain then bounds the last tries); all of them (`whole`), or those
        due: ends, starts of jobs that ran START_AFTER_S, and any SQL is to act on. `once`: one
        batch, what came meanwhile waits for the next wake."""
        while batch := [r for r in self._records.values() if self._ready(r, whole, time.monotonic())][:BATCH]:
            tries = 0
            while True:
                try:
                    async with self.lock:
                        await self._write(batch)
                    break
                except (psycopg.OperationalError, OSError) as err:
                    # A row another transaction holds (lock_timeout, 55P03) is contention, not an
                    # outage: tried again soon however often, since a slot's release may wait on it.
                    contended = isinstance(err, psycopg.errors.LockNotAvailable)
                    pause = RETRY_S[0] if contended else RETRY_S[min(tries, len(RETRY_S) - 1)]
                    if tries == 1:
                        log.warning("could not write %d job records (%s): retrying", len(batch), err)
                    tries += 1
                    if until is None:
                        await asyncio.sleep(pause)
                    else:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(until.wait(), pause)
                        if until.is_set():
                            return
                except (psycopg.Error, DatabaseError):
                    # The one at fault fails alone, and is dropped: kept, it would come back in every
                    # batch while jobs end, each batch then written a record at a time.
                    for record in batch:
                        try:
                            async with self.lock:
                                await self._write([record])
                        except (psycopg.OperationalError, OSError):
                            break  # the database went away: all of them are tried again
                        except (psycopg.Error, DatabaseError):
                            log.error("job record %s refused; dropped", record.id, exc_info=True)
                            self._done(record, None, refused=True)
                    async with self._flushed:  # a hand-over waiting on a refused record goes on
                        self._flushed.notify_all()
                    break
            if once:
                if any(self._ready(r, whole, time.monotonic()) for r in self._records.values()):
                    self._wake.set()
                return

    async def _write(self, batch: list[JobRecord]) -> None:
        if self.spool is not None:
            await asyncio.to_thread(self.spool.sync)
        sent = {r.id: (r.end is not None) for r in batch}
        for record in batch:
            record.dirty = False
        self._writing = {r.id for r in batch}
        try:
            rows = await self.store.all(q.RECORD_JOBS, (self.gateway_id, as_array(batch)))
        except BaseException:
            for record in batch:
                record.dirty = True
            self._writing = set()
            raise
        costs = {row.job_id: row.cost_usd for row in rows}
        for record in batch:
            first = not record.start_written
            record.start_written = True
            for told in self.on_commit:
                told(record, first)
            if sent[record.id] and not record.dirty:
                self._done(record, costs.get(record.id))
        self._writing = set()  # committed, and each one's waiters told
        async with self._flushed:
            self._flushed.notify_all()

    def _done(self, record: JobRecord, cost: Decimal | None, refused: bool = False) -> None:
        if refused and not record.start_written:
            for told in self.on_refused:
                told(record)
        record.start_written = True
        record.dirty = False
        self._records.pop(record.id, None)
        if self.spool is not None:
            self.spool.committed(record)
        if record.written is not None and not record.written.done():
            record.written.set_result(None if refused else cost)

    def pending(self) -> int:
        """Records not yet committed: queued, or in the batch being written (what came while it
        was in Postgres is queued again, dirty)."""
        return len(self._writing | {r.id for r in self._records.values() if r.dirty})

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close(empty=not self._records)


async def replay_orphans(store: Store, folder: Path) -> int:
    """Write what dead gateways left in their spools, as theirs; returns how many records. A spool
    is kept while the database is away, and removed once written: a record the database refuses
    (its node deleted since, say) is dropped alone, as the live journal drops one, never tried
    again every second with the rest of its spool."""
    replayed = 0
    for gateway_id, paths in orphaned_spools(folder).items():
        records = read_spool(paths)
        try:
            written = await _replay(store, gateway_id, records)
        except (psycopg.OperationalError, OSError):  # kept for the next try; this one serves
            log.warning("could not write the spool of stopped gateway %s (database away); kept", gateway_id)
            continue
        replayed += written
        for path in paths:
            path.unlink(missing_ok=True)
        if records:
            log.info("wrote %d job records a stopped gateway (%s) had not", written, gateway_id)
    return replayed


async def _replay(store: Store, gateway_id: UUID, records: list[dict[str, Any]]) -> int:
    """A dead gateway's records in batches; a batch refused, record by record, dropping the refused."""
    written = 0
    for i in range(0, len(records), BATCH):
        batch = records[i : i + BATCH]
        try:
            await store.all(q.RECORD_JOBS, (gateway_id, json.dumps(batch)))
            written += len(batch)
            continue
        except psycopg.OperationalError:
            raise
        except (psycopg.Error, DatabaseError):
            pass  # one at fault: each alone
        for record in batch:
            try:
                await store.all(q.RECORD_JOBS, (gateway_id, json.dumps([record])))
                written += 1
            except psycopg.OperationalError:
                raise
            except (psycopg.Error, DatabaseError):
                log.error(
                    "job record %s of stopped gateway %s refused; dropped", record.get("id"), gateway_id
                )
    return written
