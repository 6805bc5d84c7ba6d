"""Run ASGI apps with uvicorn: as a task in an event loop, or in a thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

import uvicorn

T = TypeVar("T")


def run_fast(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop where installed (uvicorn[standard] brings it): its transports write
    in C, which is most of what Realtime's fan-out does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Server(uvicorn.Server):
    """uvicorn's server without its signal handling: callers decide what a signal means (uvicorn's
    own re-raises the signal after shutdown, which would skip our cleanup)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_server(app: Any, host: str, port: int, **options: Any) -> Server:
    # Realtime fans small messages out to many sockets: frames built once and written straight to
    # each (see realtime/fastpath.py), and no permessage-deflate, whose per-socket compression
    # would cost more than it saves.
    from neuralgrid.realtime.fastpath import FanoutWebSocketProtocol

    options = {"ws": FanoutWebSocketProtocol, "ws_per_message_deflate": False, **options}
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", **options)
    return Server(config)


class CannotListen(OSError):
    """A server that did not start (its port taken, its address not ours)."""


@contextlib.asynccontextmanager
async def running(server: Server) -> AsyncIterator[None]:
    """Serve on this event loop while the block runs, then shut down as a signal would (cancelling
    uvicorn's task instead logs a traceback from the app's lifespan)."""
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            raise CannotListen(f"cannot listen on {server.config.host}:{server.config.port}")
        await asyncio.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        await serving


class ThreadedServer:
    """An app served on a loopback port from a background thread; a context manager."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.app = app
        self.host = host
        self.port = port or free_port(host)
        self.server = make_server(app, self.host, self.port)
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    def start(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
