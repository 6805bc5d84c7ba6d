"""Placements asked for together: one place_jobs() call for every request since the last one.

As with job endings (completions.py), one call is in Postgres at a time and the requests that arrive
meanwhile go in the next: a quiet gateway places each request at once, a busy one many per statement,
with no timer to tune. Postgres places them in order, each as place_job() would alone.

A group holds the rows it has locked until it commits, so in Postgres a request waits for a row lock
at most 100 ms (the group's first) or 10 ms (the others). One that waited longer is asked again, first
in the next group; if it waits too long again it is placed alone, with place_job() on a connection of
its own, so that a row held for long holds up that request only and never the gateway's placements.
A group that Postgres refuses whole (a request it cannot read) is placed request by request, so that
the one at fault fails alone.

A request whose client left while its group was in Postgres may still have been given a node: that
job is handed to `abandon` (which ends it), so the slot is not held until the sweep ends it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from neuralgrid.db import queries as q
from neuralgrid.db.errors import DatabaseError, from_sqlstate
from neuralgrid.db.store import Store, without_nul
from neuralgrid.gateway.completions import database_unavailable

log = logging.getLogger(__name__)

MAX_GROUP = 16  # place_jobs()'s limit (subtransactions; see its migration)
# Waited for a row lock longer than a group may (lock_not_available), or lost a deadlock.
ASK_AGAIN = {"55P03", "40P01"}


@dataclass(eq=False)  # each is itself: compared by identity
class Waiting:
    params: Mapping[str, Any]  # PLACE_JOB's, but the gateway
    future: asyncio.Future[q.Match]
    asked: int = 0  # how many groups it has been in


class Claims:
    def __init__(self, store: Store, gateway_id: UUID, abandon: Callable[[UUID], None]) -> None:
        self.store = store
        self.gateway_id = str(gateway_id)  # recorded on each job (see server/liveness.py)
        self.abandon = abandon
        self._waiting: list[Waiting] = []
        self._placer: asyncio.Task[None] | None = None
        self._alone: set[asyncio.Task[None]] = set()

    async def place(self, params: Mapping[str, Any]) -> q.Match:
        """Place one request (PLACE_JOB's parameters, but the gateway): its match, or the domain
        error placing it raised."""
        future: asyncio.Future[q.Match] = asyncio.get_running_loop().create_future()
        self._waiting.append(Waiting(params, future))
        if self._placer is None:
            self._placer = asyncio.create_task(self._place_all())
        try:
            return await future
        except asyncio.CancelledError:  # placed as its client left: the job is not held
            if future.done() and not future.cancelled() and future.exception() is None:
                self._let_go(future.result())
            raise

    async def quiet(self) -> None:
        """Until no group is in Postgres: the one under way and those queued behind it, placed."""
        while (placer := self._placer) is not None:
            await asyncio.wait({placer})

    async def _place_all(self) -> None:
        try:
            while self._waiting:
                group = [waiting for waiting in self._waiting[:MAX_GROUP] if not waiting.future.done()]
                del self._waiting[:MAX_GROUP]  # (done: its client left before its turn)
                if not group:
                    continue
                try:
                    await self._place_group(group)
                except Exception as err:  # a bug: this group's requests fail, those behind are placed
                    log.exception("placing a group of %d requests failed", len(group))
                    for waiting in group:
                        _fail(waiting.future, err)
        finally:
            self._placer = None

    async def _place_group(self, group: list[Waiting]) -> None:
        for waiting in group:
            waiting.asked += 1
        requests = [without_nul({**w.params, "key": str(w.params["key"])}) for w in group]
        try:
            rows = await self.store.all(q.PLACE_JOBS, (self.gateway_id, Jsonb(requests)))
        except Exception as err:
            if len(group) == 1 or database_unavailable(err):  # every request's error
                for waiting in group:
                    _fail(waiting.future, err)
                return
            for waiting in group:  # one request Postgres could not read: each alone finds it
                waiting.asked -= 1
                await self._place_group([waiting])
            return
        except BaseException:  # cancelled: the gateway is stopping
            for waiting in group:
                waiting.future.cancel()
            raise
        again: list[Waiting] = []  # first in the next group
        later: list[Waiting] = []  # placed alone, settled by that
        read = 0  # rows handed to their request so far
        try:
            for row in rows:
                if not 1 <= row.ord <= len(group):
                    raise DatabaseError(f"place_jobs() answered for request {row.ord} of {len(group)}")
                waiting = group[row.ord - 1]
                if waiting.future.done():  # its client left meanwhile
                    self._let_go(row)
                elif row.failure_state in ASK_AGAIN and waiting.asked < 2:
                    again.append(waiting)
                elif row.failure_state in ASK_AGAIN:
                    self._place_alone(waiting)
                    later.append(waiting)
                elif row.failure_state is not None:
                    error = from_sqlstate(row.failure_state, row.failure or "", q.PLACE_JOB.subject)
                    _fail(waiting.future, error or DatabaseError(row.failure or row.failure_state))
                else:
                    waiting.future.set_result(row)
                read += 1
        finally:
            for row in rows[read:]:  # not handed to its request (a bug above): its job is not kept
                self._let_go(row)
            self._waiting[:0] = again
            for waiting in group:  # none left hanging, whatever happened above
                if waiting not in again and waiting not in later:
                    _fail(waiting.future, DatabaseError("place_jobs() gave no row for this request"))

    def _place_alone(self, waiting: Waiting) -> None:
        """place_job() for one request, on a connection of its own, waiting for locks as long as the
        database lets it."""

        async def alone() -> None:
            try:
                match = await self.store.get(q.PLACE_JOB, {**waiting.params, "gateway": self.gateway_id})
            except Exception as err:
                _fail(waiting.future, err)
                return
            if waiting.future.done():
                self._let_go(match)
            else:
                waiting.future.set_result(match)

        task = asyncio.create_task(alone())
        self._alone.add(task)
        task.add_done_callback(self._alone.discard)

    def _let_go(self, match: q.Match) -> None:
        if match.job_id is not None and match.node_id is not None:
            self.abandon(match.job_id)


def _fail(future: asyncio.Future[q.Match], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
