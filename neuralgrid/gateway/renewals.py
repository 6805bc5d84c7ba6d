"""Renewals of this gateway's leases (renew_leases(), one round trip each): twice a second, and
sooner where requests ask for one (a cold lane SQL placed a request of, a burst past a lease, a
draining slot fallen idle). The lease book (leases.py) counts; this module talks to Postgres."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from uuid import UUID

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.store import Store
from neuralgrid.gateway.leases import Lane, Lease, LeaseBook

log = logging.getLogger(__name__)

RENEW_EVERY_S = 0.5  # a node's failure, seen by one gateway, reaches the others within this and a round trip
# A lane whose demand outgrew its lease (LeaseBook.outgrown()) asks for more at most this often, not
# only every RENEW_EVERY_S: meanwhile each request of the burst is placed in SQL (a round trip, and
# some four times the Postgres CPU of a leased one).
GROW_EVERY_S = 0.1
# The longest a request waits for a renewal on its way to answer before it asks SQL (a database
# that does not answer: then SQL will not either, and the request says so).
ANSWER_WAIT_S = 1.0


@dataclass
class _OnWay:
    """A renewal on its way: its answer, and the requests waiting for it (Renewals.answer())."""

    answered: asyncio.Event
    cold: dict[Lane, int]  # the lanes it asks for that hold nothing: the slots each wants
    waiting: Counter[Lane] = field(default_factory=Counter)


class Renewals:
    """Renewals of this gateway's leases: one round trip each. A request for a lane this gateway
    holds nothing for is placed in SQL (the cold path: one round trip) and starts one that asks for
    the lane, shared with every request that comes for it meanwhile; the next ones are leased.

    One at a time. A renewal and a write of this gateway's journal meet on the rows of its own jobs
    (a job SQL placed, its end being written): Postgres runs them one after the other (each takes
    the gateway's advisory lock), so both are on their way at once and neither waits here a round
    trip for the other (a far gateway's job ends had, their slots held that long)."""

    def __init__(self, store: Store, gateway_id: UUID, book: LeaseBook) -> None:
        self.store = store
        self.gateway_id = gateway_id
        self.book = book
        self.lock = asyncio.Lock()
        # Told of each job of this gateway that SQL had placed and a renewal moved into a lease.
        self.absorbed: Callable[[UUID, Lease], None] = lambda _job, _lease: None
        self.renewed: Callable[[], None] = lambda: None  # after each renewal applied: requests in line look
        # The running jobs SQL placed that no renewal was heard to move into a lease, by lane.
        self.placed: Callable[[], Mapping[Lane, list[UUID]]] = dict
        self._asking: set[Lane] = set()  # lanes a renewal not yet sent is to ask for (soon())
        self._on_way: _OnWay | None = None  # the renewal on its way, for requests waiting for it
        self._sent_at: dict[Lane, float] = {}  # when the last renewal that asked for each was sent
        # When the last renewal's answer came: a burst's next renewal waits GROW_EVERY_S from then,
        # so that what that answer leased is taken first (a renewal on its way holds each lease to
        # what it reported in use: sent at once, a far gateway's would hold every new slot idle).
        self._answered_at = float("-inf")
        # Renewals in a row that soon() asked for and that gave the lane no slot.
        self._empty: dict[Lane, int] = defaultdict(int)
        self._behind: set[asyncio.Task[None]] = set()  # renewals asked for by requests (soon(), drained())
        self._draining = False  # a renewal drained() asked for is under way

    async def renew(self, asked_for: Lane | None = None) -> None:
        """One renewal of every lane this gateway wants or uses (shielded: a caller that goes away
        leaves it to finish, its answer applied); for a lane soon() `asked_for`, none if one was
        sent since."""
        await asyncio.shield(asyncio.get_running_loop().create_task(self._renewal(asked_for)))

    async def _renewal(self, asked_for: Lane | None) -> None:
        async with self.lock:
            if asked_for is not None and asked_for not in self._asking:
                return  # a renewal sent since soon() asked for the lane (the periodic one)
            lanes = self.book.lanes(self.placed())
            sent_at = self.book.clock()
            reported = {Lane(str(a["model"]), str(a["policy"]), str(a["region"] or "")): a for a in lanes}
            asking = reported.keys() & self._asking
            self._asking -= asking  # a request SQL places from now on asks for the next one
            if asked_for is not None:
                self._asking.discard(asked_for)
            self._sent_at = dict.fromkeys(reported, sent_at)
            # A lane it asks for that holds nothing yet may be given what it wants (answer()).
            cold = {
                lane: int(str(reported[lane]["want"]))
                for lane in asking
                if self._empty.get(lane, 0) < 2 and not self.book.leases(lane)
            }
            on_way = self._on_way = _OnWay(asyncio.Event(), cold)
            try:
                await self._send(lanes, sent_at, asking)
            finally:
                self._on_way = None
                on_way.answered.set()  # before the lock is let go: its waiters take first

    async def answer(self, lane: Lane, route: str | None, max_rate: float | None) -> bool:
        """Wait for the answer of the renewal on its way, for a request of `lane` (serving `route`
        within the price cap `max_rate`) that found no slot free, where that answer may give it
        one: the lane's slots it could take are held back until it comes (idle, reported not in
        use: LeaseBook.withheld()), or the lane holds nothing and the renewal asks for it (SQL
        placed one of its requests), for as many requests as each may give; False when there is
        none (or it has not come within ANSWER_WAIT_S). It usually comes before SQL's would, sent
        first; and a placement beside it holds the node's row, which the renewal skips: a
        sequential caller's cold lane got nothing renewal after renewal on a loaded machine, each
        request placed in SQL."""
        on_way = self._on_way
        if on_way is None:  # most requests that find no slot: no scan of the leases
            return False
        if on_way.waiting[lane] >= self.book.withheld(lane, route, max_rate) + on_way.cold.get(lane, 0):
            return False
        on_way.waiting[lane] += 1
        try:
            async with asyncio.timeout(ANSWER_WAIT_S):  # not wait_for(): a task of its own, a hop later
                await on_way.answered.wait()
        except TimeoutError:
            return False
        finally:
            on_way.waiting[lane] -= 1
        return True

    def soon(self, lane: Lane) -> None:
        """A renewal sent after now that asks for `lane`: SQL placed a request of it, which a
        renewal sent before could not see (SQL placing it says a slot was there, and the renewal
        moves the job's slot into the lease). None when one is to be sent already, or when one that
        asked for the lane was sent, or any renewal answered, within GROW_EVERY_S for a lane that
        holds slots (its demand outgrew them: a burst), or within RENEW_EVERY_S for a lane that two
        renewals in a row sent after a placement gave nothing (the periodic renewal asks for it
        then)."""
        if lane in self._asking:
            return
        if self.book.leases(lane):
            every = GROW_EVERY_S
        elif self._empty.get(lane, 0) >= 2:
            every = RENEW_EVERY_S
        else:
            every = 0.0
        since = self.book.clock() - max(self._sent_at.get(lane, float("-inf")), self._answered_at)
        if since < every:
            return
        self._asking.add(lane)
        task = asyncio.get_running_loop().create_task(self._renew_behind(lane))
        self._behind.add(task)
        task.add_done_callback(self._behind.discard)

    def drained(self, lane: Lane) -> None:
        """A draining slot of `lane` fell idle: a renewal now gives it back, to a gateway below its
        share. None while one is on its way (the next comes within RENEW_EVERY_S; sent on its
        answer, a far gateway's would hold what that answer leased idle a round trip more), or
        when one was sent or answered within GROW_EVERY_S."""
        since = self.book.clock() - max(self._sent_at.get(lane, float("-inf")), self._answered_at)
        if self.lock.locked() or self._draining or since < GROW_EVERY_S:
            return
        self._draining = True
        task = asyncio.get_running_loop().create_task(self._renew_drained())
        self._behind.add(task)
        task.add_done_callback(self._behind.discard)

    async def _renew_drained(self) -> None:
        try:
            await self.renew()
        except (psycopg.Error, DatabaseError, OSError) as err:  # the periodic renewal tries again
            log.warning("gateway %s could not renew its leases: %s", self.gateway_id, err)
        finally:
            self._draining = False

    async def _renew_behind(self, lane: Lane) -> None:
        try:
            await self.renew(lane)
        except (psycopg.Error, DatabaseError, OSError) as err:  # the periodic renewal tries again
            log.warning("gateway %s could not renew its leases for a new lane: %s", self.gateway_id, err)

    async def settled(self) -> None:
        """Until the renewals requests asked for are done (on shutdown, before the journal's last
        writes: the jobs they moved into leases are known as leased when their ends are written)."""
        while self._behind:
            await asyncio.wait(set(self._behind))

    async def _send(self, lanes: list[dict[str, object]], sent_at: float, asking: set[Lane]) -> None:
        rows = await self.store.all(q.RENEW_LEASES, (self.gateway_id, json.dumps(lanes)))
        for row in rows:  # done in SQL whatever the order the answers come in
            if row.absorbed and (lease := Lease.of(row)) is not None:
                for job_id in row.absorbed:
                    self.absorbed(job_id, lease)
        given = {lease.lane for row in rows if row.slots > 0 and (lease := Lease.of(row)) is not None}
        for lane in given | (set(self._empty) - set(self._sent_at)):  # leased, or no longer wanted
            self._empty.pop(lane, None)
        for lane in asking - given:
            self._empty[lane] += 1
        self.book.renewed(rows, sent_at, self.book.lease_s)
        self._answered_at = self.book.clock()
        self.renewed()


async def keep_renewing(
    stop: asyncio.Event,
    renewal: Callable[[], Awaitable[None]],
) -> None:
    """Renew every RENEW_EVERY_S until stop is set; through a database outage the leases lapse
    (nothing is dispatched from them) and renewals go on until it answers."""
    down = False
    while not stop.is_set():
        try:
            await renewal()
            if down:
                log.info("leases renewed again")
            down = False
        except (psycopg.Error, DatabaseError, OSError) as err:
            if not down:
                log.warning("could not renew this gateway's leases (%s): each serves until its end", err)
                down = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RENEW_EVERY_S)
