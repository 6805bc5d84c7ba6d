"""The gateway's heartbeat batcher (gateway/heartbeats.py) against a store that plays the database: what
it sends, what each beat is answered, and what happens to beats when a flush cannot write them."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest

from neuralgrid.db import errors as db
from neuralgrid.db import queries as q
from neuralgrid.gateway import heartbeats
from neuralgrid.gateway.errors import DatabaseUnavailable
from neuralgrid.gateway.heartbeats import Heartbeats, Reply
from neuralgrid.protocol.nodes import Heartbeat

KEY = hashlib.sha256(b"ngn-secret").digest()


class Database:
    """Answers NODE_KEY with KEY for known nodes, and node_heartbeats() with `answer(beat)`."""

    def __init__(self, nodes: list[UUID]) -> None:
        self.nodes = set(nodes)
        self.batches: list[list[dict[str, Any]]] = []
        self.answer: Callable[[dict[str, Any]], tuple[str | None, str | None]] = lambda beat: (None, None)
        self.down = False

    async def one(self, query: q.Query[Any], params: Any) -> Any:
        assert query is q.NODE_KEY
        return q.NodeKey(KEY) if params[0] in self.nodes else None

    async def get(self, query: q.Query[Any], params: Any = None) -> Any:
        assert query is q.HEARTBEAT_INTERVAL
        return 5.0

    async def all(self, query: q.Query[Any], params: Any) -> list[q.BeatWritten]:
        assert query is q.NODE_HEARTBEATS
        if self.down:
            raise psycopg.OperationalError("the database is away")
        beats = list(params[0].obj)
        self.batches.append(beats)
        rows = []
        for beat in beats:
            code, error = self.answer(beat)
            status = None if code else "online"
            rows.append(q.BeatWritten(UUID(beat["node_id"]), status, [] if status else None, error, code))
        return rows


def beat(**fields: Any) -> Heartbeat:
    return Heartbeat.model_validate({"models": ["m"], **fields})


async def taken(batcher: Heartbeats, node: UUID, said: Heartbeat) -> Reply:
    """A beat, flushed if it waits for its flush (as the flush loop would)."""
    task = asyncio.ensure_future(batcher.beat(node, KEY, said))
    await asyncio.sleep(0)
    if not task.done():
        await batcher.flush()
    return await task


def test_a_repeated_beat_is_answered_from_the_last_flush_and_still_written() -> None:
    async def run() -> None:
        node = uuid4()
        database = Database([node])
        batcher = Heartbeats(database, flush_s=1)  # type: ignore[arg-type]
        assert await taken(batcher, node, beat()) == Reply("online", [])
        assert len(database.batches) == 1
        # The same beat again: answered at once (no flush ran), queued for the next one.
        assert await batcher.beat(node, KEY, beat()) == Reply("online", [])
        await batcher.flush()
        assert len(database.batches) == 2 and database.batches[1][0]["node_id"] == str(node)
        # A beat that says something new waits for its flush.
        task = asyncio.ensure_future(batcher.beat(node, KEY, beat(queue_depth=2)))
        await asyncio.sleep(0.01)
        assert not task.done()
        await batcher.flush()
        assert (await task).status == "online" and database.batches[2][0]["queue_depth"] == 2

    asyncio.run(run())


def test_a_wrong_secret_or_node_is_refused_before_anything_is_queued() -> None:
    async def run() -> None:
        node = uuid4()
        database = Database([node])
        batcher = Heartbeats(database, flush_s=1)  # type: ignore[arg-type]
        with pytest.raises(db.Forbidden):
            await batcher.beat(node, hashlib.sha256(b"not it").digest(), beat())
        with pytest.raises(db.NotFound):
            await batcher.beat(uuid4(), KEY, beat())
        await batcher.flush()
        assert database.batches == []

    asyncio.run(run())


def test_a_nodes_later_beat_carries_on_what_the_earlier_said_once() -> None:
    async def run() -> None:
        node = uuid4()
        database = Database([node])
        batcher = Heartbeats(database, flush_s=1)  # type: ignore[arg-type]
        specs = {"gpu_model": "NVIDIA L4", "gpu_count": 1, "vram_gb": 24, "tflops": 121}
        first = asyncio.ensure_future(batcher.beat(node, KEY, beat(specs=specs, loaded=["a"])))
        second = asyncio.ensure_future(batcher.beat(node, KEY, beat(queue_depth=1, loaded=["b"])))
        await asyncio.sleep(0.01)
        await batcher.flush()
        assert (await first) == (await second) == Reply("online", [])
        (sent,) = database.batches[0]
        assert (
            sent["specs"]["gpu_model"] == "NVIDIA L4"
            and sent["loaded"] == ["a", "b"]
            and sent["queue_depth"] == 1
        )

    asyncio.run(run())


def test_a_locked_node_is_tried_again_and_a_refusal_reaches_its_agent() -> None:
    async def run() -> None:
        locked, refused = uuid4(), uuid4()
        database = Database([locked, refused])
        database.answer = lambda b: (
            ("55P03", "put off")
            if b["node_id"] == str(locked)
            else ("23514", "gpu_count must be between 1 and 64")
        )
        batcher = Heartbeats(database, flush_s=1)  # type: ignore[arg-type]
        waiting = asyncio.ensure_future(batcher.beat(locked, KEY, beat()))
        bad = asyncio.ensure_future(batcher.beat(refused, KEY, beat()))
        await asyncio.sleep(0.01)
        await batcher.flush()
        with pytest.raises(db.InvalidRequest, match="gpu_count"):
            await bad
        assert not waiting.done()  # put off: still waiting, and in the next batch
        database.answer = lambda b: (None, None)
        await batcher.flush()
        assert await waiting == Reply("online", []) and [b["node_id"] for b in database.batches[1]] == [
            str(locked)
        ]

    asyncio.run(run())


def test_beats_a_flush_could_not_write_wait_for_the_next_and_old_ones_are_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def run() -> None:
        node = uuid4()
        database = Database([node])
        batcher = Heartbeats(database, flush_s=1)  # type: ignore[arg-type]
        await taken(batcher, node, beat())
        database.down = True
        await batcher.beat(node, KEY, beat())  # a repeat: answered at once, then not written
        waiting = asyncio.ensure_future(batcher.beat(node, KEY, beat(queue_depth=3)))
        await asyncio.sleep(0.01)
        await batcher.flush()
        with pytest.raises(psycopg.OperationalError):  # its agent hears 503 and sends it again
            await waiting
        database.down = False
        await batcher.flush()  # what it held is written by the next flush
        assert database.batches[-1][0]["queue_depth"] == 3
        # A beat held longer than STALE_S is not written late: its agent is told to send it again.
        monkeypatch.setattr(heartbeats, "STALE_S", 0.0)
        late = asyncio.ensure_future(batcher.beat(node, KEY, beat(queue_depth=4)))
        await asyncio.sleep(0.01)
        await batcher.flush()
        with pytest.raises(DatabaseUnavailable):
            await late

    asyncio.run(run())


def test_a_node_leaving_service_wakes_the_flush_once_a_way_of_leaving() -> None:
    """Each way of leaving (server down, draining, offline) wakes the flush loop once: the beats after
    it that say the same (a draining node's queue going down, say) wait for the flush as others do."""

    async def run() -> None:
        node = uuid4()
        database = Database([node])
        batcher = Heartbeats(database, flush_s=60)  # type: ignore[arg-type]
        stop = asyncio.Event()
        loop = asyncio.ensure_future(batcher.run(stop))
        await asyncio.sleep(0)
        assert await taken(batcher, node, beat()) == Reply("online", [])
        flushed = len(database.batches)
        for said in (
            beat(backend_up=False),
            beat(status="draining", queue_depth=2),
            beat(status="offline", models=[]),
        ):
            await asyncio.wait_for(batcher.beat(node, KEY, said), 1)  # not the 2.5 s cadence: flushed for it
            assert len(database.batches) == flushed + 1
            flushed += 1
        # Draining again (a new way of leaving after offline: flushed), then its queue goes down: news,
        # but the same way of leaving, which waits for the flush.
        await taken(batcher, node, beat(status="draining", queue_depth=2))
        flushed += 1
        waiting = asyncio.ensure_future(batcher.beat(node, KEY, beat(status="draining", queue_depth=1)))
        await asyncio.sleep(0.2)
        assert not waiting.done() and len(database.batches) == flushed
        await batcher.flush()
        await waiting
        stop.set()
        await loop

    asyncio.run(run())
