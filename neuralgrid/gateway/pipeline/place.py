"""Stage 2, place: the matcher in SQL claims a node (and names fallbacks); the same SQL moves a job
on when its node fails (failover_job), hands a dropped stream over (handoff_job), or rejects a
request two nodes failed alike (reject_job)."""

from __future__ import annotations

import time
from typing import NamedTuple
from uuid import UUID

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.gateway import errors
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline.admit import Admitted


class Node(NamedTuple):
    """Where a job runs now: the node, how to reach it, its signing key, which attempt this is."""

    id: UUID
    url: str
    key: bytes | None
    attempt: int


class Placed(NamedTuple):
    job_id: UUID
    node: Node
    candidates: list[UUID]  # the fallbacks the job may move on to
    admitted: Admitted  # the call as admitted, its answer capped at what the key's budget pays for


class Placement:
    def __init__(self, store: Store, metrics: Metrics, max_attempts: int, gateway_id: UUID) -> None:
        self.store = store
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.gateway_id = str(gateway_id)  # recorded on each job (see server/liveness.py)

    async def place(self, admitted: Admitted) -> Placed:
        call = admitted.call
        request = q.MatchRequest(
            model=call.model, policy=call.policy, region=call.region, max_hourly_rate=call.max_hourly_rate
        )
        fallbacks = self.max_attempts - 1
        hold = {"prompt_bytes": len(admitted.payload), "max_out": admitted.max_output_tokens}
        params = q.match_params(request, call.key.id, admitted.stream, fallbacks, **hold)
        params["gateway"] = self.gateway_id
        started = time.perf_counter()
        match = await self.store.get(q.PLACE_JOB, params)  # its domain errors: the app's one handler
        self.metrics.matcher.observe(time.perf_counter() - started)
        if match.node_id is None or match.endpoint_url is None:
            raise errors.NoCapacity(match.error or "no capable node is online", retry_after=2)
        node = Node(match.node_id, match.endpoint_url, match.node_key, match.attempt)
        if match.max_output_tokens is not None:
            admitted = admitted.capped(match.max_output_tokens)
        return Placed(match.job_id, node, match.fallback_ids, admitted)

    async def failover(
        self, job_id: UUID, error: str, status: int | None, candidates: list[UUID]
    ) -> Node | None:
        """The next node, or None: then failover_job() has ended the job as failed."""
        return _node(await self.store.one(q.FAILOVER_JOB, (job_id, error, status, candidates)))

    async def handoff(
        self, job_id: UUID, error: str, status: int | None, candidates: list[UUID]
    ) -> Node | None:
        """The next node, or None: then handoff_job() has left the job as it was."""
        return _node(await self.store.one(q.HANDOFF_JOB, (job_id, error, candidates)))

    async def continuing(self, candidates: list[UUID]) -> list[UUID]:
        """The candidates whose servers were verified to go on with an open assistant message."""
        return await self.store.all(q.CONTINUING_NODES, (candidates,))

    async def reject(self, job_id: UUID, error: str, status: int | None) -> None:
        await self.store.one(q.REJECT_JOB, (job_id, error, status))


def _node(row: q.Assignment | None) -> Node | None:
    if row is None or row.endpoint_url is None:
        return None
    return Node(row.node_id, row.endpoint_url, row.node_key, row.attempt)
