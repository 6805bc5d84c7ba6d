"""Requests waiting for a slot: a line per model, fair across keys, bounded, each with a deadline.

The matcher still chooses in SQL: a waiting request only decides *when* to ask again. It asks when
it is at the head of its model's line and a slot may have freed: Postgres announced one (LISTEN
neuralgrid_slots, from any gateway), or the request before it was just served (there may be more),
or, as a backstop for a lost announcement or a cooldown that ran out, `poll_s` passed. A request
that gets a node wakes the next one; one that does not stays at the head and waits again.

Fair across keys: the head is the oldest request of the key served longest ago (round robin over
keys), so a key that floods a model's line delays its own requests, not everyone's. A request whose
client hangs up leaves the line at once: nobody would read its answer, and it would still be charged.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
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
    turn: asyncio.Event = field(default_factory=asyncio.Event)


class _Line:
    """One model's waiting requests: a queue per key, keys in the order they are served in."""

    def __init__(self) -> None:
        self.by_key: dict[UUID, deque[_Ticket]] = {}  # insertion order: the next key first
        self.size = 0

    def head(self) -> _Ticket | None:
        for tickets in self.by_key.values():
            return tickets[0]
        return None

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

    def wake_head(self) -> None:
        if (head := self.head()) is not None:
            head.turn.set()


class WaitingRoom:
    def __init__(self, max_waiting: int, poll_s: float = 1.0) -> None:
        self.max_waiting = max_waiting  # per model
        self.poll_s = poll_s
        self.lines: dict[str, _Line] = {}
        self.announcements = 0  # slots announced so far: a request can tell it missed one

    def waiting(self, model: str) -> int:
        line = self.lines.get(model)
        return line.size if line else 0

    def slot_freed(self, _payload: str = "") -> None:
        """A slot may be free somewhere: each model's first request asks the matcher again."""
        self.announcements += 1
        for line in self.lines.values():
            line.wake_head()

    async def wait(
        self,
        model: str,
        key_id: UUID,
        deadline: float,
        ask: Callable[[], Awaitable[T | None]],
        seen: int,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> T | None:
        """Wait in the model's line, asking `ask()` for a node each time it is this request's turn,
        until it answers (then the next request's turn comes at once) or the loop's clock passes
        `deadline` (None). `seen`: `announcements` when the caller last asked, so that a slot freed
        since then is not missed. `gone()` returns when the client hangs up (ClientLeft then: a
        request nobody waits for is not served later). LineFull when the line is full."""
        line = self.lines.setdefault(model, _Line())
        if line.size >= self.max_waiting:
            raise LineFull(f"{line.size} requests waiting")
        loop = asyncio.get_running_loop()
        ticket = _Ticket(key_id)
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
                if line.head() is not ticket:
                    continue
                answer = await ask()
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
                line.wake_head()


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
