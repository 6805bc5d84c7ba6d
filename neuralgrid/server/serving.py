"""Run ASGI apps with uvicorn: as a task in an event loop, or in a thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

import uvicorn
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

log = logging.getLogger(__name__)

T = TypeVar("T")

# A client gets this long, from connecting (or starting its next request), to send a request's
# headers. uvicorn has no such limit: a socket that sends nothing, or a byte now and then, is held
# for ever (a slowloris). Bodies have their own deadline, in the app (gateway.body.read_json).
HEADER_TIMEOUT_S = 10.0
# The most a request's line and headers may hold. uvicorn (and llhttp under it) keeps every header a
# client sends: a slow trickle of tiny ones inside the deadline grew a gateway by 25 bytes of memory
# for each byte sent (1 GiB for 40 MiB, from one anonymous connection). Larger ones are answered 431.
MAX_HEADER_BYTES = 64 << 10


class Abort(Exception):
    """Raised by an app to cut off a response that has started (its source broke off mid-body):
    the connection closes, which is how HTTP says a body is not whole. Whoever raises it logs why,
    in a line; uvicorn's traceback for it, which would read as a bug, is left out."""


class _NoAbortTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], Abort))


_NO_ABORT_TRACEBACKS = _NoAbortTracebacks()


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"  # as uvicorn writes it


