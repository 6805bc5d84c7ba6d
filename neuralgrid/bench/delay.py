"""A TCP proxy that delays every byte by a fixed time each way: a long link on loopback.

This machine's kernel has no netem, so `bench world` puts one of these between each far gateway and
Postgres. Each direction of each connection is a FIFO of (deadline, chunk): a chunk read at t is
written at t + RTT/2, whatever else is in flight, so the bytes keep their order, a burst keeps its
throughput (reading never waits for the delay), and round trips on many connections, or pipelined
on one, overlap as they would on a real link. A half-close is passed on after the bytes before it,
as a link passes a FIN; a reset closes both sides. Not delayed: the TCP handshake (the client's
connect is answered here at once; its first bytes then wait RTT/2 as all bytes do), so a new
connection costs one RTT less than over a real link; pools keep their connections open.

Run as `python -m neuralgrid.bench.delay --link LISTEN_PORT:HOST:PORT:RTT_MS ...`: one process, one
listener per link, on 127.0.0.1; it prints `ready` once every listener is bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from neuralgrid.server.serving import run_fast

CHUNK = 65_536
QUEUED_CHUNKS = 1_024  # per direction (64 MiB at most): past it, reading waits for the writer


@dataclass
class DelayProxy:
    """Listens on `host:port` (0: any free port, `port` then says which) and forwards each
    connection to `target_host:target_port`, each direction delayed by `rtt_s / 2`."""

    target_host: str
    target_port: int
    rtt_s: float
    host: str = "127.0.0.1"
    port: int = 0
    connections: int = 0  # accepted so far
    # Round trips so far: a client's bytes that follow bytes from the server (or open a connection),
    # each a wait of one RTT for the client that sent them.
    round_trips: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> DelayProxy:
        return await self.start()

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                target_r, target_w = await asyncio.open_connection(self.target_host, self.target_port)
            except OSError:
                client_w.close()
                return
            turn = _Turn(self)
            await _link(client_r, client_w, target_r, target_w, self.rtt_s / 2, turn)
        finally:
            self._tasks.discard(task)


@dataclass
class _Turn:
    """Which side of one connection spoke last: a client speaking after the server is a round trip."""

    proxy: DelayProxy
    client_spoke: bool = False

    def spoke(self, client: bool) -> None:
        if client and not self.client_spoke:
            self.proxy.round_trips += 1
        self.client_spoke = client


async def _link(
    a_r: asyncio.StreamReader,
    a_w: asyncio.StreamWriter,
    b_r: asyncio.StreamReader,
    b_w: asyncio.StreamWriter,
    delay_s: float,
    turn: _Turn,
) -> None:
    """Both directions until each has ended (half-closes passed on), or either fails (both closed):
    a, the client, to b and b to a."""
    directions = [
        asyncio.ensure_future(_direction(a_r, b_w, delay_s, lambda: turn.spoke(True))),
        asyncio.ensure_future(_direction(b_r, a_w, delay_s, lambda: turn.spoke(False))),
    ]
    try:
        done, _ = await asyncio.wait(directions, return_when=asyncio.FIRST_EXCEPTION)
        if any(not task.cancelled() and task.exception() is not None for task in done):
            for task in directions:
                task.cancel()
            await asyncio.gather(*directions, return_exceptions=True)
    finally:
        for task in directions:
            task.cancel()
        for writer in (a_w, b_w):
            writer.close()
        for writer in (a_w, b_w):
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()


async def _direction(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay_s: float,
    read: Callable[[], None],
) -> None:
    """Reads chunks as they come (`read()` after each) and writes each `delay_s` after it was read,
    in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED_CHUNKS)

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:  # the sender's half-close, after the bytes before it
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()

    delivering = asyncio.ensure_future(deliver())
    try:
        while True:
            chunk = await reader.read(CHUNK)
            if chunk:
                read()
            await queue.put((loop.time() + delay_s, chunk))
            if not chunk:
                break
        await delivering
    finally:
        delivering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await delivering


@dataclass(frozen=True)
class Link:
    listen_port: int
    target_host: str
    target_port: int
    rtt_ms: float

    @classmethod
    def parse(cls, text: str) -> Link:
        """LISTEN_PORT:HOST:PORT:RTT_MS"""
        listen, host, port, rtt = text.rsplit(":", 3)
        return cls(int(listen), host, int(port), float(rtt))

    def arg(self) -> str:
        return f"{self.listen_port}:{self.target_host}:{self.target_port}:{self.rtt_ms:g}"


async def serve(links: Sequence[Link]) -> None:
    proxies = [
        await DelayProxy(
            link.target_host, link.target_port, link.rtt_ms / 1000, port=link.listen_port
        ).start()
        for link in links
    ]
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for proxy in proxies:
            await proxy.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--link", action="append", required=True, type=Link.parse, help="LISTEN_PORT:HOST:PORT:RTT_MS"
    )
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        run_fast(serve(args.link))


if __name__ == "__main__":
    main()
