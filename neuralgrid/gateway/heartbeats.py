"""Heartbeats in batches (issue 41): a gateway gathers its agents' beats and writes them in one call
a second, `node_heartbeats()`, instead of one `agent_heartbeat()` a beat.

- **Before anything is queued**, the node's secret is checked against its hash, kept here once read
  and dropped when the database announces a change (a node registered again, or deleted: channel
  neuralgrid_node_secrets). A beat refused for its secret, its node or its body gets its 4xx at once;
  the flush checks the secret again.
- **The flush**: every `flush_s` (1 s), or half the platform's heartbeat interval if that is shorter,
  the beats heard since, one a node (a node's later beat replaces its earlier one, whose answers to
  a pre-load and changed specs it carries on), in one statement per 5,000 beats. In SQL a beat that
  changes nothing writes its node's `node_liveness` row only; one that changes something is written
  as `agent_heartbeat()` writes it.
- **The reply**: a beat that says what its node's last flushed beat said, but for its GPU's
  utilization and free VRAM (which change nearly every beat on a real GPU, and which SQL keeps in the
  node's liveness row too), is answered at once, with the status and pre-load request (`load`) that
  flush returned for the node: the reply a beat gets is its node's as of the last flush, up to a
  heartbeat interval old. Any other beat (a node's first here, new warm models or queue, specs, a
  server found again, answers to a pre-load, draining) is answered once its flush has written it,
  with what it returned, or the error that refused it.
- **A node leaving service** (a beat newly saying draining, offline, or its server down: the first
  beat since its last one here to say so that way) has the flush run at once, with whatever else is
  waiting: the matcher stops sending it work a flush sooner, and a stopping agent, which waits for
  its draining and its offline beat to be written, stops up to two flushes sooner. Its later beats
  saying the same wait for their flush as any other.
- **What a gateway that dies loses**: the beats it answered at once and had not flushed, at most
  `flush_s` of them, each of which said nothing new but its load; the node's next beat (to any
  gateway) says it again. A beat that said something else new was not answered before it was
  written, so its agent sends it again. On a graceful stop the gateway flushes what it holds.

With `flush_s` = 0 each beat is written at once through `agent_heartbeat()`, as before batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from neuralgrid.db import errors as db
from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.events import any_set
from neuralgrid.gateway.errors import DatabaseUnavailable
from neuralgrid.protocol.nodes import Heartbeat

log = logging.getLogger(__name__)

CHUNK = 5_000  # beats per statement (node_heartbeats() takes at most 10,000)
STALE_S = 30.0  # a beat older than this (a database away that long) is dropped, not written late
RETRY = {"55P03", "40P01", "40001"}  # the node was locked (a claim), a deadlock, a serialization failure
INTERVAL_EVERY_S = 2.0  # how often the platform's heartbeat interval is read again
FORGET_AFTER_S = 600.0  # a node not heard from for this long is forgotten here (secret, last reply)
# What a beat says that changes nearly every beat on a real GPU, and that a beat may change without
# waiting for its flush (node_heartbeats() writes it to the node's liveness row).
LOAD = ("gpu_utilization", "free_vram_gb")


@dataclass(frozen=True)
class Reply:
    """What a heartbeat gets back: the node's status and the models it should pre-load now."""

    status: str
    load: list[str]


@dataclass
class _Node:
    """What this gateway knows of a node: its secret's hash, and its last flushed beat and reply."""

    secret_hash: bytes
    said: str | None = None  # the last flushed beat but its load (LOAD), as canonical JSON
    reply: Reply | None = None
    heard: float = 0.0
    leaving: tuple[str, bool] | None = None  # how its last beat said it left service (status, server up)


@dataclass
class _Pending:
    """A node's beat waiting for the next flush, and the replies waiting for it."""

    beat: dict[str, Any]  # as node_heartbeats() takes it, but age_ms
    said: str  # the beat but its load, as canonical JSON
    heard: float
    waiters: list[asyncio.Future[Reply]] = field(default_factory=list)


