"""Job endings written in batches: one complete_jobs() call for every ending since the last one.

One write is in the database at a time and endings that arrive meanwhile wait for the next, so a
quiet gateway writes each ending at once and a busy one writes many per statement: the batch grows
with the load, with no timer to tune (the idea of group commit).

While the database is unavailable (restarting, unreachable, out of connections) the endings stay
here and the write is retried with a growing pause until it lands: an ending that is never written
holds its node's slot and its key's budget until the sweep ends the job. An ending the database
refuses (bad data) fails alone, at once. On shutdown, drain() tries for a bounded time, then gives up
on what is left and says how many.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from uuid import UUID

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.queries import JobEnd
from neuralgrid.db.store import Store

log = logging.getLogger(__name__)

Waiting = tuple[JobEnd, asyncio.Future[float | None]]
ROLLED_BACK_TRIES = 3  # writes of an ending alone that Postgres may roll back (rolled_back()) in a row


class NotWritten(Exception):
    """An ending given up on shutdown (or after a bug): logged once, with its count, for all."""


@dataclass(frozen=True)
class Backoff:
    """Pauses between attempts while the database is unavailable: first_s, doubling up to max_s."""

    first_s: float = 0.1
    max_s: float = 5.0

    def after(self, pause_s: float) -> float:
        return min(pause_s * 2, self.max_s)


class Completions:
    def __init__(
        self,
        store: Store,
        max_batch: int = 256,
        backoff: Backoff = Backoff(),
        drain_timeout_s: float = 5.0,
    ) -> None:
        self.store = store
        self.max_batch = max_batch
        self.backoff = backoff
        self.drain_timeout_s = drain_timeout_s
        self._waiting: list[Waiting] = []
        self._writing: list[Waiting] = []  # the batch being written
        self._writer: asyncio.Task[None] | None = None
        self._give_up_at: float | None = None  # set by drain(): when retrying stops
        self._retry_now = asyncio.Event()  # cuts a pause short (drain's final attempt)
        self._unavailable: Exception | None = None  # the last error of an outage under way
        self._outage_logged = False

    async def record(self, end: JobEnd) -> float | None:
        """Wait until the ending is written: the job's cost, or None if it had already ended."""
        future: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((end, future))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write())
        return await future

    async def _write(self) -> None:
        pause_s = self.backoff.first_s
        try:
            while self._waiting:
                self._writing = self._waiting[: self.max_batch]
                del self._waiting[: self.max_batch]
                unwritten = await self._write_batch(self._writing)
                self._writing = []
                if not unwritten:
                    self._report_recovery()
                    pause_s = self.backoff.first_s
                    continue
                # Kept, oldest first: the next attempt merges them with what arrived meanwhile.
                self._waiting[:0] = unwritten
                self._report_outage()
                if self._past_drain():
                    self._give_up()
                    return
                await self._pause(pause_s)
                pause_s = self.backoff.after(pause_s)
        except asyncio.CancelledError:  # drain() cut short an attempt that hangs
            self._give_up()
            raise
        except Exception as err:  # a bug: said once, and no waiter left hanging
            log.exception("writing job endings failed")
            self._give_up(err)
        finally:
            self._writer = None

    async def _write_batch(self, batch: list[Waiting], tries: int = 1) -> list[Waiting]:
        """Write a batch and settle its waiters; returns the endings left unwritten because the
        database is unavailable, their waiters unsettled, for the next attempt.

        Writing a batch again is safe even if the failed attempt committed (the connection was lost
        before the answer came): complete_jobs() ends only jobs still running and leaves the others
        out, so no job is ended or charged twice (its waiter then gets None, as for a swept job)."""
        try:
            costs = await self._complete([end for end, _ in batch])
        except (psycopg.Error, DatabaseError) as err:
            if database_unavailable(err):
                self._unavailable = err
                return batch
            if len(batch) == 1 and rolled_back(err) and tries < ROLLED_BACK_TRIES:
                return await self._write_batch(batch, tries + 1)  # its slot is not held until the sweep
            if len(batch) == 1:
                _settle(batch[0][1], error=err)
                return []
            # One bad ending (or a deadlock's victim) must not lose the others: write each alone.
            log.warning("a batch of %d job endings failed (%s); writing each alone", len(batch), err)
            for done, item in enumerate(batch):
                if await self._write_batch([item]):
                    return batch[done:]
            return []
        for end, future in batch:
            _settle(future, costs.get(end.job_id))
        return []

    async def _complete(self, ends: list[JobEnd]) -> dict[UUID, float]:
        rows = await self.store.all(q.COMPLETE_JOBS, q.complete_jobs_params(ends))
        return {row.job_id: row.cost_usd for row in rows}

    async def drain(self) -> None:
        """On shutdown: wait for the endings handed in, and for those handed in from now on. While
        the database is unavailable: one more attempt at once, then retries until drain_timeout_s
        after the first call; what is still unwritten then is given up, with one log line."""
        loop = asyncio.get_running_loop()
        if self._give_up_at is None:
            self._give_up_at = loop.time() + self.drain_timeout_s
        self._retry_now.set()
        while (writer := self._writer) is not None:
            await asyncio.wait({writer}, timeout=max(self._give_up_at - loop.time(), 0))
            if not writer.done():  # an attempt that hangs (a pool waiting for a connection)
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer

    def _past_drain(self) -> bool:
        return self._give_up_at is not None and asyncio.get_running_loop().time() >= self._give_up_at

    async def _pause(self, pause_s: float) -> None:
        if self._give_up_at is not None:  # draining: never pause past the deadline
            pause_s = min(pause_s, max(self._give_up_at - asyncio.get_running_loop().time(), 0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._retry_now.wait(), pause_s)
        self._retry_now.clear()

    def _report_outage(self) -> None:
        if not self._outage_logged:  # once per outage
            log.warning(
                "the database is unavailable (%s): %d job endings kept, retrying until they are written",
                self._unavailable,
                len(self._waiting),
            )
            self._outage_logged = True

    def _report_recovery(self) -> None:
        if self._outage_logged:
            log.info("the database answers again: writing the job endings kept")
        self._unavailable, self._outage_logged = None, False

    def _give_up(self, bug: Exception | None = None) -> None:
        """Fail every ending not yet written, with one log line that counts them."""
        given_up = [item for item in self._writing + self._waiting if not item[1].done()]
        self._writing, self._waiting = [], []
        if not given_up:
            return
        cause = bug or self._unavailable
        log.error(
            "%d job endings could not be written (%s); their jobs hold their node slots and budget holds"
            " until the sweep ends them (platform_settings.job_deadline_s)",
            len(given_up),
            cause or "shut down while writing",
        )
        for _, future in given_up:
            error = NotWritten(f"the job's ending could not be written: {cause or 'shut down while writing'}")
            error.__cause__ = cause
            _settle(future, error=error)


def database_unavailable(err: Exception) -> bool:
    """The database is down, unreachable or out of connections (psycopg's OperationalError, the
    pool's PoolTimeout among them), as opposed to bad data or a transaction Postgres rolled back
    for another's sake (rolled_back()), where one ending may be to blame and writing each alone
    finds it."""
    return isinstance(err, psycopg.OperationalError) and not rolled_back(err)


def rolled_back(err: Exception) -> bool:
    """A deadlock's victim or a serialization failure (SQLSTATE class 40): nothing was wrong with
    what it wrote, and writing it again can succeed. (psycopg's DeadlockDetected is not a
    TransactionRollback: the class is told by its SQLSTATE.)"""
    sqlstate = getattr(err, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate.startswith("40")


def _settle(
    future: asyncio.Future[float | None], cost: float | None = None, error: Exception | None = None
) -> None:
    if future.done():  # its waiter was cancelled (shutdown); the write happened all the same
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(cost)
