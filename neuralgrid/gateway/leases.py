"""Slots this gateway holds on nodes, leased from Postgres, spent here without asking it.

SQL decides (renew_leases(): which nodes, how many slots, ranked as score_nodes() ranks them, this
gateway's fair share of each lane); this module only counts. A request takes a free slot of its lane
on the best ranked node that has one and gives it back when it ends. Twice a second the gateway
renews every lane in one call (renewals.py), saying how many slots it wants and how many of each
lease are in use (docs/scaling.md#far-from-the-database-leases).

A lease is used only until this gateway's own reckoning of its end: the renewal's send time plus
lease_s, less a margin. Postgres counts from its commit, later than that, so a gateway that cannot
renew stops dispatching before SQL could hand its slots to another.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from uuid import UUID

from neuralgrid.db import queries as q

log = logging.getLogger(__name__)

MARGIN_S = 0.5  # a lease is not used in its last half second, by this gateway's clock
IDLE_S = 10.0  # a lane nobody asked for in this long is no longer wanted: its slots go back
DEFAULT_LEASE_S = 5.0  # platform_settings.lease_s, until a renewal says otherwise
# A request placed in SQL lends an idle slot of this gateway's leases on at most this many nodes
# (LeaseBook.lend()): where every node that could take it is full, SQL takes the best of them.
LEND_AT_MOST = 4


@dataclass(frozen=True)
class Lane:
    """What a gateway leases slots for: a model under a policy, in a region ('' for none)."""

    model: str
    policy: str
    region: str = ""

    def as_json(self) -> dict[str, str | None]:
        return {"model": self.model, "policy": self.policy, "region": self.region or None}


@dataclass(frozen=True)
class Lease:
    """Slots of one node, for one lane, as the last renewal returned them."""

    lane: Lane
    node_id: UUID
    url: str
    key: bytes | None
    slots: int
    rank: int
    tokens_per_s: float | None
    routes: frozenset[str]
    hourly_rate: float | None = None
    draining: int = 0  # slots held above this gateway's share, in use then: not taken again

    @classmethod
    def of(cls, row: q.LeaseRow) -> Lease | None:
        """The lease a renewal's row gives (None: a tunneled node no gateway holds now)."""
        if row.endpoint_url is None:
            return None
        return cls(
            Lane(row.model_id, row.policy, row.region or ""),
            row.node_id,
            row.endpoint_url,
            None if row.node_key is None else bytes(row.node_key),
            row.slots,
            row.rank,
            row.tokens_per_s,
            frozenset(row.routes or ()),
            None if row.hourly_rate is None else float(row.hourly_rate),
            row.draining,
        )


@dataclass(frozen=True)
class Lent:
    """Idle leased slots lent to one placement in SQL (place_jobs()' "lend"), one a (lane, node):
    out of use here until its answer says which, if any, SQL took (LeaseBook.settle()). `busy`:
    each lease's slots in use here when lent; SQL lends none from a lease that holds no more (a
    renewal under way may have given idle slots back)."""

    slots: tuple[tuple[Lane, UUID], ...] = ()
    busy: tuple[int, ...] = ()
    # Per slot, this gateway's running jobs SQL placed of that lane on that node: SQL counts those a
    # renewal moved into the lease as in use too (their slots are in it, unknown here).
    placed: tuple[tuple[UUID, ...], ...] = ()

    def as_json(self) -> list[dict[str, object]]:
        return [
            {
                "node": str(node),
                **lane.as_json(),
                "busy": busy,
                "placed": [str(job_id) for job_id in placed],
            }
            for (lane, node), busy, placed in zip(self.slots, self.busy, self.placed, strict=True)
        ]


@dataclass(frozen=True)
class Taken:
    """One leased slot in use by one request."""

    lease: Lease

    @property
    def node_id(self) -> UUID:
        return self.lease.node_id


