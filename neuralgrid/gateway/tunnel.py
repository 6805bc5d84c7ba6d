"""Tunnels: agents behind NAT dial in over a WebSocket, and requests are multiplexed over it.

The frames are neuralgrid.protocol.tunnel's models, shared with the agent. A TunnelResponse is a
NodeResponse, so failover, streaming and metering work the same over a tunnel as over HTTP. A tunnel
held by another gateway is reached through it (a Forwarder: gateway/peers.py's Peers); Postgres
records which gateway holds each tunnel (attach_tunnel(), detach_tunnel()).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol
from uuid import UUID, uuid4

from starlette.websockets import WebSocket, WebSocketDisconnect

from neuralgrid.db import queries as q
from neuralgrid.gateway.upstream import NodeError, NodeResponse, NodeTimeout, Timing
from neuralgrid.protocol.tunnel import (
    MAX_DATA,
    UNWINDOWED_CAP,
    WINDOW,
    Cancel,
    Data,
    End,
    Err,
    More,
    Req,
    Start,
    agent_frame,
    encode,
    pack,
    unpack,
)

if TYPE_CHECKING:
    from neuralgrid.db.store import Store

AgentFrame = Start | Data | End | Err
# The status a job moves on with when no gateway could reach its node's tunnel (Misdirected
# Request): failover_job() then ends the attempt neutral for the node. A node's own 421 is a 4xx the
# client gets, so it never reaches failover_job().
MISDIRECTED = 421


class TunnelClosed(NodeError):
    """The tunnel went away while a request was on it."""


class TunnelUnreachable(NodeError):
    """No gateway could take the request to the node's tunnel: none holds it, or the one holding it
    did not answer. The platform's failure, not the node's."""


class Forwarder(Protocol):
    """How a tunnel held by another gateway is reached (gateway/peers.py's Peers). The tunnels' own
    small interface, as httpx's client has its transport's: what forwards imports the tunnel, never
    the other way round."""

    async def open(
        self, node_id: UUID, path: str, body: bytes, first_byte_timeout_s: float, content_type: str
    ) -> NodeResponse:
        """The node's answer once its status line is in; TunnelUnreachable for the platform's failures."""


class Inbox:
    """One request's frames as they arrive, and how many characters of its data are out: sent by the
    agent and not yet taken by the gateway's reader and acknowledged (`more`)."""

    def __init__(self) -> None:
        self.frames: asyncio.Queue[AgentFrame] = asyncio.Queue()
        self.out = 0


class Tunnel:
    def __init__(self, node_id: UUID, ws: WebSocket, windowed: bool = True) -> None:
        self.node_id = node_id
        self.ws = ws
        # Whether the agent keeps to windows (it said so in the handshake): else it is one from
        # before flow control, sent no `more`, and held to UNWINDOWED_CAP.
        self.windowed = windowed
        self.limit = WINDOW if windowed else UNWINDOWED_CAP
        self.socket_id = uuid4()  # names this socket in tunnel_routes: a late close forgets only its own
        self.pending: dict[int, Inbox] = {}
        self.ids = itertools.count(1)
        self.send_lock = asyncio.Lock()

    async def send(self, frame: Req | Cancel | More) -> None:
        async with self.send_lock:
            await self.ws.send_text(encode(frame))

    async def request(self, path: str, body: bytes, content_type: str = "application/json") -> TunnelResponse:
        request_id = next(self.ids)
        text, b64 = pack(body)  # an upload that is not UTF-8 goes in base64
        kind = None if content_type == "application/json" else content_type
        frame = Req(id=request_id, path=path, body=text, type=kind, b64=b64)  # before any state: it may raise
        inbox = self.pending[request_id] = Inbox()
        try:
            await self.send(frame)
        except (WebSocketDisconnect, RuntimeError) as err:
            self.pending.pop(request_id, None)
            raise TunnelClosed(f"the tunnel to node {self.node_id} is closed") from err
        return TunnelResponse(self, request_id, inbox)

    async def read(self) -> None:
        """Route the agent's frames to the requests waiting for them until the socket closes.

        A frame that is not the protocol's closes the tunnel: the agent's requests fail over elsewhere.
        A request whose data overruns its window fails as the agent's fault and is cancelled.
        """
        try:
            while True:
                frame = agent_frame(await self.ws.receive_text())
                if (inbox := self.pending.get(frame.id)) is None:
                    continue
                if isinstance(frame, Data):
                    out, inbox.out = inbox.out, inbox.out + len(frame.b)
                    if out and inbox.out > self.limit:  # what a flood would leave in the gateway's memory
                        overrun = f"the agent sent more than {self.limit} bytes ahead of the gateway's reader"
                        inbox.frames.put_nowait(Err(id=frame.id, message=overrun))
                        await self.cancel(frame.id)
                        continue
                inbox.frames.put_nowait(frame)
                if not self.windowed:
                    # Messages already in take no turn of the loop: let the readers take this one,
                    # or an agent that does not wait would overrun even an eager reader.
                    await asyncio.sleep(0)
        # KeyError: a binary frame (receive_text finds no text), which the protocol does not have.
        except (WebSocketDisconnect, RuntimeError, ValueError, KeyError):
            pass
        finally:
            for request_id, inbox in self.pending.items():
                inbox.frames.put_nowait(Err(id=request_id, message="the tunnel closed"))

    def forget(self, request_id: int) -> None:
        """A request is answered: its id gets no more frames."""
        self.pending.pop(request_id, None)

    async def cancel(self, request_id: int) -> None:
        if self.pending.pop(request_id, None) is not None:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await self.send(Cancel(id=request_id))

    async def taken(self, request_id: int, n: int) -> None:
        """The reader took `n` characters of the request's data: the agent may send as much again."""
        if (inbox := self.pending.get(request_id)) is not None:
            inbox.out -= n
            if self.windowed:
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                    await self.send(More(id=request_id, n=n))


class TunnelResponse:
    """One request's answer arriving over a tunnel, as a NodeResponse."""

    def __init__(self, tunnel: Tunnel, request_id: int, inbox: Inbox) -> None:
        self.tunnel = tunnel
        self.request_id = request_id
        self.queue = inbox.frames
        self.taken = 0  # characters of data taken and not yet acknowledged to the agent
        self.status = 0
        self.content_type = "application/json"
        self.timing: Timing | None = None  # the node's own time is not told apart from the way there
        self.finished = False
        self.timeout = 30.0  # between two frames of the body, as between two reads from an HTTP node

    async def start(self, timeout: float) -> None:
        """Wait for the status line; a timeout or an error frame is a failure before the first byte."""
        try:
            frame = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            await self.close()
            raise NodeTimeout("timeout: no answer through the tunnel") from None
        if not isinstance(frame, Start):
            self._done()
            raise TunnelClosed(frame.message if isinstance(frame, Err) else "the agent sent no status line")
        self.status = frame.status
        self.content_type = frame.type
        self.timeout = timeout

    async def chunks(self) -> AsyncIterator[bytes]:
        while not self.finished:
            try:
                frame = await asyncio.wait_for(self.queue.get(), self.timeout)
            except TimeoutError:
                await self.close()
                raise NodeTimeout("timeout: the agent stopped sending") from None
            if isinstance(frame, Data):
                # Taken when the reader asks for more, so a slow client slows its own answer only;
                # acknowledged by halves of the window (MAX_DATA, the agent's largest frame, so that
                # an agent waiting for room always gets it), so a stream sends almost no `more`.
                self.taken += len(frame.b)
                if self.taken >= MAX_DATA:
                    await self.tunnel.taken(self.request_id, self.taken)
                    self.taken = 0
                try:
                    yield unpack(frame.b, frame.b64)
                except ValueError:  # base64 that is not: the agent is broken
                    await self.close()
                    raise TunnelClosed("the agent sent a chunk that is not base64") from None
            elif isinstance(frame, End):
                self._done()
            else:
                self._done()
                message = frame.message if isinstance(frame, Err) else "the agent sent a second status line"
                raise TunnelClosed(message)

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def _done(self) -> None:
        """The answer is complete: forget the request (its id gets no more frames)."""
        self.finished = True
        self.tunnel.forget(self.request_id)

    async def close(self) -> None:
        if not self.finished:
            self.finished = True
            await self.tunnel.cancel(self.request_id)
        self.tunnel.forget(self.request_id)


class Tunnels:
    """The tunnels this gateway instance holds, by node, and the way to those other gateways hold."""

    def __init__(self, gateway_id: UUID, peers: Forwarder | None = None) -> None:
        self.by_node: dict[UUID, Tunnel] = {}
        self.gateway_id = gateway_id  # recorded as the holder of the tunnels attached here
        self.peers = peers  # None: tunnels held elsewhere are out of reach

    def get(self, node_id: UUID) -> Tunnel | None:
        return self.by_node.get(node_id)

    async def open(
        self,
        node_id: UUID,
        path: str,
        body: bytes,
        first_byte_timeout_s: float,
        content_type: str = "application/json",
    ) -> NodeResponse:
        """Ask the node through its tunnel, here or at the gateway holding it; returns once its
        status line is in. TunnelUnreachable when no gateway could take the request to the node."""
        link = self.by_node.get(node_id)
        if link is None:
            if self.peers is None:
                raise TunnelUnreachable("the node's tunnel is not connected to this gateway")
            return await self.peers.open(node_id, path, body, first_byte_timeout_s, content_type)
        resp = await link.request(path, body, content_type)
        try:
            await resp.start(first_byte_timeout_s)
        except BaseException:  # cancelled meanwhile (the client left): the agent hears so too
            await resp.close()
            raise
        return resp

    async def restore(self, store: Store) -> list[UUID]:
        """Record again the tunnels held here that the sweep forgot (this gateway checked in late,
        its sockets open all along); returns their nodes."""
        links = list(self.by_node.values())
        if not links:
            return []
        ids = ([link.node_id for link in links], [link.socket_id for link in links])
        return await store.all(q.RESTORE_TUNNELS, (self.gateway_id, *ids))

    def attach(self, link: Tunnel) -> None:
        """The node's newest socket carries its requests from now on."""
        self.by_node[link.node_id] = link

    def detach(self, link: Tunnel) -> bool:
        """Forget a closed socket; False when a newer one of the same node has replaced it."""
        if self.by_node.get(link.node_id) is not link:
            return False
        del self.by_node[link.node_id]
        return True
