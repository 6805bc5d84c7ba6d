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