class Heartbeats:
    """The gateway's heartbeats: checked at once, written in batches (module docstring)."""

    def __init__(self, store: Store, flush_s: float = 1.0) -> None:
        self.store = store
        self.flush_s = flush_s
        self._nodes: dict[UUID, _Node] = {}
        self._pending: dict[UUID, _Pending] = {}
        self._leaving = asyncio.Event()  # a node's beat says it is leaving service: flush now
        self._interval_s = 5.0
        self._interval_read = -INTERVAL_EVERY_S
        self.flushes = 0  # statements sent, for tests and the benchmark
        self.written = 0  # beats written

    @property
    def batched(self) -> bool:
        return self.flush_s > 0

    async def beat(self, node_id: UUID, secret_hash: bytes, beat: Heartbeat) -> Reply:
        """One beat from a node's agent: refused at once (db.NotFound, db.Forbidden) or taken."""
        if not self.batched:
            row = await self.store.get(q.AGENT_HEARTBEAT, _params(node_id, secret_hash, beat))
            return Reply(row.status, list(row.load))
        node = await self._checked(node_id, secret_hash)
        record = _record(node_id, secret_hash, beat)
        said = _said(record)
        now = time.monotonic()
        node.heard = now
        repeat = node.reply is not None and node.said == said
        waiter: asyncio.Future[Reply] | None = None
        if not repeat:
            waiter = asyncio.get_running_loop().create_future()
        self._queue(node_id, _Pending(record, said, now, [waiter] if waiter else []))
        leaving = None if beat.status == "online" and beat.backend_up else (beat.status, beat.backend_up)
        if leaving is not None and leaving != node.leaving:  # news: once a way of leaving, not each beat
            self._leaving.set()
        node.leaving = leaving
        if waiter is None:
            assert node.reply is not None
            return node.reply
        return await waiter

    def forget(self, node_id: str) -> None:
        """A node's secret changed or the node is gone (announced by the database): the next beat
        reads its secret again."""
        with contextlib.suppress(ValueError):
            self._nodes.pop(UUID(node_id), None)

    def forget_all(self) -> None:
        """Announcements may have been missed (the listener reconnected): read every secret again."""
        self._nodes.clear()

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every flush_s (or half the heartbeat interval) until stop; then once more."""
        if not self.batched:
            return
        while not stop.is_set():
            await self._read_interval()
            await any_set(stop, self._leaving, timeout=self.cadence_s)
            self._leaving.clear()
            try:
                await self.flush()
            except Exception:  # a flush that failed has told its waiters; the loop goes on
                log.warning("heartbeats: a flush failed", exc_info=True)
            self._forget_silent()
        with contextlib.suppress(Exception):
            await self.flush()

    @property
    def cadence_s(self) -> float:
        """How often beats are written: flush_s, or half the heartbeat interval if that is less, so
        that a node's last written beat is never more than 1.5 intervals old while it beats (the
        sweep waits 3)."""
        return min(self.flush_s, self._interval_s / 2)

    async def flush(self) -> None:
        """Write the beats heard since the last flush; answer the replies waiting for them."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        now = time.monotonic()
        fresh = {n: p for n, p in pending.items() if now - p.heard <= STALE_S}
        for node_id, dropped in pending.items():
            if node_id not in fresh:
                # Not the beat's fault (a 4xx would tell its agent to drop what it said): a 503.
                _fail(
                    dropped, DatabaseUnavailable("the heartbeat could not be written in time; send it again")
                )
        ids = sorted(fresh, key=str)  # two gateways' batches take their rows in one order
        for start in range(0, len(ids), CHUNK):
            chunk = {node_id: fresh[node_id] for node_id in ids[start : start + CHUNK]}
            await self._write(chunk, now)

    async def _write(self, chunk: dict[UUID, _Pending], now: float) -> None:
        beats = [{**p.beat, "age_ms": int((now - p.heard) * 1000)} for p in chunk.values()]
        try:
            rows = await self.store.all(q.NODE_HEARTBEATS, (Jsonb(beats),))
        except db.DatabaseError as err:
            if len(chunk) == 1:
                for pending in chunk.values():
                    _fail(pending, err)
                return
            # A beat the whole statement could not take (it should not happen: the bodies were
            # validated): each alone, so that only its own agent hears of it.
            log.warning("heartbeats: a batch of %d failed (%s); writing them one by one", len(chunk), err)
            for node_id, pending in chunk.items():
                await self._write({node_id: pending}, now)
            return
        except Exception as err:  # the database is away: the beats wait for the next flush
            log.warning("heartbeats: %d beats not written (%s); trying again next flush", len(chunk), err)
            for node_id, pending in chunk.items():
                _fail(pending, err)  # a waiting agent hears of it (503), and sends its beat again
                pending.waiters = []
                self._requeue(node_id, pending)
            return
        self.flushes += 1
        for row in rows:
            written = chunk.get(row.node_id)
            if written is None:
                continue
            pending = written
            if row.error_code is None:
                self.written += 1
                reply = Reply(row.status or "offline", list(row.load or []))
                node = self._nodes.get(row.node_id)
                if node is not None:
                    node.said, node.reply = pending.said, reply
                for waiter in pending.waiters:
                    if not waiter.done():
                        waiter.set_result(reply)
            elif row.error_code in RETRY:
                self._requeue(row.node_id, pending)
            else:
                self._nodes.pop(row.node_id, None)  # its secret or its row changed: look again next beat
                found = db.from_sqlstate(row.error_code, row.error or "", "node_id")
                _fail(pending, found or db.InvalidRequest(row.error or "the heartbeat was refused"))

    def _queue(self, node_id: UUID, new: _Pending) -> None:
        old = self._pending.get(node_id)
        if old is not None:
            new = _merged(old, new)
        self._pending[node_id] = new

    def _requeue(self, node_id: UUID, pending: _Pending) -> None:
        """Back in line for the next flush, under any beat that came meanwhile."""
        newer = self._pending.get(node_id)
        self._pending[node_id] = pending if newer is None else _merged(pending, newer)

    async def _checked(self, node_id: UUID, secret_hash: bytes) -> _Node:
        """The node, its secret checked: against the hash kept here, else as the database has it."""
        node = self._nodes.get(node_id)
        if node is not None and hmac.compare_digest(node.secret_hash, secret_hash):
            return node
        row = await self.store.one(q.NODE_KEY, (node_id,))
        if row is None:
            self._nodes.pop(node_id, None)
            raise db.NotFound(f"no node {node_id}", "node_id")
        stored = bytes(row.secret_hash or b"")
        if not stored or not hmac.compare_digest(stored, secret_hash):
            raise db.Forbidden(f"this secret does not belong to node {node_id}")
        if node is None or node.secret_hash != stored:
            node = self._nodes[node_id] = _Node(stored)
        return node

    async def _read_interval(self) -> None:
        if time.monotonic() - self._interval_read < INTERVAL_EVERY_S:
            return
        with contextlib.suppress(Exception):  # the last one read holds while the database is away
            self._interval_s = float(await self.store.get(q.HEARTBEAT_INTERVAL))
            self._interval_read = time.monotonic()

    def _forget_silent(self) -> None:
        now = time.monotonic()
        if len(self._nodes) < 1024:
            return
        for node_id in [n for n, node in self._nodes.items() if now - node.heard > FORGET_AFTER_S]:
            del self._nodes[node_id]


