"""Talking to nodes: one pooled aiohttp session for nodes with an address (tunnels are the other way).

Both ways answer with a NodeResponse and fail with a NodeError, so that the proxy's rule (fail over
before the first byte, end the stream after it) reads the same for either. aiohttp rather than httpx
here: on the request path its C parser costs a fraction of the CPU, which is most of what the gateway
adds to a request.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol

import aiohttp

from neuralgrid.gateway.endpoints import PrivateEndpoint, PublicResolver, check_literal


class NodeError(Exception):
    """A node failed to answer: refused, reset, or dropped its answer half-way."""


class NodeTimeout(NodeError):
    """A node did not connect, or did not send its next byte, in time."""


@dataclass(slots=True)
class Timing:
    """When the node had the whole request, and when its whole answer was in if that came with its
    status and headers (else 0), as the HTTP client saw them (time.perf_counter()): between the two
    the node works; writing the request and parsing the answer are the gateway's own time."""

    asked: float = 0.0
    answered: float = 0.0


class NodeResponse(Protocol):
    """A node's answer once its status is known; the body is read once, whole or in chunks.
    `timing`: None where the way to the node does not tell it (tunnels)."""

    status: int
    content_type: str
    timing: Timing | None

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    async def close(self) -> None: ...


def _translate(err: Exception) -> NodeError:
    """aiohttp's error as what happened, in words: the message reaches clients and the ledger."""
    if isinstance(err, aiohttp.ConnectionTimeoutError):
        return NodeTimeout("timeout: the node did not take the connection in time")
    if isinstance(err, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return NodeTimeout("timeout: the node sent nothing in time")
    if isinstance(err, aiohttp.ClientConnectorError):  # refused, unreachable, no such host
        # What went wrong, never where: the message reaches developers, and a node's address is its
        # owner's (a home machine's IP and port), which no API role may read.
        if isinstance(err, aiohttp.ClientConnectorDNSError):
            return NodeError("could not connect: the node's host name does not resolve")
        if isinstance(err, aiohttp.ClientSSLError):
            return NodeError("could not connect: the TLS handshake failed")
        code = err.os_error.errno
        return NodeError(f"could not connect: {os.strerror(code) if code else type(err.os_error).__name__}")
    if isinstance(err, aiohttp.ClientPayloadError):  # a body cut short: the connection closed
        return NodeError("its connection closed before the answer's end")
    if isinstance(err, aiohttp.ServerDisconnectedError):
        return NodeError("the node closed the connection without answering")
    if isinstance(err, aiohttp.ClientResponseError):  # what it sent is not HTTP
        return NodeError(f"the node's answer is not valid HTTP ({err.message})")
    return NodeError(f"{type(err).__name__}: {err}")


class HttpResponse:
    """An aiohttp response as a NodeResponse."""

    def __init__(self, resp: aiohttp.ClientResponse, timing: Timing) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("content-type", "application/json")
        self.timing: Timing | None = timing

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as err:
            raise _translate(err) from err

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, TimeoutError) as err:
            raise _translate(err) from err

    async def close(self) -> None:
        # A body read to its end gives the connection back to the pool; a half-read one closes it.
        self._resp.release()


async def _asked(_: aiohttp.ClientSession, ctx: SimpleNamespace, __: object) -> None:
    ctx.trace_request_ctx.asked = time.perf_counter()  # each chunk of the body: the last one counts


async def _answered(
    _: aiohttp.ClientSession, ctx: SimpleNamespace, end: aiohttp.TraceRequestEndParams
) -> None:
    if end.response.content.is_eof():  # the body came with the headers: the node is done
        ctx.trace_request_ctx.answered = time.perf_counter()


def _timed() -> aiohttp.TraceConfig:
    timed = aiohttp.TraceConfig()
    timed.on_request_chunk_sent.append(_asked)
    timed.on_request_end.append(_answered)
    return timed


class HttpNodes:
    """Keep-alive connections to nodes. Timeouts: to connect, and between bytes once connected."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int = 1000,
        public_only: bool = False,
    ) -> None:
        # sock_connect bounds the node's own connect; connect (which also counts the wait for a free
        # slot in this pool) only guards against waiting forever.
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=30.0, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        # public_only (production): node addresses are checked as written and as resolved, at connect
        # time, so neither a registration nor a later change to a node's address reaches inside.
        self.public_only = public_only
        resolver = PublicResolver() if public_only else None
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, resolver=resolver)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=self.timeout, trace_configs=[_timed()]
        )

    async def post(
        self, url: str, payload: bytes, headers: dict[str, str], first_byte_timeout_s: float | None = None
    ) -> HttpResponse:
        """POST to a node. `first_byte_timeout_s`: how long it may take to start answering, when
        that is not the session's read timeout (a whole answer takes as long as its tokens)."""
        if self.public_only:
            try:
                check_literal(url)  # literal addresses never reach the resolver
            except PrivateEndpoint as err:
                raise NodeError(f"refused to connect: {err}") from None
        try:
            # Never follow a node's redirect: it could point the gateway at an internal address.
            timeout = self.timeout
            if first_byte_timeout_s is not None and first_byte_timeout_s != timeout.sock_read:
                timeout = aiohttp.ClientTimeout(
                    total=None,
                    connect=30.0,
                    sock_connect=timeout.sock_connect,
                    sock_read=first_byte_timeout_s,
                )
            timing = Timing()
            resp = await self.session.post(
                url,
                data=payload,
                headers=headers,
                allow_redirects=False,
                timeout=timeout,
                trace_request_ctx=timing,
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            raise _translate(err) from err
        return HttpResponse(resp, timing)

    async def close(self) -> None:
        await self.session.close()
