"""The agent's side of a tunnel: dial out to the gateway, serve the requests that come back over it.

Many requests share the one socket (each in its own task, answered in frames tagged with its id);
a `cancel` frame stops one. When the socket drops, the agent dials the next of its gateways at once
(any gateway can carry the node's requests: the others forward to it), and backs off exponentially
only once every gateway has failed in a row.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Sequence

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from neuralgrid.agent.front import BackendUnreachable, FrontState, Refused
from neuralgrid.agent.relay import RelayError
from neuralgrid.protocol.tunnel import (
    FLOW,
    FLOW_HEADER,
    MAX_DATA,
    WINDOW,
    Cancel,
    Data,
    End,
    Err,
    More,
    Req,
    Start,
    encode,
    gateway_frame,
    is_text,
    unpack,
)
from neuralgrid.verify import gpu_probe

log = logging.getLogger(__name__)

Send = Callable[[Start | Data | End | Err], Awaitable[None]]


class Window:
    """How much of one answer is out: sent and not yet acknowledged by the gateway (`more`). The
    answer waits, not the socket, when a client reads slowly: the other requests go on. `size` None:
    a gateway that sends no `more` (from before flow control), so nothing is held back."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.out = 0
        self.acknowledged = asyncio.Event()

    async def spend(self, n: int) -> None:
        """Wait until `n` more characters fit in the window, then count them."""
        while self.size is not None and self.out and self.out + n > self.size:
            self.acknowledged.clear()
            await self.acknowledged.wait()
        self.out += n

    def more(self, n: int) -> None:
        self.out = max(self.out - n, 0)
        self.acknowledged.set()


