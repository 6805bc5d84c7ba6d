"""Forwarding between gateways: a request for a tunneled node whose agent dialled another gateway
goes to that gateway over HTTP, and its answer comes back as a NodeResponse.

Postgres records which gateway holds each tunnel (tunnel_route()) and where every gateway is reached
(its internal URL, given at each check-in). The gateway asking signs each forwarded request with a
key all gateways share (an HMAC over a timestamp, a nonce, the path and the body, as gateways sign
requests to agents: protocol/signing.py). The signed path names the gateway meant, the node and the
inference path; the gateway holding the tunnel refuses anything unsigned, stale, replayed or meant
for another gateway, and takes a request only to a tunnel it holds, only for an inference path. So
the route is neither an open relay nor a way in: it reaches no address, only agents' sockets.

The answer travels in frames, so the asking gateway tells the node's failures (an error frame: the
agent or its server failed, as over a tunnel held here) from the other gateway's (no answer, a
refusal, a dropped connection before the status line): those are the platform's, and the job moves
on without blaming the node (TunnelUnreachable). A frame is one byte of kind, four of length (big
endian) and the payload: S (JSON status and content type), D (body bytes), E (end), X (JSON error).

This module is the asking side and the frames both sides speak; the route of the gateway holding the
tunnel is gateway/forward.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from uuid import UUID

import aiohttp
from pydantic import BaseModel, Field, ValidationError

from neuralgrid.db import queries as q
from neuralgrid.gateway.tunnel import TunnelClosed, TunnelUnreachable
from neuralgrid.gateway.upstream import NodeError, NodeTimeout, Timing
from neuralgrid.protocol import signing

if TYPE_CHECKING:
    from neuralgrid.db.store import Store
    from neuralgrid.server.settings import Settings

log = logging.getLogger(__name__)

# /internal/gateways/{holder}/tunnels/{node}/v1/...: a signature is good at the gateway it names only.
PREFIX = "/internal/gateways"
FRAMES = "application/x-neuralgrid-frames"
JSON = "application/json"
START, DATA, END, ERROR = b"S", b"D", b"E", b"X"
HEADER = struct.Struct("!cI")
MAX_FRAME_BYTES = 16 * 2**20  # one chunk of a node's answer; a peer sending more is broken
# The gateway holding the tunnel times the node out itself (and says so in an error frame); this
# much longer without a frame, that gateway is the one that stalled.
PEER_MARGIN_S = 5.0
SIGNATURE_MAX_AGE_S = 30.0
# How reading from the holder fails: reset, closed early, silent past the margin, a malformed frame.
BROKEN_OFF = (aiohttp.ClientError, OSError, asyncio.IncompleteReadError, TimeoutError, ValueError)
_KEY_LABEL = b"neuralgrid inter-gateway forwarding v1"


def forwarding_key(settings: Settings) -> bytes:
    """The key every gateway signs and checks forwarded requests with: NEURALGRID_INTERNAL_SECRET,
    else derived from NEURALGRID_JWT_SECRET (a key of its own, so neither reveals the other)."""
    return settings.platform_key(_KEY_LABEL)


def internal_url(settings: Settings) -> str:
    """Where the other gateways reach this one: NEURALGRID_INTERNAL_URL, else http://<host>:<port>
    (the machine's name when the gateway listens on every address)."""
    if settings.internal_url:
        return settings.internal_url.rstrip("/")
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


class StatusLine(BaseModel):
    status: int = Field(ge=200, le=599)
    type: str = Field("application/json", pattern=r"^[\x20-\x7e]*$")  # a header value


class _Failure(BaseModel):
    message: str
    timeout: bool = False


def failure_frame(err: NodeError) -> bytes:
    return frame(
        ERROR, _Failure(message=str(err), timeout=isinstance(err, NodeTimeout)).model_dump_json().encode()
    )


# The gateway asking ------------------------------------------------------------------------------


class Peers:
    """The other gateways, as this one reaches them (and, for the route, how it checks them)."""

    def __init__(self, store: Store, gateway_id: UUID, key: bytes, connect_timeout_s: float) -> None:
        self.store = store  # the general pool: a route lookup is a read, kept off the claims' pool
        self.gateway_id = gateway_id
        self.key = key
        self.verifier = signing.Verifier(SIGNATURE_MAX_AGE_S)
        # Reads are timed per frame (ForwardedResponse), not by the session.
        timeout = aiohttp.ClientTimeout(total=None, connect=30.0, sock_connect=connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout)

    async def open(
        self, node_id: UUID, path: str, body: bytes, first_byte_timeout_s: float, content_type: str = JSON
    ) -> ForwardedResponse:
        """Ask the node through the gateway holding its tunnel; returns once the node's status line is
        in. TunnelUnreachable for whatever is not the node's doing. The body's content type (an
        upload's, with its boundary) travels in the signed query, so no one on the way changes it."""
        route = await self.store.one(q.TUNNEL_ROUTE, (node_id,))
        if route is None:
            raise TunnelUnreachable("no live gateway holds the node's tunnel")
        if route.gateway_id == self.gateway_id:  # a socket that closed here, its route not yet forgotten
            raise TunnelUnreachable("the node's tunnel closed on this gateway")
        if route.internal_url is None:
            raise TunnelUnreachable(
                f"gateway {route.gateway_id} holds the node's tunnel but gives no address"
            )
        # The holder waits for the node's status line as long as this gateway would (a whole answer's
        # first byte comes with its last token), and signs the wait with the rest.
        query = f"?first_byte_timeout_s={first_byte_timeout_s:.3f}"
        if content_type != JSON:  # in base64: no client re-quotes it, so the signature holds
            query += "&content_type=" + base64.urlsafe_b64encode(content_type.encode()).decode()
        target = f"{PREFIX}/{route.gateway_id}/tunnels/{node_id}{path}{query}"
        headers = {"content-type": content_type, signing.HEADER: signing.sign(self.key, target, body)}
        where = route.internal_url
        try:
            resp = await self.session.post(where + target, data=body, headers=headers, allow_redirects=False)
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            raise TunnelUnreachable(
                f"the gateway holding the node's tunnel ({where}) did not answer: {err!r}"
            ) from err
        if resp.status != 200 or resp.content_type != FRAMES:
            reason = await _reason(resp)
            if resp.status == 401:  # every gateway must share the key: an operator's mistake
                log.error("gateway %s refused a forwarded request's signature: %s", where, reason)
            raise TunnelUnreachable(f"the gateway holding the node's tunnel ({where}) refused: {reason}")
        answer = ForwardedResponse(resp, first_byte_timeout_s + PEER_MARGIN_S)
        try:
            await answer.start()
        except BaseException:  # the client left meanwhile (cancelled): the other gateway hears so too
            await answer.close()
            raise
        return answer

    async def close(self) -> None:
        await self.session.close()


async def _reason(resp: aiohttp.ClientResponse) -> str:
    """A refusal's message (OpenAI-shaped from a gateway), briefly."""
    try:
        async with asyncio.timeout(2):
            raw = await resp.read()
        message = json.loads(raw)["error"]["message"]
        return f"HTTP {resp.status}: {message}"
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        return f"HTTP {resp.status}"
    finally:
        resp.release()


class ForwardedResponse:
    """The node's answer relayed by the gateway holding its tunnel, as a NodeResponse."""

    def __init__(self, resp: aiohttp.ClientResponse, timeout_s: float) -> None:
        self._resp = resp
        self.timeout_s = timeout_s
        self.status = 0
        self.content_type = "application/json"
        self.timing: Timing | None = None  # the node's own time is not told apart from the way there
        self.finished = False

    async def _frame(self) -> tuple[bytes, bytes]:
        async with asyncio.timeout(self.timeout_s):
            kind, size = HEADER.unpack(await self._resp.content.readexactly(HEADER.size))
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"a {size}-byte frame")
            return kind, await self._resp.content.readexactly(size) if size else b""

    async def start(self) -> None:
        """The status line. Before it, a silent or broken peer is the platform's failure."""
        try:
            kind, payload = await self._frame()
            if kind == START:
                line = StatusLine.model_validate_json(payload)
                self.status, self.content_type = line.status, line.type
                return
        except BROKEN_OFF as err:
            await self.close()
            raise TunnelUnreachable(f"the gateway holding the node's tunnel broke off: {err!r}") from err
        await self.close()
        if kind == ERROR:  # the node's failure, told by the gateway holding its tunnel
            raise _node_error(payload)
        raise TunnelUnreachable(f"the gateway holding the node's tunnel sent a {kind!r} frame first")

    async def chunks(self) -> AsyncIterator[bytes]:
        while not self.finished:
            try:
                kind, payload = await self._frame()
            except BROKEN_OFF as err:
                await self.close()
                # The holder's failure, not the node's (it times the node out itself): before the answer
                # is committed to (a plain body, a stream's first event) the job moves on neutral.
                raise TunnelUnreachable(f"the gateway holding the node's tunnel broke off: {err!r}") from err
            if kind == DATA:
                yield payload
            elif kind == END:
                await self._end()
            else:
                await self.close()
                if kind == ERROR:
                    raise _node_error(payload)
                raise TunnelUnreachable(
                    f"the gateway holding the node's tunnel sent a {kind!r} frame mid-answer"
                )

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def _end(self) -> None:
        """Read the (empty) rest of the body, so the connection goes back to the pool."""
        self.finished = True
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with asyncio.timeout(1):
                await self._resp.content.read()
        self._resp.release()

    async def close(self) -> None:
        # Closing a half-read answer closes its connection: the other gateway cancels the request.
        if not self.finished:
            self.finished = True
            self._resp.close()
        self._resp.release()


def _node_error(payload: bytes) -> NodeError:
    try:
        failure = _Failure.model_validate_json(payload)
    except ValidationError:
        return TunnelClosed("the node failed (its gateway's error frame is unreadable)")
    return NodeTimeout(failure.message) if failure.timeout else TunnelClosed(failure.message)