class LeaseBook:
    """The leases this gateway holds, and how many of each slot are in use."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lease_s = DEFAULT_LEASE_S
        self._ranked: dict[Lane, list[Lease]] = {}
        self._usable_until = float("-inf")
        # In use per (lane, node): kept apart from the leases, since a request goes on on a node
        # that a renewal no longer returns (cooling down, say) and its slot is still reported in use.
        self._in_use: dict[tuple[Lane, UUID], int] = defaultdict(int)
        self._held: dict[Lane, int] = defaultdict(int)  # the same, per lane (read each request)
        # This gateway's requests of each lane in flight with no leased slot (SQL placed them, or they
        # wait in line for a slot): demand as much as the leased ones, or a lane's lease would grow
        # by a slot a renewal, and a gateway whose callers wait would want no more than one slot.
        self._unleased: dict[Lane, int] = defaultdict(int)
        self._waiting: dict[Lane, int] = defaultdict(int)  # of those, the ones waiting in line
        self._waited: set[Lane] = set()  # lanes where a request waited since the last renewal
        self._peak: dict[Lane, int] = {}  # most in flight (or wanted) at once since the last renewal
        self._wants: dict[Lane, int] = {}  # what the last renewal asked for
        self._needs: dict[Lane, int] = {}  # of which it needed (SQL shares the needs)
        self._at_share: set[Lane] = set()  # lanes where this gateway holds its share, or more
        self._asked_at: dict[Lane, float] = {}
        # Nodes that failed a request here, and when: passed over until a renewal sent after that
        # comes back (SQL has the failure by then, and cools the node down for every gateway).
        self._failed: dict[UUID, float] = {}
        self._lent: dict[tuple[Lane, UUID], int] = defaultdict(int)  # lent to placements under way
        # Lent slots SQL took (each lease one smaller), and when this gateway knew: a renewal sent
        # before then may not show it, and is read one smaller there too.
        self._returned: list[tuple[tuple[Lane, UUID], float]] = []
        # A renewal on its way may give back any idle slot above what it reported in use: until its
        # answer (or a later one's) comes, none is taken past that, or a slot SQL gave back could be
        # in use here while another claim takes it. What it reports is each lease's most in use at
        # once since the renewal before (None: no report awaits its answer).
        self._promised: dict[tuple[Lane, UUID], int] | None = None
        self._most_used: dict[tuple[Lane, UUID], int] = {}
        self._drains: set[Lane] = set()  # lanes the last renewal returned a draining lease of
        # This gateway's running jobs SQL placed (and did not move on), each one's (lane, node): a renewal
        # sent since names them and moves their slots into the lane's lease there (renew_lane()), in
        # use, unknown here until its answer. One whose job ended while a renewal was on its way may
        # be idle there: lent as an idle slot is (lend()), since a far gateway's next new model
        # otherwise met the node full of it and waited in line (bench world, 2026-12-07).
        self._sql_jobs: dict[UUID, tuple[Lane, UUID]] = {}
        self._moved_idle: dict[tuple[Lane, UUID], int] = defaultdict(int)
        self._named: set[UUID] = set()  # the jobs SQL placed that the renewal on its way names

    def take(
        self,
        lane: Lane,
        route: str | None,
        exclude: Iterable[UUID] = (),
        max_rate: float | None = None,
        counted: bool = True,
    ) -> Taken | None:
        """A free slot of the lane on the best ranked node serving `route` (None: any) within the
        price cap `max_rate` (hard filters, which leave SQL's order as it is), or None. Not
        `counted`: the request is in the lane's demand already (waiting in line, or moving on from a
        failed node), and is not counted again in the moment before it leaves the line."""
        now = self.asked(lane)
        if now >= self._usable_until:
            return None
        skip = set(exclude)
        for lease in self._ranked.get(lane, ()):
            if lease.node_id in skip or lease.node_id in self._failed or not _serves(lease, route, max_rate):
                continue
            key = (lane, lease.node_id)
            if self._idle(key, lease) and self._promised_more(key):
                self._in_use[key] += 1
                self._held[lane] += 1
                self._used_more(key)
                if counted:
                    self._busier(lane)
                return Taken(lease)
        return None

    def asked(self, lane: Lane) -> float:
        """A request asked for the lane (now, returned): it is wanted for IDLE_S from now."""
        now = self._asked_at[lane] = self.clock()
        return now

    def forget(self, lane: Lane) -> None:
        """SQL refused a request of the lane as one of a model or policy that does not exist: no
        longer wanted, unless the lane holds, uses or waits for anything. Else every made-up name
        a client sends would be named in this gateway's renewals IDLE_S long."""
        busy = self._held.get(lane) or self._unleased.get(lane) or self._waiting.get(lane)
        if busy or self._ranked.get(lane) or any(held == lane for held, _ in self._in_use):
            return
        for wanted in (self._asked_at, self._peak, self._wants, self._needs):
            wanted.pop(lane, None)

    def _busier(self, lane: Lane) -> None:
        """One more of the lane's requests in flight: the demand the next renewal reports. Counted
        only when a request holds or waits for a slot, not when it merely asks: one its key's budget
        then refuses wants nothing, and would tip the lane's shares towards the gateways it asks."""
        self._peak[lane] = max(self._peak.get(lane, 0), self._in_flight(lane))

    def adopt(self, lease: Lease) -> Taken:
        """A slot of `lease` that a job SQL placed was already using (renew_leases() moved it into
        the lease): in use here from now on, given back when the job ends."""
        key = (lease.lane, lease.node_id)
        self._in_use[key] += 1
        self._held[lease.lane] += 1
        self._used_more(key)
        return Taken(lease)

    def failed(self, node_id: UUID) -> None:
        """A node failed a request: none is sent it from here until the next renewal."""
        self._failed[node_id] = self.clock()

    def _idle(self, key: tuple[Lane, UUID], lease: Lease) -> bool:
        """Whether the lease has a slot neither in use here nor lent."""
        return self._used(key) < lease.slots

    def _used(self, key: tuple[Lane, UUID]) -> int:
        return self._in_use.get(key, 0) + self._lent.get(key, 0)

    def _used_more(self, key: tuple[Lane, UUID]) -> None:
        """A slot more in use: the most at once since the last report (lent ones are SQL's to take
        or not, under its own locks: counted, a lent slot SQL took would be reported in use)."""
        self._most_used[key] = max(self._most_used.get(key, 0), self._in_use.get(key, 0))

    def withheld(self, lane: Lane, route: str | None, max_rate: float | None = None) -> int:
        """The idle slots of the lane's leases that take() would choose, where it found none: held
        back until the answer of the report on its way (which may give them back: it said they
        were not in use)."""
        if self._promised is None or self.clock() >= self._usable_until:
            return 0
        held = 0
        for lease in self._ranked.get(lane, ()):
            key = (lane, lease.node_id)
            if lease.node_id not in self._failed and _serves(lease, route, max_rate):
                held += max(0, lease.slots - self._used(key))
        return held

    def _promised_more(self, key: tuple[Lane, UUID]) -> bool:
        """Whether one more of the lease's slots may be taken with a renewal's report on its way."""
        # Lent slots count: the report counted them in use, and SQL may take one a renewal kept
        # (a review: taken here too, the lease would run one request past what SQL left it).
        used = self._in_use.get(key, 0) + self._lent.get(key, 0)
        return self._promised is None or used < self._promised.get(key, 0)

    def lend(self, lane: Lane | None = None, route: str | None = None, max_rate: float | None = None) -> Lent:
        """An idle slot of this gateway's leases on each of up to LEND_AT_MOST nodes, any lane (or
        `lane`'s alone, those serving `route` within the price cap `max_rate`, as take() chooses),
        for a request placed in SQL: where every node that could take the request is full, SQL may
        give it one of them (private.return_lent_slot()). Out of use here until settle(). On each
        node, first a slot the renewal on its way keeps (it reported it in use), then (any lane)
        one it may have moved into a lease for a job since ended (sql_job()), then one it may give
        back: SQL lends only what its lease still holds, and a lent slot gone is a request kept
        in line."""
        if self.clock() >= self._usable_until:
            return Lent()
        kept: dict[UUID, tuple[Lane, UUID]] = {}
        at_risk: dict[UUID, tuple[Lane, UUID]] = {}
        ranked = self._ranked.items() if lane is None else [(lane, self._ranked.get(lane, []))]
        for held, leases in ranked:
            for lease in leases:
                key = (held, lease.node_id)
                if (
                    lease.node_id not in self._failed
                    and _serves(lease, route, max_rate)
                    and self._idle(key, lease)
                ):
                    (kept if self._promised_more(key) else at_risk).setdefault(lease.node_id, key)
        moved: dict[UUID, tuple[Lane, UUID]] = {}
        if lane is None and self._moved_idle:
            nodes = {lease.node_id: lease for leases in self._ranked.values() for lease in leases}
            for key, idle in self._moved_idle.items():  # in the order their jobs ended
                node = key[1]
                if (
                    node not in self._failed
                    and (node not in nodes or _serves(nodes[node], route, max_rate))
                    and self._lent.get(key, 0) < idle
                ):
                    moved.setdefault(node, key)
        chosen: dict[UUID, tuple[Lane, UUID]] = {}
        for choice in (kept, moved, at_risk):
            for node, key in choice.items():
                if len(chosen) < LEND_AT_MOST:
                    chosen.setdefault(node, key)
        for key in chosen.values():
            self._lent[key] += 1
        keys = tuple(chosen.values())
        return Lent(
            keys, tuple(self._in_use.get(key, 0) for key in keys), tuple(self._placed_on(k) for k in keys)
        )

    def sql_job(self, job_id: UUID, lane: Lane, node_id: UUID) -> None:
        """A job SQL placed of the lane runs on the node: a renewal may move its slot into the lane's
        lease there, unknown here until its answer. SQL is told of it with each slot lent there
        (Lent.placed), and counts it in use if it did (or could lend the slot it runs on)."""
        self._sql_jobs[job_id] = (lane, node_id)

    def sql_job_gone(self, job_id: UUID) -> None:
        """The job is no longer one a renewal could move: moved into a lease (known here now) or
        moved on by SQL."""
        self._sql_jobs.pop(job_id, None)

    def sql_job_ended(self, job_id: UUID) -> None:
        """The job ended here: while a renewal that named it is on its way, the slot it may have
        moved into the lease is lent as an idle one."""
        key = self._sql_jobs.pop(job_id, None)
        if key is not None and self._promised is not None and job_id in self._named:
            self._moved_idle[key] += 1

    def _placed_on(self, key: tuple[Lane, UUID]) -> tuple[UUID, ...]:
        return tuple(job_id for job_id, on in self._sql_jobs.items() if on == key)

    def settle(self, lent: Lent, taken_on: UUID | None, known: bool = True) -> None:
        """The placement's answer came: the lent slots are usable again here, but the one SQL took
        (on node `taken_on`), which has left its lease. Not `known` (no answer: the connection
        broke, or the request was cancelled; settled once the placement can do nothing more), any
        of them may have been taken: each leaves its lease here until a renewal sent after now says
        what the lease holds."""
        now = self.clock()
        for key in lent.slots:
            self._lent[key] -= 1
            if self._lent[key] <= 0:
                del self._lent[key]
            if not known or key[1] == taken_on:
                self._ranked = _shrunk(self._ranked, key)
                self._returned.append((key, now))
                if self._moved_idle.get(key, 0) > 0:
                    self._moved_idle[key] -= 1
                if self._promised is not None and self._promised.get(key, 0) > 0:
                    # Reported in use (lent), now gone: the renewal on its way keeps one slot fewer.
                    self._promised[key] -= 1

    def give_back(self, taken: Taken) -> None:
        key = (taken.lease.lane, taken.node_id)
        if key not in self._in_use:  # given back already: nothing is in use twice
            return
        self._in_use[key] -= 1
        if self._in_use[key] <= 0:
            del self._in_use[key]
        self._held[taken.lease.lane] -= 1
        if self._held[taken.lease.lane] <= 0:
            del self._held[taken.lease.lane]

    def drained(self, taken: Taken) -> bool:
        """Whether the slot just given back was one of its lease's draining ones (those in use past
        the slots it may take): idle, the next renewal gives it back, to a gateway below its share
        (which SQL tells at once)."""
        lane, node = taken.lease.lane, taken.node_id
        if lane not in self._drains:  # most lanes, most of the time: no scan on a request's end
            return False
        lease = next((held for held in self._ranked.get(lane, ()) if held.node_id == node), None)
        return lease is not None and lease.slots <= self._used((lane, node)) < lease.slots + lease.draining

    def others(self, lane: Lane, node_id: UUID, max_rate: float | None = None) -> list[UUID]:
        """The lane's other nodes (leased, then the fallbacks), in rank order, within the price cap:
        a job's fallbacks."""
        return [
            lease.node_id
            for lease in self._ranked.get(lane, ())
            if lease.node_id != node_id
            and (max_rate is None or (lease.hourly_rate is not None and lease.hourly_rate <= max_rate))
        ]

    def unleased(self, lane: Lane, change: int, waiting: bool = False) -> None:
        """A request of the lane with no leased slot (placed in SQL, or `waiting` in line) started
        (+1) or ended (-1)."""
        self._unleased[lane] += change
        if self._unleased[lane] <= 0:
            del self._unleased[lane]
        if waiting:
            self._waiting[lane] += change
            self._waited.add(lane)
            if self._waiting[lane] <= 0:
                del self._waiting[lane]
        if change > 0:
            self._busier(lane)

    def outgrown(self, lane: Lane) -> bool:
        """As many of the lane's requests in flight here without a leased slot as with one: its
        demand has outgrown its lease (a burst), not merely found it a slot or two short (a renewal
        skips the node rows other transactions hold)."""
        return self._unleased.get(lane, 0) >= max(self._held.get(lane, 0), 1)

    def _in_flight(self, lane: Lane) -> int:
        """The lane's requests in flight here: on leased slots, and the unleased ones."""
        return self._held.get(lane, 0) + self._unleased.get(lane, 0)

    def lanes(self, placed: Mapping[Lane, list[UUID]] | None = None) -> list[dict[str, object]]:
        """renew_leases()'s lanes: each one wanted (asked for lately) or still in use, with how many
        slots it wants (its busiest moment since the last renewal, counting the requests SQL placed
        and those waiting in line, and one spare unless requests waited: in a scarce lane the line
        is the demand, and a spare each would tip the shares towards the gateways with the fewest
        callers; after a busier moment, no less than half what it last asked for, so that a lull of
        a second or two between bursts does not send the next burst to SQL); how many of them it
        needs (that busiest moment alone: SQL claims the rest, the spares, only where a node keeps a
        slot free, and gives idle ones back from a full node others need); and its slots in use per
        node; and the running jobs SQL `placed` that no renewal was heard to move into a lease
        (renew_leases() says which of them one did: its answer may have been lost). Starts the next
        period's count."""
        placed = placed or {}
        now = self.clock()
        wanted = {lane for lane, at in self._asked_at.items() if now - at < IDLE_S}
        wanted |= {lane for lane, _ in self._in_use} | set(placed)
        report: list[dict[str, object]] = []
        promised: dict[tuple[Lane, UUID], int] = {}
        takable = {
            (lease.lane, lease.node_id): lease.slots for leases in self._ranked.values() for lease in leases
        }
        for lane in sorted(wanted, key=lambda held: (held.model, held.policy, held.region)):
            in_use = {str(node): n for (held, node), n in self._in_use.items() if held == lane}
            for (held, node), n in self._lent.items():  # lent: in use until SQL says otherwise
                if held == lane:
                    in_use[str(node)] = in_use.get(str(node), 0) + n
            # Reported: each lease's most in use since the last report, which SQL keeps and this
            # gateway may use until the answer comes (take()); the need is what is in use now. No
            # more than the lease's slots that may be taken: its draining ones are not taken again,
            # and one whose job has ended goes back now, not a renewal later.
            reported = dict(in_use)
            for (held, node), n in self._most_used.items():
                usable = min(n, takable.get((held, node), 0))
                if held == lane and usable > reported.get(str(node), 0):
                    reported[str(node)] = usable
            for held_on, n in reported.items():
                promised[(lane, UUID(held_on))] = n
            busiest = max(self._peak.get(lane, 0), self._in_flight(lane))
            idle = now - self._asked_at.get(lane, float("-inf")) >= IDLE_S
            spare = 0 if lane in self._waited else 1
            need = sum(in_use.values()) if idle else busiest
            want = need if idle else max(busiest + spare, (self._wants.get(lane, 0) + 1) // 2)
            self._wants[lane], self._needs[lane] = want, need
            report.append({**lane.as_json(), "want": want, "need": need, "in_use": reported})
            if placed.get(lane):
                report[-1]["placed"] = [str(job_id) for job_id in placed[lane]]
        self._peak = {lane: self._in_flight(lane) for lane in wanted}
        self._moved_idle.clear()  # the renewal before answered (renewed()), or its answer was lost
        self._named = {job_id for named in placed.values() for job_id in named}
        self._promised = promised
        self._most_used = {key: n for key, n in self._in_use.items() if n}
        self._waited = set(self._waiting)
        for lane in [lane for lane, at in self._asked_at.items() if now - at >= IDLE_S]:
            del self._asked_at[lane]
        self._wants = {lane: n for lane, n in self._wants.items() if lane in wanted}
        self._needs = {lane: n for lane, n in self._needs.items() if lane in wanted}
        return report

    def renewed(self, rows: Iterable[q.LeaseRow], sent_at: float, lease_s: float) -> None:
        """What a renewal returned: the leases held now, usable until `sent_at` (this clock) plus
        the lease's length, less the margin."""
        ranked: dict[Lane, list[Lease]] = defaultdict(list)
        held: dict[Lane, int] = defaultdict(int)
        shares: dict[Lane, int] = {}
        for row in rows:
            if (lease := Lease.of(row)) is not None:
                ranked[lease.lane].append(lease)
                held[lease.lane] += row.slots + row.draining
                if row.share is not None:
                    shares[lease.lane] = row.share
        # Scarce: SQL's share is less than this gateway needed (a lane exactly full of one gateway's
        # requests is not short of anything another gateway wants; a lane idle after a burst, needing
        # nothing, holds only spares).
        self._at_share = {
            lane for lane, share in shares.items() if held[lane] >= share and share < self._needs.get(lane, 0)
        }
        for leases in ranked.values():
            leases.sort(key=lambda lease: lease.rank)
        self._returned = [(key, at) for key, at in self._returned if at > sent_at]
        for key, _ in self._returned:  # sent before SQL took the slot: perhaps still counted there
            ranked = _shrunk(ranked, key)
        self.lease_s = lease_s
        self._failed = {node: at for node, at in self._failed.items() if at >= sent_at}
        self._ranked = dict(ranked)
        self._drains = {lane for lane, leases in ranked.items() if any(lease.draining for lease in leases)}
        self._usable_until = sent_at + lease_s - MARGIN_S
        self._promised = None  # the report's answer is here: the leases it returned are what holds
        self._moved_idle.clear()  # in those leases now, as they are

    def holds(self, lane: Lane) -> bool:
        return self.clock() < self._usable_until and bool(self._ranked.get(lane))

    def leases(self, lane: Lane) -> bool:
        """Whether this gateway holds a slot of the lane (not only its fallbacks, which have none)."""
        return self.holds(lane) and any(lease.slots > 0 for lease in self._ranked[lane])

    def at_share(self, lane: Lane) -> bool:
        """The lane is scarce (SQL's share for this gateway is less than it needed) and this
        gateway holds its share, or more (the rest drains): its requests wait for its own slots
        rather than claim free ones in SQL, where the gateway nearest the database would win every
        slot the others' shares free. Otherwise a request that finds no free leased slot is placed
        in SQL (below its share the next renewal would claim it anyway; with no scarcity nobody
        else wants it)."""
        return lane in self._at_share and self.holds(lane)


def _serves(lease: Lease, route: str | None, max_rate: float | None) -> bool:
    """Whether the lease's node serves `route` (None: any) within the price cap `max_rate`: hard
    filters, which leave SQL's order as it is."""
    if route is not None and route not in lease.routes:
        return False
    return max_rate is None or (lease.hourly_rate is not None and lease.hourly_rate <= max_rate)


def _shrunk(ranked: dict[Lane, list[Lease]], key: tuple[Lane, UUID]) -> dict[Lane, list[Lease]]:
    """The leases, the one of `key` (lane, node) a slot smaller."""
    lane, node = key
    if lane not in ranked:
        return ranked
    leases = [
        replace(lease, slots=max(lease.slots - 1, 0)) if lease.node_id == node else lease
        for lease in ranked[lane]
    ]
    return {**ranked, lane: leases}
