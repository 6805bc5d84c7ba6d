"""Our uvicorn server at rest: it sleeps until there is work, and stops as soon as it is told."""

from __future__ import annotations

import asyncio
import time

import httpx

from neuralgrid.server.serving import Server, ThreadedServer, make_server, running


async def _hello(scope: dict[str, object], receive: object, send: object) -> None:
    """The smallest ASGI app: 200 with a body (lifespan events accepted and ignored)."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"hello"})  # type: ignore[operator]
    elif scope["type"] == "lifespan":
        while True:
            message = await receive()  # type: ignore[operator]
            kind = message["type"]
            await send({"type": f"{kind}.complete"})  # type: ignore[operator]
            if kind == "lifespan.shutdown":
                return


class CountingServer(Server):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


def test_an_idle_server_wakes_about_once_a_second() -> None:
    # uvicorn's own loop wakes ten times a second to look for a stop: on a node agent (or several
    # on one machine) that was the CPU an idle process spent.
    async def idle_for(seconds: float) -> int:
        base = make_server(_hello, "127.0.0.1", 0)
        server = CountingServer(base.config)
        async with running(server):
            before = server.ticks
            await asyncio.sleep(seconds)
            return server.ticks - before

    assert asyncio.run(idle_for(2.0)) <= 3


def test_a_server_stops_at_once_when_told_from_another_thread() -> None:
    with ThreadedServer(_hello) as server:
        assert httpx.get(server.url).text == "hello"
        time.sleep(0.3)  # asleep between ticks
        told = time.monotonic()
        server.stop()
        assert not server.thread.is_alive()
    assert time.monotonic() - told < 0.5
