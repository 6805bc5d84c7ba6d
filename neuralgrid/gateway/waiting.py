"""Requests waiting for a slot: a line per model, fair across keys, bounded, each with a deadline.

The matcher still chooses in SQL: a waiting request only decides *when* to ask again. It asks when
it is at the head of its model's line and a slot may have freed: Postgres announced one (LISTEN
neuralgrid_slots, from any gateway), or the request before it was just served (there may be more),
or, as a backstop for a lost announcement or a cooldown that ran out, `poll_s` passed. A request
that gets a node wakes the next one; one that does not stays at the head and waits again.

Requests for a model may differ in the nodes they may take: each has a `reach`, the most it pays
per hour (x-neuralgrid-max-price; infinite without). A head that found no node free within its
reach says nothing of a request behind it that reaches further, so the line has a head for each
reach: a request asks unless one served before it reaches at least as far. Without price caps
(most requests) that is the one head.

Fair across keys: the head is the oldest request of the key served longest ago (round robin over
keys), so a key that floods a model's line delays its own requests, not everyone's. A request whose
client hangs up leaves the line at once: nobody would read its answer, and it would still be charged.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar
from uuid import UUID

T = TypeVar("T")


class LineFull(Exception):
    """The model's line already holds as many requests as it may."""


class ClientLeft(Exception):
    """The client hung up while its request waited: it left the line, and is never served."""


@dataclass(eq=False)
class _Ticket:
    key_id: UUID
    reach: float  # the most it pays per hour for a node
    apart: bool = False  # it takes no slot a lease frees here itself: it holds none behind it back
    turn: asyncio.Event = field(default_factory=asyncio.Event)


class _Line:
    """One model's waiting requests: a queue per key, keys in the order they are served in."""

    def __init__(self) -> None:
        self.by_key: dict[UUID, deque[_Ticket]] = {}  # insertion order: the next key first
        self.size = 0
        self.asking: set[_Ticket] = set()  # those whose ask is under way

    def heads(self) -> Iterator[_Ticket]:
        """The requests that ask when a slot frees: in the order they are served in (each key's
        first, then each key's second, …), those that reach further than all before them. One
        whose ask is under way is passed over: a far gateway's head asking Postgres (a round trip)
        would otherwise keep the line from a leased slot freed here meanwhile. So is one `apart`,
        but for the first: it asks in its turn (lending SQL the slot freed for it), and those
        behind it ask too (one of a key whose escrow is short kept them from the slots leases free
        whenever SQL would not give it the one it lent)."""
        queues = list(self.by_key.values())
        furthest = -math.inf
        apart = False
        for i in range(max(map(len, queues), default=0)):
            for tickets in queues:
                if i >= len(tickets) or tickets[i] in self.asking or tickets[i].reach <= furthest:
                    continue
                if tickets[i].apart:
                    if not apart:
                        yield tickets[i]
                    apart = True
                    continue
                yield tickets[i]
                furthest = tickets[i].reach
                if furthest == math.inf:
                    return

    def blocked(self, reach: float) -> bool:
        """Whether a request of this reach would wait behind one already here."""
        return any(ticket.reach >= reach and not ticket.apart for ticket in self.heads())

    def join(self, ticket: _Ticket) -> None:
        self.by_key.setdefault(ticket.key_id, deque()).append(ticket)
        self.size += 1

    def leave(self, ticket: _Ticket, served: bool) -> None:
        """Served: the key's next request goes to the back of the round. Gave up: the key keeps its
        place."""
        tickets = self.by_key[ticket.key_id]
        tickets.remove(ticket)
        self.size -= 1
        if not tickets or served:
            del self.by_key[ticket.key_id]
        if tickets and served:
            self.by_key[ticket.key_id] = tickets

    def wake_heads(self) -> None:
        """The heads ask; and those asking now ask again once their ask is over, in case what freed
        is theirs to take (no head but them, say)."""
        for ticket in [*self.heads(), *self.asking]:
            ticket.turn.set()


