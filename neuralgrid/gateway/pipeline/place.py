"""Stage 2, place: the matcher in SQL claims a node (and names fallbacks); the same SQL moves a job
on when its node fails (failover_job), hands a dropped stream over (handoff_job), or rejects a
request two nodes failed alike (reject_job)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple
from uuid import UUID

from neuralgrid.db import queries as q
from neuralgrid.db.errors import BudgetExhausted, ConflictError, Forbidden, InvalidRequest, NotFound
from neuralgrid.db.store import Store
from neuralgrid.gateway import errors
from neuralgrid.gateway.claims import Claims
from neuralgrid.gateway.leases import Lent
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline.admit import Admitted
from neuralgrid.gateway.pipeline.kinds import matched_route
from neuralgrid.gateway.pipeline.leased import Dispatched, InLine, LeasedJobs
from neuralgrid.gateway.waiting import ClientLeft, LineFull, WaitingRoom
from neuralgrid.protocol.routes import DEFAULT_ROUTES, ECHO

# Errors place_jobs() answers for one request (its row's SQLSTATE): what it did is undone.
ANSWERED = (BudgetExhausted, ConflictError, Forbidden, InvalidRequest, NotFound)
# How long lent slots of a placement that got no answer wait for its group to leave Postgres
# (place_jobs() waits 100 ms at most for a row) before they are settled as taken anyway.
SETTLE_WAIT_S = 10.0
QUEUE_MS = "x-neuralgrid-queue-ms"  # how long a request waited for a slot, on its answer or refusal


def queue_ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


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
    waited: float  # seconds spent waiting for a free slot
    speeds: dict[UUID, float | None]  # the node's and each fallback's decode speed, tokens/s


class Placement:
    def __init__(
        self,
        store: Store,
        claims: Claims,
        metrics: Metrics,
        max_attempts: int,
        room: WaitingRoom,
        queue_timeout_s: float,
        leased: LeasedJobs | None = None,
    ) -> None:
        self.leased = leased  # this gateway's leases: None places every request in SQL
        self.store = store
        self.claims = claims
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.room = room
        self.queue_timeout_s = queue_timeout_s
        self._settling: set[asyncio.Task[None]] = set()  # lent slots of placements with no answer

    async def place(self, admitted: Admitted) -> Placed:
        """Claim a node serving the call's route; when every capable node is busy, wait in the
        model's line for a slot, up to the queue's deadline."""
        try:
            return await self._place(admitted)
        except (NotFound, InvalidRequest):  # a model or policy that does not exist, say
            if self.leased is not None:
                self.leased.refused(admitted)
            raise

    async def _place(self, admitted: Admitted) -> Placed:
        call = admitted.call
        request = q.MatchRequest(
            model=call.model,
            policy=call.policy,
            region=call.region,
            max_hourly_rate=call.max_hourly_rate,
            route=matched_route(call.kind, call.body),
        )
        # Requests for the routes every node serves wait in the model's line; the others in a line of
        # their own, so that none waits behind requests that the node it could take cannot serve.
        line = call.model if request.route in DEFAULT_ROUTES else f"{call.model} /v1/{request.route}"
        # The most it pays for a node: a request waits behind those that could take any it could.
        reach = math.inf if call.max_hourly_rate is None else call.max_hourly_rate
        seen = self.room.announcements
        match: q.Match | Dispatched | None = None
        # A request no leased slot could take (its key's escrow here short) asks SQL at once, its
        # budget checked there: a key whose budget is spent is refused now, not at its turn in line.
        apart = self.leased is not None and not await self.leased.covered(admitted)
        if apart or not self.room.blocked(line, reach):  # nobody ahead of it: take a slot at once
            match = await self._lease(admitted, request.route)
            if match is None and not await self._at_share(admitted):
                lent = self.leased.book.lend() if self.leased is not None else None
                match = await self._match(self._params(admitted, request), lent)
        waited = 0.0
        try:
            if match is None or (isinstance(match, q.Match) and match.busy):
                queued = time.perf_counter()
                try:
                    match = await self._wait(
                        call.model,
                        line,
                        call.key.id,
                        reach,
                        self._params(admitted, request),
                        seen,
                        call.gone,
                        admitted,
                        request.route,
                        apart,
                    )
                finally:
                    waited = time.perf_counter() - queued
            self.metrics.queue_wait.observe(waited)
            if isinstance(match, Dispatched):
                self.metrics.leased.inc()
                return self._from_lease(match, admitted, waited)
            if match.refusal == "route":  # no wait makes a node serve another route
                raise errors.RouteNotServed(_not_served(request, match.error))
            if match.node_id is None or match.endpoint_url is None:
                said = match.error or "no capable node is online"
                if call.max_hourly_rate is not None and match.refusal == "none":
                    # SQL looked within the cap: a developer read the fleet as down (a new user's trial).
                    said += f" within the price cap of ${call.max_hourly_rate:g}/h (x-neuralgrid-max-price)"
                raise errors.NoCapacity(said, retry_after=2)
        except errors.GatewayError as refused:  # a refusal says how long it waited, as an answer does
            refused.headers = {**(refused.headers or {}), QUEUE_MS: queue_ms(waited)}
            raise
        if self.leased is not None:
            self.leased.placed_elsewhere(match.job_id, match.node_id, admitted, request.route)
        node = Node(match.node_id, match.endpoint_url, match.node_key, match.attempt)
        if match.max_output_tokens is not None:
            admitted = admitted.capped(match.max_output_tokens)
        speeds = dict(zip([match.node_id, *match.fallback_ids], match.tokens_per_s, strict=False))
        return Placed(match.job_id, node, match.fallback_ids, admitted, waited, speeds)

    def _params(self, admitted: Admitted, request: q.MatchRequest) -> dict[str, object]:
        """place_jobs()'s parameters for the call: made only for a request that asks SQL."""
        call = admitted.call
        hold = {"prompt_bytes": len(admitted.payload), "max_out": admitted.max_output_tokens}
        fallbacks = self.max_attempts - 1
        params = q.match_params(request, call.key.id, admitted.stream, fallbacks, **hold, wait=True)
        params["end_user"] = call.body.get("user")  # validated: a short line of text, or absent
        return params

    async def _lease(
        self, admitted: Admitted, route: str | None, queued: InLine | None = None
    ) -> Dispatched | None:
        """A slot this gateway leases, with no round trip (leased.py); None: ask SQL. `queued`: the
        request waits in line, where it is counted as the lane's demand already."""
        if self.leased is None or (lane := self.leased.lane(admitted)) is None:
            return None
        return await self.leased.dispatch(admitted, lane, route, queued)

    async def _at_share(self, admitted: Admitted) -> bool:
        """Holding its share of the lane: the request waits for one of this gateway's leased slots."""
        return self.leased is not None and await self.leased.at_share(admitted)

    def _from_lease(self, dispatched: Dispatched, admitted: Admitted, waited: float) -> Placed:
        lease = dispatched.taken.lease
        node = Node(lease.node_id, lease.url, lease.key, 1)
        speeds = {lease.node_id: lease.tokens_per_s}
        return Placed(dispatched.job_id, node, dispatched.fallbacks, admitted, waited, speeds)

    async def _wait(
        self,
        model: str,
        line: str,
        key_id: UUID,
        reach: float,
        params: dict[str, object],
        seen: int,
        gone: Callable[[], Awaitable[object]] | None,
        admitted: Admitted,
        route: str | None,
        apart: bool,
    ) -> q.Match | Dispatched:
        deadline = asyncio.get_running_loop().time() + self.queue_timeout_s
        lending = True  # for a request no leased slot could take, until SQL passes a lent slot over
        in_line: InLine | None = None  # counted in its lane's demand as waiting (leased.py)

        async def ask() -> q.Match | Dispatched | None:
            nonlocal lending
            if self.leased is None:  # leases off: every turn asks SQL
                match = await self._match(params)
                return None if match.busy else match
            dispatched = await self._lease(admitted, route, queued=in_line)
            if dispatched is not None or await self._at_share(admitted):
                return dispatched
            if self.leased.holds_nothing(admitted):
                match = await self._match(params, self.leased.book.lend())
            elif lending and not await self.leased.covered(admitted):
                # Its key's escrow here is short: it lends SQL its lane's idle leased slots (the one
                # freed for its turn), and SQL, checking the key's budget, takes one where every
                # node is full. In a line of its own, asking only for slots no lease held, it was
                # served only as a slot passed between gateways (bench chaos: a key's last cents
                # asked for seconds on end).
                lent = self.leased.book.lend(self.leased.lane(admitted), route, admitted.call.max_hourly_rate)
                match = await self._match(params, lent)
                lending = not (match.busy and lent.slots)  # a slot SQL will not give it: never again
            else:
                match = await self._match(params)
            return None if match.busy else match

        # The lane's demand while it waits: a request no leased slot could take too (SQL found its
        # budget good), which a slot this gateway's leases free is lent to.
        waiting = self.leased.waiting(admitted) if self.leased else contextlib.nullcontext(None)
        try:
            with waiting as in_line:  # the lane wants a slot more meanwhile (the leases' demand)
                match: q.Match | Dispatched | None = await self.room.wait(
                    line, key_id, deadline, ask, seen, gone, reach, apart
                )
        except ClientLeft:
            raise errors.ClientGone("the client hung up while its request waited for a slot") from None
        except LineFull as full:
            self.metrics.queue_refused.labels("full").inc()
            raise errors.NoCapacity(
                f"every capable node for {model} is busy and its queue is full ({full}): try again shortly",
                retry_after=1,
            ) from None
        if match is None:  # the deadline: one last ask, which records the refusal if it is one
            self.metrics.queue_refused.labels("deadline").inc()
            match = await self._lease(admitted, route) or await self._match({**params, "wait": False})
            if isinstance(match, Dispatched):
                return match
            if match.node_id is None and match.refusal != "route":  # that one: said by place()
                raise errors.NoCapacity(match.error or f"no node for {model}", retry_after=1)
        return match

    async def _match(self, params: dict[str, object], lent: Lent | None = None) -> q.Match:
        """Placed in SQL, with the `lent` idle slots of this gateway's leases (LeaseBook.lend()),
        which SQL takes where every node that could serve the request is full (a request new to the
        gateway is one round trip even where its other lanes lease every slot). A request's first
        ask; of its asks while it waits in line, those of a lane this gateway holds no slot of
        (other gateways give such a lane no slot of a full node where this one holds an idle slot
        to lend) and those no leased slot could take (its lane's slots alone), not each ask of every
        line, which would keep the slots out of use round trip after round trip."""
        lent = lent or Lent()
        if lent.slots:
            params = {**params, "lend": lent.as_json()}
        started = time.perf_counter()
        known, taken_on = False, None  # whether SQL answered, and on which node it took a lent slot
        try:
            match = await self.claims.place(params)  # its domain errors: the app's one handler
            known, taken_on = True, match.node_id if match.lent else None
        except ANSWERED:  # refused by SQL: all it did for the request is undone
            known = True
            raise
        finally:
            if self.leased is not None and lent.slots:
                if known:
                    self.leased.book.settle(lent, taken_on)
                else:  # its group may still be in Postgres: the slots stay lent until it is done
                    self._settle_later(self.leased, lent)
        self.metrics.matcher.observe(time.perf_counter() - started)
        return match

    def _settle_later(self, leased: LeasedJobs, lent: Lent) -> None:
        async def once_placed() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.claims.quiet(), SETTLE_WAIT_S)
            leased.book.settle(lent, None, known=False)

        task = asyncio.get_running_loop().create_task(once_placed())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def node_failed(self, node_id: UUID) -> None:
        """A node failed a request here (its own failure): this gateway's leases pass it over until a
        renewal sent after it comes back. A job SQL placed tells the book too: a renewal that was
        on its way as the node failed may lease it again, before SQL cooled it down."""
        if self.leased is not None:
            self.leased.book.failed(node_id)

    async def failover(
        self, job_id: UUID, error: str, status: int | None, candidates: list[UUID]
    ) -> Node | None:
        """The next node, or None: then failover_job() has ended the job as failed. A leased job
        moves to another slot leased here when there is one (leased.py)."""
        if self.leased is not None and self.leased.holds(job_id):
            moved = await self.leased.move(job_id, error, status)
            if moved is not None:
                return _node(moved)
        node = _node(await self.store.one(q.FAILOVER_JOB, (job_id, error, status, candidates)))
        if self.leased is not None:
            if node is None:  # failover_job() ended the job
                self.leased.ended_elsewhere(job_id)
            else:
                self.leased.moved_elsewhere(job_id)
        return node

    async def handoff(
        self, job_id: UUID, error: str, status: int | None, candidates: list[UUID]
    ) -> Node | None:
        """The next node, or None: then handoff_job() has left the job as it was. Status 421 (the
        gateway holding the node's tunnel broke off) ends the dropped attempt neutral for the node."""
        await self._to_database(job_id)
        node = _node(await self.store.one(q.HANDOFF_JOB, (job_id, error, status, candidates)))
        if node is not None and self.leased is not None:
            self.leased.moved_elsewhere(job_id)
        return node

    async def continuing(self, candidates: list[UUID]) -> list[UUID]:
        """The candidates whose servers were verified to go on with an open assistant message."""
        return await self.store.all(q.CONTINUING_NODES, (candidates,))

    async def reject(self, job_id: UUID, error: str, status: int | None) -> None:
        await self._to_database(job_id)
        await self.store.one(q.REJECT_JOB, (job_id, error, status))
        if self.leased is not None:
            self.leased.ended_elsewhere(job_id)

    async def _to_database(self, job_id: UUID) -> None:
        """A leased job that SQL moves or ends from here on: written first, its leased slot freed
        here (SQL's attempt on it ends without freeing one: the lease holds it)."""
        if self.leased is not None and self.leased.holds(job_id):
            await self.leased.to_database(job_id)
            self.leased.release(job_id)


def _not_served(request: q.MatchRequest, error: str | None) -> str:
    if request.route == ECHO:
        return f"no online node for {request.model} echoes prompts: `echo` needs a server that honours it"
    return error or f"no online node serves /v1/{request.route} for {request.model}"


def _node(row: q.Assignment | None) -> Node | None:
    if row is None or row.endpoint_url is None:
        return None
    return Node(row.node_id, row.endpoint_url, row.node_key, row.attempt)