class HeadWithBody:
    """A connection's transport as its responses write to it: a response's head is held until its
    body's first bytes, and both leave in one write (one syscall, one TCP segment). uvicorn writes
    them apart, which cost the gateway a twentieth of its CPU per request under load, and its
    client a second read. A head whose body does not follow in the same turn of the event loop (a
    stream waiting for its node) leaves alone at the next."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.loop = loop
        self._head: bytes | None = None
        self._expecting = False

    def expect_head(self) -> None:
        """A response begins: its first write is its head."""
        self._expecting = True

    def write(self, data: bytes) -> None:
        if data == CONTINUE:  # before the head, asked for by the client: at once
            self.transport.write(data)
        elif self._expecting:
            self._expecting, self._head = False, data
            self.loop.call_soon(self.flush)
        elif self._head is not None:
            head, self._head = self._head, None
            self.transport.writelines((head, data))
        else:
            self.transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self.transport.write(head)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol, closing connections whose request headers are late, or too large,
    and writing each response's head with its body (HeadWithBody)."""

    header_timeout_s = HEADER_TIMEOUT_S
    _headers_due: asyncio.TimerHandle | None = None
    _header_bytes = 0  # bytes received since the last request's headers ended
    _reading_headers = True
    _completed = 0  # requests whose end the parser has read
    _too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._writes = HeadWithBody(transport, self.loop)
        self._expect_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._expect_headers()

    def data_received(self, data: bytes) -> None:
        # Counted as they arrive, not as the parser hands headers over: llhttp holds a header that
        # has not ended (one of 32 MiB, say) without calling back. A piece in which headers end
        # (with a body's start, often) or a request does (with a body's end) is not counted.
        completed = self._completed
        super().data_received(data)
        if self._reading_headers and self._completed == completed and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._too_large = True
                self.send_400_response("request headers too large")

    def send_400_response(self, msg: str) -> None:
        self._writes.flush()  # a response held for its body goes first
        if not self._too_large:
            return super().send_400_response(msg)
        if not self.transport.is_closing():
            body = b"request headers too large"
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._cancel_deadline()
        # The body is the app's to bound; the next request's headers (keep-alive) count afresh.
        self._reading_headers, self._header_bytes = False, 0
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:  # a request's cycle (an upgrade makes none)
            self.cycle.transport = self._writes  # type: ignore[assignment]

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        self._writes.expect_head()  # this cycle's response is the connection's next
        super()._start_asgi_task(cycle, app)

    def on_message_complete(self) -> None:
        self._reading_headers, self._completed = True, self._completed + 1
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _expect_headers(self) -> None:
        if self._headers_due is None:
            self._headers_due = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_deadline(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if not self.transport.is_closing():
            self.transport.close()


def run_fast(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop where installed (uvicorn[standard] brings it): its transports write
    in C, which is most of what Realtime's fan-out does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


# The cyclic collector's first generation runs after this many container objects are allocated (net).
# Python's 700 suits a script: a gateway allocates a few hundred per request, so it collected every
# two or three requests, an eighth of the gateway's CPU per request under load (bench gateway, 16
# callers, 2026-12-04). At 50,000 a young collection still takes well under a millisecond.
YOUNG_OBJECTS = 50_000


def tune_collector() -> None:
    """For a long-running server, once it is built: what exists now is kept out of every later
    collection (gc.freeze()), and young objects are collected YOUNG_OBJECTS at a time."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, older, oldest)


_handed_out: set[int] = set()
_handing_out = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server started after, never one this process handed out before: the
    kernel hands a port just let go out again (seven calls in a row named one twice about once in
    500, and `bench gateway` measured its bare relay as the gateway with leases off, whose own
    server could not bind the port)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with _handing_out:
            if port not in _handed_out:
                _handed_out.add(port)
                return port


class Server(uvicorn.Server):
    """uvicorn's server without its signal handling: callers decide what a signal means (uvicorn's
    own re-raises the signal after shutdown, which would skip our cleanup). It sleeps while idle:
    uvicorn's loop wakes ten times a second to see whether it should stop, about 2 ms of CPU a
    second for each idle process (a node agent, or sixteen of them on one machine in the gateway
    benchmark). This one ticks once a second (the Date header's resolution) and is woken when told
    to stop, from any thread."""

    _stopping = False
    _wake: asyncio.Event | None = None
    _wake_loop: asyncio.AbstractEventLoop | None = None

    @property
    def should_exit(self) -> bool:
        return self._stopping

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._stopping = value
        if value and self._wake is not None and self._wake_loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed: it has stopped already
                self._wake_loop.call_soon_threadsafe(self._wake.set)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        self._wake_loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0  # in uvicorn's tenths of a second: on_tick refreshes the Date header every 10
        while not await self.on_tick(counter):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            counter = (counter + 10) % 864000

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown without its fixed 0.1 s pause after asking the connections to close,
        waiting on them and on the requests still running in steps of 10 ms, not 100: a server with
        nothing open stops at once (a test's gateway spent most of its stop asleep). As uvicorn's:
        requests under way are answered, then the app's lifespan ends. Unlike it, no connection
        outlives the server (below, and _stop_accepting)."""
        await self._stop_accepting()
        for sock in sockets or []:
            sock.close()
        state, asked = self.server_state, set[Any]()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while True:
                    for connection in state.connections - asked:
                        asked.add(connection)
                        connection.shutdown()  # an idle one closes; a busy one after its answer
                    # Looked at after a pause: a connection accepted last is made a few turns later,
                    # when uvicorn has stopped looking (left open, its client hung until exit).
                    await asyncio.sleep(0.01)
                    if self.force_exit or not (state.connections or state.tasks):
                        break
                for server in self.servers:
                    await server.wait_closed()
        except TimeoutError:
            log.error(
                "cancelled %d request(s) still running when the graceful shutdown ran out", len(state.tasks)
            )
            for task in state.tasks:
                task.cancel(msg="the graceful shutdown ran out")
        if not self.force_exit:
            await self.lifespan.shutdown()
        for connection in list(state.connections):  # cut off, or made while the lifespan ended
            connection.transport.close()

    async def _stop_accepting(self) -> None:
        """Close the listening sockets once the connections they accepted are made. asyncio's own
        loop accepts a connection in one turn and makes its transport in the next; a server closed
        in between makes none (an assertion it swallows) and leaves the socket open, its client
        hanging until the garbage collector closes it (CPython 3.11). So that loop stops reading
        them first, and a turn passes. uvloop makes a connection as it accepts it."""
        loop = asyncio.get_running_loop()
        if isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop):
            for server in self.servers:
                for listening in server.sockets:
                    loop.remove_reader(listening)
            await asyncio.sleep(0)
        for server in self.servers:
            server.close()


# How long an idle connection stays open: past a node agent's (HEARTBEAT_KEEPALIVE_S in
# agent/run.py), which beats one heartbeat interval (5 s by default) after its last beat ended. At
# uvicorn's 5 s, four beats in five came on a new connection (bench heartbeats, 2026-12-06): a TCP
# handshake each, and a TLS one behind a terminator.
KEEPALIVE_S = 15.0


def make_server(
    app: Any, host: str, port: int, header_timeout_s: float = HEADER_TIMEOUT_S, **options: Any
) -> Server:
    # Realtime fans small messages out to many sockets: frames built once and written straight to
    # each (see realtime/fastpath.py), and no permessage-deflate, whose per-socket compression
    # would cost more than it saves.
    from neuralgrid.realtime.fastpath import FanoutWebSocketProtocol

    http = type("HttpProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
    logging.getLogger("uvicorn.error").addFilter(_NO_ABORT_TRACEBACKS)  # once: filters are a set
    options = {
        "http": http,
        "ws": FanoutWebSocketProtocol,
        "ws_per_message_deflate": False,
        "timeout_keep_alive": KEEPALIVE_S,
        **options,
    }
    # No access log: at log level warning it is never written, yet uvicorn would still format each
    # line's arguments (the client's address, the quoted path) for every request.
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on", **options
    )
    return Server(config)


class CannotListen(OSError):
    """A server that did not start (its port taken, its address not ours)."""


async def _serve(server: Server) -> None:
    # uvicorn exits the process (SystemExit) when it cannot bind: out of a task that escapes the
    # event loop with a traceback. Here it ends the task; running() says CannotListen.
    with contextlib.suppress(SystemExit):
        await server.serve()


@contextlib.asynccontextmanager
async def running(server: Server) -> AsyncIterator[None]:
    """Serve on this event loop while the block runs, then shut down as a signal would (cancelling
    uvicorn's task instead logs a traceback from the app's lifespan)."""
    serving = asyncio.create_task(_serve(server))
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

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None, **options: Any) -> None:
        self.app = app
        self.host = host
        self.port = port or free_port(host)
        self.server = make_server(app, self.host, self.port, **options)
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