class TunnelClient:
    def __init__(self, gateway_urls: Sequence[str], node_id: str, secret: str, front: FrontState) -> None:
        if not gateway_urls:
            raise ValueError("a tunnel needs at least one gateway to dial")
        bases = [url.rstrip("/").replace("http", "ws", 1) for url in gateway_urls]
        self.urls = [f"{base}/v1/nodes/{node_id}/tunnel" for base in bases]
        self.secret = secret
        self.front = front
        self.connected = asyncio.Event()
        self.close = asyncio.Event()  # set after a drain: hang up for good

    async def run(self) -> None:
        backoff, turn, failed = 0.25, 0, 0  # failed: gateways that refused or were away, in a row
        while not self.close.is_set():
            url = self.urls[turn % len(self.urls)]
            served = False
            try:
                headers = {"authorization": f"Bearer {self.secret}", FLOW_HEADER: FLOW}
                async with connect(url, additional_headers=headers, max_size=None) as ws:
                    log.info("tunnel to the gateway at %s connected", url)
                    self.connected.set()
                    served, backoff = True, 0.25
                    await self._serve(ws)
            except (OSError, WebSocketException) as err:
                log.warning("tunnel to the gateway at %s lost (%s)", url, err)
            self.connected.clear()
            # The next gateway: the one that dropped the socket may be going away.
            turn += 1
            failed = 0 if served else failed + 1
            if len(self.urls) == 1 or (failed and failed % len(self.urls) == 0):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.close.wait(), timeout=backoff)
                backoff = min(backoff * 2, 10.0)

    async def _serve(self, ws: ClientConnection) -> None:
        lock = asyncio.Lock()
        tasks: dict[int, asyncio.Task[None]] = {}
        windows: dict[int, Window] = {}
        flow = ws.response is not None and ws.response.headers.get(FLOW_HEADER) == FLOW

        async def send(frame: Start | Data | End | Err) -> None:
            async with lock:
                await ws.send(encode(frame))

        closing = asyncio.create_task(self.close.wait())
        try:
            while True:
                receiving = asyncio.create_task(ws.recv())
                done, _ = await asyncio.wait({receiving, closing}, return_when=asyncio.FIRST_COMPLETED)
                if receiving not in done:
                    receiving.cancel()
                    return
                try:
                    frame = gateway_frame(receiving.result())
                except ValueError as err:  # a gateway that speaks another version: skip, keep serving
                    log.warning("unreadable frame from the gateway: %s", err)
                    continue
                if isinstance(frame, Req):
                    window = windows[frame.id] = Window(WINDOW if flow else None)
                    task = asyncio.create_task(self._handle(frame, send, window))
                    tasks[frame.id] = task
                    task.add_done_callback(functools.partial(_forget, tasks, windows, frame.id))
                elif isinstance(frame, More) and frame.id in windows:
                    windows[frame.id].more(frame.n)
                elif isinstance(frame, Cancel) and frame.id in tasks:
                    tasks[frame.id].cancel()
        finally:
            closing.cancel()
            for task in tasks.values():
                task.cancel()

    async def _handle(self, frame: Req, send: Send, window: Window) -> None:
        request_id = frame.id
        if self.front.draining:
            return await _refuse(send, request_id, 503, "this node is draining")
        try:
            try:
                body = unpack(frame.body, frame.b64)
                if frame.path == gpu_probe.PATH:
                    status, probed = await self.front.probe(body)
                    await send(Start(id=request_id, status=status))
                    await _send_data(send, window, request_id, json.dumps(probed))
                    return await send(End(id=request_id))
                answer = await self.front.forward(frame.path, body, frame.type or "application/json")
            except Refused as refused:
                return await _refuse(send, request_id, refused.status, refused.message)
            try:
                await send(Start(id=request_id, status=answer.status, type=answer.media_type))
                # Text goes as it is (a chunk may end mid-character: decoded across chunks); other
                # bytes (audio) in base64.
                decoder = (
                    codecs.getincrementaldecoder("utf-8")("replace") if is_text(answer.media_type) else None
                )
                async for chunk in answer.chunks:
                    if decoder is None:
                        await _send_data(send, window, request_id, chunk)
                    elif text := decoder.decode(chunk):
                        await _send_data(send, window, request_id, text)
                if decoder is not None and (tail := decoder.decode(b"", final=True)):
                    await _send_data(send, window, request_id, tail)  # a last character cut short
            except RelayError as err:
                answer.broken(err)
                raise
            finally:  # cancelled (the gateway's client left) or not: the server's request ends here
                await answer.aclose()
            await send(End(id=request_id))
        except Exception as err:  # whatever went wrong, the gateway hears of it, never silence
            if isinstance(err, RelayError | BackendUnreachable):
                message = str(err)
            else:
                if not isinstance(err, httpx.HTTPError | OSError):
                    log.exception("request %s failed in the agent", request_id)
                message = f"the backend failed: {err!r}"
            with contextlib.suppress(WebSocketException):
                await send(Err(id=request_id, message=message))


async def _refuse(send: Send, request_id: int, status: int, message: str) -> None:
    """An answer of the agent's own, in OpenAI's error shape."""
    await send(Start(id=request_id, status=status))
    await send(Data(id=request_id, b=json.dumps({"error": {"message": message, "code": status}})))
    await send(End(id=request_id))


async def _send_data(send: Send, window: Window, request_id: int, chunk: str | bytes) -> None:
    """A chunk of the answer in `data` frames of at most MAX_DATA, each once the window has room:
    text as it is, other bytes in base64 (4 characters for every 3 bytes)."""
    if isinstance(chunk, str):
        frames = [Data(id=request_id, b=chunk[i : i + MAX_DATA]) for i in range(0, len(chunk), MAX_DATA)]
    else:
        step = MAX_DATA // 4 * 3
        frames = [
            Data(id=request_id, b=base64.b64encode(chunk[i : i + step]).decode("ascii"), b64=True)
            for i in range(0, len(chunk), step)
        ]
    for frame in frames:
        await window.spend(len(frame.b))
        await send(frame)


def _forget(
    tasks: dict[int, asyncio.Task[None]], windows: dict[int, Window], request_id: int, _: asyncio.Task[None]
) -> None:
    tasks.pop(request_id, None)
    windows.pop(request_id, None)
