"""The waiting room alone (no database): who asks the matcher, and when."""

from __future__ import annotations

import asyncio
import math
import uuid

import pytest

from neuralgrid.gateway.waiting import ClientLeft, WaitingRoom


def test_a_client_that_hangs_up_while_its_turn_is_placed_is_not_served() -> None:
    """Found in review: a hang-up during the head's ask (a place_jobs() round trip) was seen only
    at the next turn, so the job placed meanwhile was sent and charged for a client that had gone.
    The ask is cancelled (Claims lets go of a job placed as its caller is cancelled)."""
    asked: list[str] = []

    async def run() -> object:
        room = WaitingRoom(max_waiting=8, poll_s=0.05)
        hung_up = asyncio.Event()

        async def gone() -> None:
            await hung_up.wait()

        async def ask() -> str:
            hung_up.set()  # the client leaves while the matcher places it
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                asked.append("cancelled")
                raise
            return "a job on a node"

        loop = asyncio.get_running_loop()
        return await room.wait("m", uuid.uuid4(), loop.time() + 1, ask, seen=-1, gone=gone)

    with pytest.raises(ClientLeft):
        asyncio.run(run())
    assert asked == ["cancelled"]


def test_a_request_asks_unless_one_ahead_of_it_could_take_any_node_it_could() -> None:
    """Requests differ in the nodes they may take (a price cap): a request capped lower than one
    ahead of it waits behind it; one that may take more asks too."""

    async def run() -> list[str]:
        room = WaitingRoom(max_waiting=8, poll_s=5)
        free = {"cheap": 0, "pricey": 1}  # the cheap node is busy, a pricey one has a slot
        order: list[str] = []
        loop = asyncio.get_running_loop()

        def request(name: str, reach: float) -> asyncio.Task[str | None]:
            async def ask() -> str | None:
                for node in ("cheap", "pricey"):
                    if free[node] and (node == "cheap" or reach > 1):
                        free[node] -= 1
                        order.append(name)
                        return node
                return None

            assert room.blocked("m", reach) == (name == "also capped")  # behind "capped"
            return asyncio.create_task(
                room.wait("m", uuid.uuid4(), loop.time() + 5, ask, room.announcements, reach=reach)
            )

        capped = request("capped", 0.5)  # at the head: only the cheap node, busy
        await asyncio.sleep(0.01)
        behind = request("also capped", 0.4)  # waits behind it
        anyone = request("uncapped", math.inf)  # may take the pricey node: asks at once
        await asyncio.sleep(0.01)
        room.slot_freed()
        await asyncio.sleep(0.01)
        assert order == ["uncapped"] and anyone.done() and not capped.done()
        free["cheap"] = 1
        room.slot_freed()
        await asyncio.sleep(0.01)
        assert order == ["uncapped", "capped"] and not behind.done()  # the cheap node taken again
        behind.cancel()
        return order

    assert asyncio.run(run()) == ["uncapped", "capped"]


def test_a_head_asking_postgres_does_not_keep_the_line_from_a_slot_freed_meanwhile() -> None:
    """Found in bench chaos: the gateway 200 ms from Postgres held 6 leased slots and used 4.3, its
    18 callers waiting. Its head asked Postgres for a slot (below its share: a round trip), and a
    leased slot freed here meanwhile woke nobody: the head was busy asking, and it alone could ask.
    A head whose ask is under way is passed over, so the next request takes that slot at once."""

    async def run() -> list[tuple[str, float]]:
        room = WaitingRoom(max_waiting=8, poll_s=5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        free_here = 0  # leased slots free on this gateway
        served: list[tuple[str, float]] = []

        def request(name: str) -> asyncio.Task[str | None]:
            async def ask() -> str | None:
                nonlocal free_here
                if free_here:  # a leased slot: no round trip
                    free_here -= 1
                    served.append((name, round(loop.time() - started, 1)))
                    return "leased"
                await asyncio.sleep(0.3)  # Postgres, far away: no slot free there either
                return None

            return asyncio.ensure_future(room.wait("m", uuid.uuid4(), loop.time() + 2, ask, seen=0))

        first, second = request("first"), request("second")
        await asyncio.sleep(0)
        room.slot_freed()  # the first asks Postgres...
        await asyncio.sleep(0.1)
        free_here = 1  # ...and a request here ends
        room.slot_freed()
        await asyncio.sleep(0.05)
        assert served == [("second", 0.1)]  # not after the first's round trip (0.3 s)
        free_here = 1
        room.slot_freed()
        await asyncio.gather(first, second)
        return served

    assert [name for name, _ in asyncio.run(run())] == ["second", "first"]


def test_a_request_no_leased_slot_could_take_asks_in_its_turn_and_holds_nobody_back() -> None:
    """A request of a key whose escrow here is short takes no leased slot itself: only SQL may give
    it one (the slot freed for it, lent). When SQL passes the lent slot over, it must not keep the
    requests behind it from the slots leases free (at the head of the model's line, as one, it
    kept them all). It asks in its turn (first, here), the request behind it asks too, and of such
    requests one at a time asks (no herd of round trips)."""

    async def run() -> list[str]:
        room = WaitingRoom(max_waiting=8, poll_s=5)
        loop = asyncio.get_running_loop()
        free_here = 0
        asked: list[str] = []

        def request(name: str, apart: bool) -> asyncio.Task[str | None]:
            async def ask() -> str | None:
                nonlocal free_here
                asked.append(name)
                if apart:  # SQL, lent the slot, passes it over (the node's VRAM, say)
                    await asyncio.sleep(0.01)
                    return None
                if free_here:
                    free_here -= 1
                    return "leased"
                return None

            wait = room.wait("m", uuid.uuid4(), loop.time() + 1, ask, seen=0, apart=apart)
            return asyncio.ensure_future(wait)

        short, others, more = request("short", True), request("other", False), request("more short", True)
        await asyncio.sleep(0)
        assert [ticket.apart for ticket in room.lines["m"].heads()] == [True, False]
        assert room.blocked("m")  # by the one that takes leased slots
        free_here = 1
        room.slot_freed()
        assert await others == "leased"
        short.cancel()
        more.cancel()
        await asyncio.gather(short, more, return_exceptions=True)
        return asked

    assert asyncio.run(run()) == ["short", "other"]
