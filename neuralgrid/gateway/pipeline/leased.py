"""Requests served from this gateway's leases (gateway/leases.py): placed, moved on and ended here,
with Postgres told behind (gateway/journal.py), except when a node fails.

A leased job that fails goes to the database's path with one round trip, as failures always did:
its start is written, then SQL moves it, to another slot this gateway leases for the lane
(move_to_lease(), the slot taken here) or, with none left here, by failover_job() to any node with a
free slot; from then on its end is complete_jobs()'s. Failures are rare, and failover, rejection and
stream hand-over keep one implementation, in SQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from uuid import UUID, uuid4

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.gateway.escrow import Escrows, budget_hold
from neuralgrid.gateway.journal import JobRecord, Journal
from neuralgrid.gateway.leases import Lane, Lease, LeaseBook, Taken
from neuralgrid.gateway.pipeline.admit import Admitted, Catalog
from neuralgrid.gateway.renewals import Renewals
from neuralgrid.gateway.tunnel import MISDIRECTED

DRAIN_S = 5.0  # on shutdown, how long the journal may take to write what it holds
ENDED_KEPT = 4096  # jobs SQL placed that ended here, remembered for a renewal's answer still to come
# The most jobs SQL placed a renewal names for a lane (renew_leases() takes 10,000 at most): the
# oldest first; with more running at once, the rest are named as the first ones end.
PLACED_NAMED = 1000


@dataclass
class Slot:
    """A leased job's slot now, and what a move to another slot must keep to."""

    taken: Taken
    route: str | None
    tried: list[UUID]
    max_rate: float | None = None  # the request's price cap


@dataclass(frozen=True)
class Elsewhere:
    """A job of this gateway that SQL placed (no leased slot was free), while it runs."""

    lane: Lane
    route: str | None
    max_rate: float | None
    moved: bool = False  # SQL moved it on (failover, a stream's hand-over): SQL's to its end


@dataclass
class InLine:
    """A request waiting in line, counted in its lane's demand as waiting until it takes a leased
    slot (then counted as holding it, in the same step: never as both, which a renewal reported
    as two slots needed) or leaves the line."""

    lane: Lane
    counted: bool = True


@dataclass(frozen=True)
class Dispatched:
    job_id: UUID
    taken: Taken
    fallbacks: list[UUID]


