"""Job endings written in batches: one complete_jobs() call for every ending since the last one.

One write is in the database at a time and endings that arrive meanwhile wait for the next, so a
quiet gateway writes each ending at once and a busy one writes many per statement: the batch grows
with the load, with no timer to tune (the idea of group commit).
"""

from __future__ import annotations

import asyncio
import logging
from uuid import UUID

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.queries import JobEnd
from neuralgrid.db.store import Store

log = logging.getLogger(__name__)


class Completions:
    def __init__(self, store: Store, max_batch: int = 256) -> None:
        self.store = store
        self.max_batch = max_batch
        self._waiting: list[tuple[JobEnd, asyncio.Future[float | None]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def record(self, end: JobEnd) -> float | None:
        """Wait until the ending is written: the job's cost, or None if it had already ended."""
        future: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((end, future))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write())
        return await future

    async def _write(self) -> None:
        try:
            while self._waiting:
                batch = self._waiting[: self.max_batch]
                del self._waiting[: self.max_batch]
                await self._write_batch(batch)
        finally:
            self._writer = None

    async def _write_batch(self, batch: list[tuple[JobEnd, asyncio.Future[float | None]]]) -> None:
        try:
            costs = await self._complete([end for end, _ in batch])
        except (psycopg.Error, DatabaseError) as err:
            if len(batch) == 1 or not _one_ending_may_be_to_blame(err):
                for _, future in batch:
                    _settle(future, error=err)
                return
            # One bad ending (or a deadlock's victim) must not lose the others: write each alone.
            log.warning("a batch of %d job endings failed (%s); writing each alone", len(batch), err)
            for item in batch:
                await self._write_batch([item])
            return
        except BaseException as err:  # cancelled (shutdown) or a bug: no waiter is left hanging
            for _, future in batch:
                _settle(future, error=err if isinstance(err, Exception) else RuntimeError("shutting down"))
            raise
        for end, future in batch:
            _settle(future, costs.get(end.job_id))

    async def _complete(self, ends: list[JobEnd]) -> dict[UUID, float]:
        rows = await self.store.all(q.COMPLETE_JOBS, q.complete_jobs_params(ends))
        return {row.job_id: row.cost_usd for row in rows}

    async def drain(self) -> None:
        """Wait for the endings already handed in (on shutdown)."""
        while self._writer is not None:
            await asyncio.shield(self._writer)


def _one_ending_may_be_to_blame(err: Exception) -> bool:
    """Bad data or a lost deadlock, as opposed to a database that is down or a pool that is full
    (writing the endings one by one would then only wait longer for the same failure)."""
    return not isinstance(err, psycopg.OperationalError) or isinstance(
        err, psycopg.errors.TransactionRollback
    )


def _settle(
    future: asyncio.Future[float | None], cost: float | None = None, error: Exception | None = None
) -> None:
    if future.done():  # its waiter was cancelled (shutdown); the write happened all the same
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(cost)
