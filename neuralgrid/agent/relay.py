"""The agent's HTTP/1.1 client for the gateway's requests to its server (Backend.relay): kept-alive
connections, a C parser, and an answer's body passed on as it comes."""

from __future__ import annotations

import asyncio
import re
import ssl
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import cast

import httptools

JSON = "application/json"
_JSON_TYPE = b"Content-Type: application/json\r\n"
_HEADER_VALUE = re.compile(r"[\x20-\x7e]{1,256}")


def _content_type(value: str) -> bytes:
    """The Content-Type header line; ValueError for a value no header may hold (a line break)."""
    if value == JSON:
        return _JSON_TYPE
    if not _HEADER_VALUE.fullmatch(value):
        raise ValueError(f"not a content type: {value[:80]!r}")
    return b"Content-Type: " + value.encode("ascii") + b"\r\n"


class RelayError(Exception):
    """The server broke an answer off: closed the connection, wrote what is not HTTP, fell silent."""


class _Dropped(RelayError):
    """The connection closed before the first byte of an answer."""


class Relay:
    """POSTs to one server over kept-alive HTTP/1.1 connections; an answer's body is passed on as
    it comes (chunked transfer decoded, nothing else touched).

    Written on asyncio and httptools (the C parser uvicorn serves with, in the agent's install)
    rather than httpx, whose layers cost about 1 ms of CPU a request: most of what the agent's hop
    added. Timeouts as the agent's own client: 5 s to connect, 600 s between bytes."""

    HIGH_WATER = 1 << 18  # bytes held for a slow reader before the server is asked to wait

    def __init__(
        self, url: str, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0, keepalive_s: float = 4
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.ssl else 80)
        self.base = parts.path.rstrip("/")
        self.host_header = b"Host: " + parts.netloc.rpartition("@")[2].encode("idna") + b"\r\n"
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        # Idle connections are let go before the 5 s after which uvicorn (vLLM, SGLang) and
        # llama.cpp's server close theirs, so that few close under a request going out.
        self.keepalive_s = keepalive_s
        self.idle: deque[tuple[_Connection, float]] = deque()  # the most recently used last
        self.connections: set[_Connection] = set()
        self._lines: dict[str, bytes] = {}

    async def post(self, path: str, body: bytes, content_type: str = JSON) -> RelayResponse:
        """The server's answer once its status and headers are in. OSError when it cannot be
        reached, RelayError when it does not answer. `content_type`: the body's, passed on as the
        gateway gave it (a multipart upload's names its boundary)."""
        head = self._line(path) + _content_type(content_type) + b"Content-Length: %d\r\n\r\n" % len(body)
        conn = self._take()
        if conn is not None:
            try:
                return await conn.request(head + body)
            except _Dropped:
                # A server may close a kept-alive connection just as a request goes out on it
                # (llama.cpp's does after some streams): it never read the request, so it is sent
                # once more, on a new connection. A new connection that drops one is an error.
                pass
        conn = await self._connect()
        return await conn.request(head + body)

    def close(self) -> None:
        for conn in list(self.connections):
            conn.abort()
        self.idle.clear()

    def _line(self, path: str) -> bytes:
        line = self._lines.get(path)
        if line is None:
            if len(self._lines) > 64:  # paths come from the gateway: a handful
                self._lines.clear()
            target = urllib.parse.quote(self.base + path, safe="/:@!$&'()*+,;=-._~%").encode()
            line = self._lines[path] = b"POST " + target + b" HTTP/1.1\r\n" + self.host_header
        return line

    def _take(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self.idle:
            conn, since = self.idle.pop()
            if conn.open() and now - since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    def _give_back(self, conn: _Connection) -> None:
        now = asyncio.get_running_loop().time()
        self.idle.append((conn, now))
        while self.idle and not (self.idle[0][0].open() and now - self.idle[0][1] < self.keepalive_s):
            self.idle.popleft()[0].abort()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                lambda: _Connection(self, loop), self.host, self.port, ssl=self.ssl
            )
        return conn


class RelayResponse:
    """One answer: status, content type, length (None: not known ahead), and the body's chunks
    (async iteration, as they arrive). release() once done with it, read whole or not."""

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.content_type = conn.content_type
        self.length = conn.length

    def __aiter__(self) -> RelayResponse:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        while not conn.buffer:
            if conn.complete:
                raise StopAsyncIteration
            if conn.error is not None:
                raise RelayError(*conn.error.args)
            await conn.wait()
        return conn.take()

    def finished(self) -> bool:
        """Whole and read: no chunk follows the last one taken."""
        return self._conn is None or (self._conn.complete and not self._conn.buffer)

    def abort(self, why: str) -> None:
        """Break the answer off now: the server sees its connection close, a reader gets RelayError."""
        if self._conn is not None:
            self._conn.fail(RelayError(why))
            self._conn.abort()

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()


