"""Placements asked for together: one place_jobs() call for every request since the last one.

As with job endings (completions.py), one call is in Postgres at a time and the requests that arrive
meanwhile go in the next: a quiet gateway places each request at once, a busy one many per statement,
with no timer to tune. Postgres places them in arrival order, each as place_job() would alone.

A group holds the rows it has claimed until it commits, so in Postgres only its first request may
wait for a row lock; a later one that would have waited is asked again, first in the next group.
A request whose client left while its group was in Postgres may still have been given a node: that
job is handed to `abandon` (which ends it), so the slot is not held until the sweep ends it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from neuralgrid.db import queries as q
from neuralgrid.db.errors import DatabaseError, from_sqlstate
from neuralgrid.db.store import Store

MAX_GROUP = 32  # place_jobs()'s limit (a subtransaction each; see its migration)
# A request that would have waited for a row lock behind its group's own (lock_not_available), or
# lost a deadlock: asked again, first in the next group, where it may wait as place_job() does.
ASK_AGAIN = {"55P03", "40P01"}

Waiting = tuple[Mapping[str, Any], asyncio.Future[q.Match]]


class Claims:
    def __init__(self, store: Store, gateway_id: UUID, abandon: Callable[[UUID], None]) -> None:
        self.store = store
        self.gateway_id = str(gateway_id)  # recorded on each job (see server/liveness.py)
        self.abandon = abandon
        self._waiting: list[Waiting] = []
        self._placer: asyncio.Task[None] | None = None

    async def place(self, params: Mapping[str, Any]) -> q.Match:
        """Place one request (PLACE_JOB's parameters, but the gateway): its match, or the domain
        error placing it raised."""
        future: asyncio.Future[q.Match] = asyncio.get_running_loop().create_future()
        self._waiting.append((params, future))
        if self._placer is None:
            self._placer = asyncio.create_task(self._place_all())
        return await future

    async def _place_all(self) -> None:
        try:
            while self._waiting:
                group = [waiting for waiting in self._waiting[:MAX_GROUP] if not waiting[1].done()]
                del self._waiting[:MAX_GROUP]  # (done: its client left before its turn)
                if group:
                    await self._place_group(group)
        finally:
            self._placer = None

    async def _place_group(self, group: list[Waiting]) -> None:
        requests = [{**params, "key": str(params["key"])} for params, _ in group]
        try:
            rows = await self.store.all(q.PLACE_JOBS, (self.gateway_id, Jsonb(requests)))
        except Exception as err:  # the database's error is every request's
            for _, future in group:
                _fail(future, err)
            return
        except BaseException:  # cancelled: the gateway is stopping
            for _, future in group:
                future.cancel()
            raise
        again: list[Waiting] = []
        for row in rows:
            params, future = group[row.ord - 1]
            if row.failure_state in ASK_AGAIN and not future.done():
                again.append((params, future))
            elif row.failure_state is not None:
                error = from_sqlstate(row.failure_state, row.failure or "", q.PLACE_JOB.subject)
                _fail(future, error or DatabaseError(row.failure or row.failure_state))
            elif future.done():  # its client left meanwhile
                if row.job_id is not None and row.node_id is not None:
                    self.abandon(row.job_id)
            else:
                future.set_result(row)
        self._waiting[:0] = again
        asked_again = {future for _, future in again}
        for _, future in group:  # never left hanging (place_jobs() answers every request)
            if future not in asked_again:
                _fail(future, DatabaseError("place_jobs() gave no row for this request"))


def _fail(future: asyncio.Future[q.Match], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
