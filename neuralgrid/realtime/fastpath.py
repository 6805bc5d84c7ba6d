"""Fan-out without per-socket framing: uvicorn's sans-io WebSocket protocol, plus an ASGI scope
extension through which the Realtime hub writes a frame it built once straight to each socket.

Through plain ASGI, every `websocket.send` costs ~10 us (message dicts, framing, a task switch);
1,000 subscribers x 100 changes/s is 100,000 sends a second, more than one core does. A server frame
is unmasked, so the same bytes are valid on every socket: the hub frames each message once and each
delivery is one transport.write(). Frames are always whole and written from the event loop, so they
never interleave with what uvicorn itself writes (the close handshake).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

EXTENSION = "neuralgrid.websocket.frames"
MAX_BUFFERED = 8 * 1024 * 1024  # a subscriber this far behind is disconnected, not waited for


class FrameWriter:
    """What the extension hands the app: write a prebuilt frame, or say the socket cannot take it."""

    def __init__(self, protocol: FanoutWebSocketProtocol) -> None:
        self._protocol = protocol

    def write(self, frame: bytes) -> bool:
        protocol = self._protocol
        transport = protocol.transport
        if protocol.close_sent or transport.is_closing() or not protocol.handshake_complete:
            return False
        if transport.get_write_buffer_size() > MAX_BUFFERED:
            transport.abort()  # the app then sees websocket.disconnect
            return False
        transport.write(frame)
        return True


class FanoutWebSocketProtocol(WebSocketsSansIOProtocol):
    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if self.response.status_code == 101:
            self.scope["extensions"][EXTENSION] = {"writer": FrameWriter(self)}


class Flushable(Protocol):
    def flush(self) -> None: ...


class Coalescer:
    """Writes each socket's pending frames in one go, at most once per `interval`.

    A write to a socket is a syscall, and on loopback most of the fan-out's CPU goes there. When
    changes come more often than `interval`, frames wait up to `interval` and leave together; when
    the hub is idle they leave at once, so light traffic gains no latency.
    """

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.dirty: dict[Flushable, None] = {}  # insertion-ordered set
        self.scheduled = False
        self.last = 0.0

    def mark(self, sink: Flushable) -> None:
        self.dirty[sink] = None
        if not self.scheduled:
            self.scheduled = True
            loop = asyncio.get_running_loop()
            loop.call_at(max(loop.time(), self.last + self.interval_s), self.flush)

    def flush(self) -> None:
        self.scheduled = False
        self.last = asyncio.get_running_loop().time()
        dirty, self.dirty = self.dirty, {}
        for sink in dirty:
            sink.flush()