class LeasedJobs:
    def __init__(
        self,
        store: Store,
        gateway_id: UUID,
        book: LeaseBook,
        escrows: Escrows,
        journal: Journal,
        catalog: Catalog,
        freed: Callable[[], None] = lambda: None,
    ) -> None:
        self.freed = freed  # told of each slot given back: a request waiting in line may take it
        self.store = store
        self.gateway_id = gateway_id
        self.renewals = Renewals(store, gateway_id, book)
        self.book = book
        self.escrows = escrows
        self.journal = journal
        self.catalog = catalog
        self._slots: dict[UUID, Slot] = {}
        self._elsewhere: dict[UUID, Elsewhere] = {}  # this gateway's jobs SQL placed, in flight: demand too
        self._placed: dict[UUID, JobRecord] = {}  # the same jobs' records, their ends written behind
        # Jobs SQL placed that ended here lately, oldest first: a renewal that moved the slot of
        # one of them (its end not yet written when it ran) left the lease an idle slot.
        self._ended: dict[UUID, None] = {}
        journal.on_commit.append(self._written)
        journal.on_refused.append(self._refused)
        self.renewals.absorbed = self._absorbed
        self.renewals.placed = self._sql_placed
        self.renewals.renewed = freed  # requests waiting in line look at the renewed leases

    async def renew(self) -> None:
        """The periodic renewal: the lease's length, the leases, then the escrows between two writes
        of the journal (never during one: an escrow read back must agree with the holds this gateway
        knows to be written)."""
        self.book.lease_s = await self.store.get(q.LEASE_SECONDS)
        await self.renewals.renew()
        async with self.journal.lock:
            wants = self.escrows.due()
            if wants is not None:
                rows = await self.store.all(q.RENEW_ESCROWS, (self.gateway_id, json.dumps(wants)))
                self.escrows.renewed(rows)

    async def drain(self) -> None:
        """On shutdown: write what is queued, for a bounded time; what is left stays spooled."""

        async def last_writes() -> None:
            await self.renewals.settled()
            await self.journal.flush()

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(last_writes(), DRAIN_S)
        self.journal.close()

    @staticmethod
    def lane(admitted: Admitted) -> Lane | None:
        """The lane a call is served from (a price cap filters its leases, in their order)."""
        call = admitted.call
        return Lane(call.model, call.policy, call.region or "")

    async def dispatch(
        self, admitted: Admitted, lane: Lane, route: str | None, queued: InLine | None = None
    ) -> Dispatched | None:
        """A slot of the lane and the job's id, with no round trip; None when this gateway holds no
        free slot for it (nor does the renewal on its way give one, where it may: its answer is
        waited for, Renewals.answer()), or the key's escrow cannot cover its hold.
        `queued`: a request waiting in line (counted as the lane's demand while it waits: not twice
        when it takes its slot)."""
        call = admitted.call
        cap = call.max_hourly_rate
        hold = await self._hold(admitted)
        # The escrow first (asked for, for the next ones, when it cannot cover this one): a slot
        # taken and given back would count as the lane's demand a request its budget keeps off it.
        budgeted = call.key.budget_usd is not None
        if budgeted and not self.escrows.take(call.key.id, hold):
            self.book.asked(lane)
            return None
        taken = None
        try:
            taken = self.book.take(lane, route, max_rate=cap, counted=queued is None)
            if taken is None and await self.renewals.answer(lane, route, cap):
                taken = self.book.take(lane, route, max_rate=cap, counted=queued is None)
        finally:  # none taken, or the client went away meanwhile: its hold goes back
            if taken is None and budgeted:
                self.escrows.give_back(call.key.id, hold)
        if taken is None:
            return None
        if queued is not None and queued.counted:  # out of the line as it takes the slot
            self.book.unleased(queued.lane, -1, waiting=True)
            queued.counted = False
        job_id = uuid4()
        self.journal.start(_record(job_id, admitted, taken.node_id, hold))
        self._slots[job_id] = Slot(taken, route, [taken.node_id], cap)
        return Dispatched(job_id, taken, self.book.others(lane, taken.node_id, cap))

    def holds(self, job_id: UUID) -> bool:
        return job_id in self._slots

    async def _hold(self, admitted: Admitted) -> Decimal:
        """The budget hold of a call whose key has a budget (0 for one without)."""
        if admitted.call.key.budget_usd is None:
            return Decimal(0)
        prices = await self.catalog.get(admitted.call.model)  # cached: no round trip once loaded
        return budget_hold(prices, len(admitted.payload), admitted.max_output_tokens)

    async def covered(self, admitted: Admitted) -> bool:
        """Whether a leased slot could serve the call: its key has no budget, or an escrow here
        that covers its hold. One that is not is placed in SQL, which holds its budget."""
        key = admitted.call.key
        return key.budget_usd is None or self.escrows.covers(key.id, await self._hold(admitted))

    async def at_share(self, admitted: Admitted) -> bool:
        """No request of this call's lane is to be placed in SQL: this gateway holds its share of
        the lane (leases.py), so it waits for a slot of its own. Not for a call no leased slot
        could serve (covered())."""
        lane = self.lane(admitted)
        return lane is not None and self.book.at_share(lane) and await self.covered(admitted)

    def placed_elsewhere(self, job_id: UUID, node_id: UUID, admitted: Admitted, route: str | None) -> None:
        """SQL placed the job (no leased slot was free): its lane wants a slot more until it ends,
        or until a renewal moves its slot into the lease (_absorbed). Its end is written behind,
        as a leased job's is (end())."""
        lane = self.lane(admitted)
        self._placed[job_id] = _record(job_id, admitted, node_id, Decimal(0))  # its hold: SQL's
        if lane is not None and job_id not in self._elsewhere:
            self._elsewhere[job_id] = Elsewhere(lane, route, admitted.call.max_hourly_rate)
            self.book.unleased(lane, 1)
            self.book.sql_job(job_id, lane, node_id)
        if lane is not None and (not self.book.leases(lane) or self.book.outgrown(lane)):
            # Cold, given nothing by the last renewal, or a burst past its lease: a renewal asks for
            # the lane now, its demand counting this job, which it moves into the lease it gets
            # (_absorbed). Asked before the job was placed, it could lease the very slot SQL was
            # about to give the job, leaving the job to wait in line. (Not for a lease a slot or two
            # short in steady state: a renewal every GROW_EVERY_S cost 15% more Postgres CPU a
            # request in bench gateway, 2026-12-04.)
            self.renewals.soon(lane)

    def refused(self, admitted: Admitted) -> None:
        """SQL refused the call's model or policy as unknown: its lane is not wanted for it."""
        lane = self.lane(admitted)
        if lane is not None:
            self.book.forget(lane)

    def holds_nothing(self, admitted: Admitted) -> bool:
        """This gateway leases no slot of the request's lane (one leases serve)."""
        lane = self.lane(admitted)
        return lane is not None and not self.book.leases(lane)

    @contextlib.contextmanager
    def waiting(self, admitted: Admitted) -> Iterator[InLine | None]:
        """While a request waits in line for a slot: its lane wants one more (until it takes a
        leased slot: dispatch() with what this yields). A lane this gateway holds no slot of asks
        for it at once: the renewal says what it needs (where the gateway holds an idle slot of
        another lane on a full node, SQL moves it to this lane)."""
        lane = self.lane(admitted)
        in_line = None if lane is None else InLine(lane)
        if in_line is not None:
            self.book.unleased(in_line.lane, 1, waiting=True)
            if not self.book.leases(in_line.lane):
                self.renewals.soon(in_line.lane)
        try:
            yield in_line
        finally:
            if in_line is not None and in_line.counted:
                self.book.unleased(in_line.lane, -1, waiting=True)

    def moved_elsewhere(self, job_id: UUID) -> None:
        """SQL moved a job it placed to another node: the job stays SQL's to its end (renew_lane()
        moves no such job into a lease). A renewal that moved its slot into the lease while SQL moved
        it on is undone here: the slot is free again (the attempt on it has ended)."""
        placed = self._elsewhere.get(job_id)
        self.book.sql_job_gone(job_id)  # SQL's to its end: no renewal moves it now
        slot = self.release(job_id)
        if slot is not None:  # absorbed meanwhile: a request SQL placed again
            placed = Elsewhere(slot.taken.lease.lane, slot.route, slot.max_rate)
            self.book.unleased(placed.lane, 1)
        if placed is not None:
            self._elsewhere[job_id] = dataclasses.replace(placed, moved=True)

    def ended_elsewhere(self, job_id: UUID) -> None:
        """A job SQL placed has ended (or SQL ended it: failed over to no node, rejected). A renewal
        that moved its slot into the lease meanwhile (_absorbed) left the slot in use here: free."""
        self.release(job_id)
        record = self._placed.pop(job_id, None)
        placed = self._elsewhere.pop(job_id, None)
        if placed is not None:
            self.book.unleased(placed.lane, -1)
            self.book.sql_job_ended(job_id)
        if record is not None or placed is not None:
            self._ended[job_id] = None
            if len(self._ended) > ENDED_KEPT:
                del self._ended[next(iter(self._ended))]

    def _absorbed(self, job_id: UUID, lease: Lease) -> None:
        """A renewal moved the slot of a job SQL placed into `lease`: the job is served from the
        lease now (its end gives the slot back here; SQL's end of it frees none). A job that ended
        before the renewal came back left the lease an idle slot, which the next renewal reports.
        SQL moves only the jobs a renewal names (_sql_placed()): each was known here when it was sent."""
        if job_id in self._ended:
            return
        placed = self._elsewhere.get(job_id)
        if placed is None or placed.moved:  # SQL moved it on meanwhile: that slot is idle
            return
        del self._elsewhere[job_id]
        self.book.unleased(placed.lane, -1)
        self.book.sql_job_gone(job_id)
        taken = self.book.adopt(lease)
        self._slots[job_id] = Slot(taken, placed.route, [lease.node_id], placed.max_rate)

    def _sql_placed(self) -> dict[Lane, list[UUID]]:
        """The running jobs SQL placed and still SQL's here, by lane: each renewal names them, and
        hears which of them a lease holds (_absorbed), told again where the answer of the renewal
        that moved one was lost (the job's slot in a lease this gateway thought idle)."""
        placed: dict[Lane, list[UUID]] = defaultdict(list)
        for job_id, where in self._elsewhere.items():
            if not where.moved and len(placed[where.lane]) < PLACED_NAMED:
                placed[where.lane].append(job_id)
        return {lane: named for lane, named in placed.items() if named}

    def _written(self, record: JobRecord, first: bool) -> None:
        if first and record.key is not None and record.hold_usd:
            self.escrows.written(record.key, record.hold_usd)

    def _refused(self, record: JobRecord) -> None:
        """SQL refused the job's record before its start was written: its hold never left the escrow."""
        if record.key is not None and record.hold_usd:
            self.escrows.give_back(record.key, record.hold_usd)

    async def to_database(self, job_id: UUID) -> None:
        """Before SQL acts on a leased job: its start written, and the journal's part in it done."""
        if self.journal.leased(job_id):
            await self.journal.hand_over(job_id)

    async def move(self, job_id: UUID, error: str, status: int | None) -> q.Assignment | None:
        """A leased job's node failed: move it to another slot leased here for its lane (the failed
        attempt ended in SQL, as failover_job() ends one), or return None with the slot given back
        (the caller moves the job by failover_job())."""
        slot = self._slots[job_id]
        if status != MISDIRECTED:  # the node's own failure (not a tunnel no gateway reached)
            self.book.failed(slot.taken.node_id)
        await self.to_database(job_id)
        lane = slot.taken.lease.lane
        nxt = self.book.take(lane, slot.route, exclude=slot.tried, max_rate=slot.max_rate, counted=False)
        self.book.give_back(slot.taken)
        if nxt is None:
            del self._slots[job_id]
            return None
        try:
            row = await self.store.one(q.MOVE_TO_LEASE, (job_id, error, status, nxt.node_id))
        except BaseException:  # the old slot is free already: neither is this job's any more
            self.book.give_back(nxt)
            del self._slots[job_id]
            raise
        if row is None:  # the job had ended meanwhile (swept)
            self.book.give_back(nxt)
            del self._slots[job_id]
            return None
        slot.taken = nxt
        slot.tried.append(nxt.node_id)
        return row

    def release(self, job_id: UUID) -> Slot | None:
        """The job is over (or handed to SQL): its leased slot is free again at once."""
        slot = self._slots.pop(job_id, None)
        if slot is not None:
            self.book.give_back(slot.taken)
            self.freed()
            if self.book.drained(slot.taken):  # idle above this gateway's share: back at once
                self.renewals.drained(slot.taken.lease.lane)
        return slot

    def end(self, end: q.JobEnd) -> asyncio.Future[Decimal | None] | None:
        """End a job: its leased slot free now, its end written behind (the future: its cost once
        written), whether a lease or SQL placed it (record_jobs() ends one SQL placed as
        complete_jobs() does: SQL's slot is free once written). None for a leased job SQL took over
        (a failure moved it on): complete_jobs() ends it, its leased slot free now too."""
        self.release(end.job_id)
        placed = self._placed.pop(end.job_id, None)
        self.ended_elsewhere(end.job_id)
        if self.journal.leased(end.job_id):
            return self.journal.end(end.job_id, end)
        if placed is not None:
            placed.end = end
            return self.journal.ended(placed)
        return None


def _record(job_id: UUID, admitted: Admitted, node_id: UUID, hold: Decimal) -> JobRecord:
    """The job as record_jobs() takes it: its start, here and now."""
    call = admitted.call
    end_user = call.body.get("user")
    return JobRecord(
        job_id,
        call.key.id,
        call.model,
        call.policy,
        call.region,
        admitted.stream,
        node_id,
        datetime.now(UTC),
        hold,
        end_user if isinstance(end_user, str) else None,
    )