class _Connection(asyncio.Protocol):
    """One connection to the server, parsing its answers as they come (httptools calls the on_*)."""

    def __init__(self, relay: Relay, loop: asyncio.AbstractEventLoop) -> None:
        self.relay, self.loop = relay, loop
        self.transport: asyncio.Transport | None = None
        self.buffer: list[bytes] = []  # the body's pieces not read yet
        # The parser hands each piece of body straight to the list: no Python call per piece
        # (a stream's every event is one).
        self.on_body: Callable[[bytes], None] = self.buffer.append
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False  # a request is out on it
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = b"application/json"
        self.length: int | None = None
        self.framed = False  # its end is marked (a length or chunks), not the connection's close
        self.head = self.complete = self.received = self.informational = False
        self.keep_alive = False
        self.error: RelayError | None = None
        self.buffer.clear()
        self.size = 0  # bytes received since the reader last took some (a watermark)
        self.last = self.loop.time()

    # Requests ---------------------------------------------------------------------------------

    def open(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    async def request(self, data: bytes) -> RelayResponse:
        assert self.transport is not None
        self._reset()
        self.busy = True
        self.timer = self.loop.call_at(self.last + self.relay.read_timeout_s, self._check_silence)
        self.transport.write(data)
        try:
            while not self.head:
                if self.error is not None:
                    raise self.error
                await self.wait()
        except BaseException:  # cancelled too: the server sees the request go away
            self.abort()
            raise
        return RelayResponse(self)

    async def wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take(self) -> bytes:
        data = self.buffer[0] if len(self.buffer) == 1 else b"".join(self.buffer)
        self.buffer.clear()
        self.size = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def finish(self) -> None:
        """The request is over: the connection goes back to the pool if its answer ended cleanly."""
        self.busy = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.buffer.clear()
        if self.complete and self.keep_alive and self.error is None and self.open():
            if self.paused and self.transport is not None:
                self.paused = False
                self.transport.resume_reading()
            self.relay._give_back(self)
        else:
            self.abort()

    def fail(self, error: RelayError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self._wake()

    def abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _check_silence(self) -> None:
        self.timer = None
        if not self.busy or self.complete or self.error is not None:
            return
        now, due = self.loop.time(), self.last + self.relay.read_timeout_s
        if self.paused:  # the reader is slow, not the server
            self.timer = self.loop.call_at(now + self.relay.read_timeout_s, self._check_silence)
            return
        if now < due:
            self.timer = self.loop.call_at(due, self._check_silence)
            return
        self.fail(RelayError(f"the server sent nothing for {self.relay.read_timeout_s:g} s"))
        self.abort()

    # asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without the class
        self.relay.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes no request asked for: this connection cannot be trusted again
            self.abort()
            return
        self.received = True
        self.last = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self.fail(RelayError(f"the server's answer is not HTTP: {err}"))
            self.abort()
            return
        if self.buffer:
            self.size += len(data)
            if self.size > Relay.HIGH_WATER and not self.paused and self.transport is not None:
                self.paused = True  # the reader is slow: let the server wait rather than hold it all
                self.transport.pause_reading()
            self._wake()

    def eof_received(self) -> bool | None:
        return None  # close: HTTP/1.1 has no half-closed connections worth keeping

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.relay.connections.discard(self)
        if self.busy and not self.complete:
            if self.head and not self.framed:  # an answer that ends with its connection
                self.complete = True
            else:
                why = f" ({exc})" if exc else ""
                if not self.received:
                    self.fail(_Dropped(f"the server closed the connection without answering{why}"))
                else:
                    self.fail(RelayError(f"the server closed the connection mid-answer{why}"))
        self._wake()

    # httptools ---------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value
        elif name == b"content-length":
            self.length = int(value)  # the parser has checked it is digits
        elif name == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the answer is still to come
            self.informational = True
            self.content_type, self.length, self.framed = b"application/json", None, False
            return
        self.status = status
        self.head = True
        self.framed = self.framed or self.length is not None
        self._wake()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._wake()