def _record(node_id: UUID, secret_hash: bytes, beat: Heartbeat) -> dict[str, Any]:
    """A beat as node_heartbeats() takes it (but its age)."""
    return {
        "node_id": str(node_id),
        "key": secret_hash.hex(),
        "status": beat.status,
        "queue_depth": beat.queue_depth,
        "gpu_utilization": beat.gpu_utilization,
        "free_vram_gb": beat.free_vram_gb,
        "models": beat.models,
        "specs": None if beat.specs is None else beat.specs.model_dump(),
        "backend_up": beat.backend_up,
        "backend": None if beat.backend is None else beat.backend.model_dump(),
        "available": beat.available,
        "loaded": beat.loaded,
        "refused": [r.model_dump() for r in beat.refused],
    }


def _said(record: dict[str, Any]) -> str:
    """What a beat says but its load, as canonical JSON: two beats that differ only in their load
    say the same."""
    rest = {k: v for k, v in record.items() if k not in LOAD}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"))


def _merged(old: _Pending, new: _Pending) -> _Pending:
    """A node's later beat, carrying on what the earlier one said once: its answers to a pre-load,
    and specs or a server the later one does not repeat."""
    beat = dict(new.beat)
    beat["loaded"] = list(dict.fromkeys([*old.beat["loaded"], *new.beat["loaded"]]))
    said_before = old.beat["refused"]
    beat["refused"] = [*said_before, *(r for r in new.beat["refused"] if r not in said_before)]
    for once in ("specs", "backend"):
        if beat[once] is None:
            beat[once] = old.beat[once]
    said = new.said if beat == new.beat else _said(beat)
    return _Pending(beat, said, new.heard, [*old.waiters, *new.waiters])


def _fail(pending: _Pending, err: BaseException) -> None:
    for waiter in pending.waiters:
        if not waiter.done():
            waiter.set_exception(err)


def _params(node_id: UUID, secret_hash: bytes, beat: Heartbeat) -> tuple[Any, ...]:
    """agent_heartbeat()'s parameters, one beat written at once (flush_s = 0)."""
    return (
        node_id,
        secret_hash,
        beat.status,
        beat.queue_depth,
        beat.gpu_utilization,
        beat.free_vram_gb,
        beat.models,
        None if beat.specs is None else Jsonb(beat.specs.model_dump()),
        beat.backend_up,
        None if beat.backend is None else Jsonb(beat.backend.model_dump()),
        beat.available,
        beat.loaded,
        Jsonb([r.model_dump() for r in beat.refused]),
    )