class WaitingRoom:
    def __init__(self, max_waiting: int, poll_s: float = 1.0) -> None:
        self.max_waiting = max_waiting  # per model
        self.poll_s = poll_s
        self.lines: dict[str, _Line] = {}
        self.announcements = 0  # slots announced so far: a request can tell it missed one

    def blocked(self, model: str, reach: float = math.inf) -> bool:
        """Whether a request of this reach would wait behind one in the model's line (if not, it
        asks the matcher at once)."""
        line = self.lines.get(model)
        return line is not None and line.blocked(reach)

    def waiting(self) -> dict[str, int]:
        """Requests waiting now, per model (a line of a route's own, "MODEL /v1/ROUTE", counts for
        its model): what each check-in reports, for the sweep to count toward the VRAM pressure."""
        out: dict[str, int] = {}
        for name, line in self.lines.items():
            model = name.split(" /v1/", 1)[0]
            out[model] = out.get(model, 0) + line.size
        return out

    def slot_freed(self, _payload: str = "") -> None:
        """A slot may be free somewhere: each model's heads ask the matcher again."""
        self.announcements += 1
        for line in self.lines.values():
            line.wake_heads()

    async def wait(
        self,
        model: str,
        key_id: UUID,
        deadline: float,
        ask: Callable[[], Awaitable[T | None]],
        seen: int,
        gone: Callable[[], Awaitable[object]] | None = None,
        reach: float = math.inf,
        apart: bool = False,
    ) -> T | None:
        """Wait in the model's line, asking `ask()` for a node each time it is this request's turn,
        until it answers (then the next request's turn comes at once) or the loop's clock passes
        `deadline` (None). `seen`: `announcements` when the caller last asked, so that a slot freed
        since then is not missed. `gone()` returns when the client hangs up (ClientLeft then, and
        an ask under way is cancelled: a request nobody waits for is not served later). `reach`:
        the most the request pays per hour; `apart`: it takes no slot a lease frees here itself
        (it holds nobody behind it back: _Line.heads()). LineFull when the line is full."""
        line = self.lines.get(model)
        if line is not None and line.size >= self.max_waiting:
            raise LineFull(f"{line.size} requests waiting")
        line = self.lines.setdefault(model, _Line())
        loop = asyncio.get_running_loop()
        ticket = _Ticket(key_id, reach, apart)
        line.join(ticket)
        served = False
        if self.announcements != seen:
            ticket.turn.set()
        hung_up = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            while (left := deadline - loop.time()) > 0:
                if not await _turn(ticket, min(left, self.poll_s), hung_up) and left <= self.poll_s:
                    return None
                ticket.turn.clear()
                if ticket not in line.heads():
                    continue
                line.asking.add(ticket)
                try:
                    answer = await _unless_gone(ask(), hung_up)
                finally:
                    line.asking.discard(ticket)
                if answer is not None:
                    served = True
                    return answer
            return None
        finally:
            if hung_up is not None:
                hung_up.cancel()
            line.leave(ticket, served)
            if line.size == 0:
                self.lines.pop(model, None)
            else:  # served: a slot may be left for the next; gave up: the turn passes on
                line.wake_heads()


async def _unless_gone(asking: Awaitable[T], hung_up: asyncio.Future[Any] | None) -> T:
    """The ask's answer; ClientLeft if the client hangs up first, the ask cancelled (a job placed
    meanwhile is let go by whoever placed it)."""
    if hung_up is None:
        return await asking
    task = asyncio.ensure_future(asking)
    try:
        await asyncio.wait({task, hung_up}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.done():
        task.cancel()
        await asyncio.wait({task})  # until it has let go of what it placed
    if task.cancelled():
        raise ClientLeft()
    return task.result()  # answered as the client left: served like any other (or its error)


async def _turn(ticket: _Ticket, timeout_s: float, hung_up: asyncio.Future[Any] | None) -> bool:
    """Whether the ticket's turn came within timeout_s; ClientLeft if its client hung up first."""
    turn: asyncio.Future[Any] = asyncio.ensure_future(ticket.turn.wait())
    try:
        await asyncio.wait(
            {turn} if hung_up is None else {turn, hung_up},
            timeout=timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        turn.cancel()
    if hung_up is not None and hung_up.done():
        raise ClientLeft()
    return ticket.turn.is_set()
