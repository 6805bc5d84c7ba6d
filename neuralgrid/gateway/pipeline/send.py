"""Stage 3, send: ask a node (directly, signed, or over its agent's tunnel) and, when it fails
before its first byte, move the job on to the next node and ask there."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from uuid import UUID

from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline.meter import Meter
from neuralgrid.gateway.pipeline.place import Node, Placement
from neuralgrid.gateway.tunnel import Tunnels
from neuralgrid.gateway.upstream import HttpNodes, NodeError, NodeResponse, NodeTimeout
from neuralgrid.protocol import signing

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings"}


class ClientError(Exception):
    """The node refused the request itself (4xx but 429): the client's mistake, passed through."""

    def __init__(self, status: int, body: bytes, media_type: str) -> None:
        super().__init__(f"HTTP {status} from the node: {body[:200]!r}")
        self.status, self.body, self.media_type = status, body, media_type


class Retryable(Exception):
    """The node failed before its first byte: another node may serve the request."""

    def __init__(self, message: str, status: int | None = None, timeout: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.timeout = timeout

    def same_as(self, other: Retryable | None) -> bool:
        """The same HTTP 500 (status and body) as the node before: what the request, not a node,
        causes. Not 502, 503, 504 or 429: unreachable, loading, draining or overloaded servers (and
        agents) answer those alike with nothing wrong in the request."""
        if other is None or self.status != 500:
            return False
        return (self.status, str(self)) == (other.status, str(other))


class NoNodeLeft(Exception):
    """Every candidate failed; the move that found none has ended (or kept) the job."""

    def __init__(self, failure: Retryable) -> None:
        super().__init__(str(failure))
        self.failure = failure


class Rejected(NoNodeLeft):
    """Two nodes failed the request the same way: the request is at fault, and reject_job() ended it."""


@dataclass(frozen=True)
class Delivery:
    """A node's committed answer: its response, body chunks and first bytes (plain: the whole body)."""

    node: Node
    response: NodeResponse
    chunks: AsyncIterator[bytes]
    first: bytes
    waited: float  # seconds spent on nodes that failed, which are not the gateway's overhead


Move = Callable[[UUID, str, int | None, list[UUID]], Awaitable[Node | None]]


class Sender:
    def __init__(
        self,
        nodes: HttpNodes,
        tunnels: Tunnels,
        placement: Placement,
        metrics: Metrics,
        first_byte_timeout_s: float,
    ) -> None:
        self.nodes = nodes
        self.tunnels = tunnels
        self.placement = placement
        self.metrics = metrics
        self.first_byte_timeout_s = first_byte_timeout_s

    async def deliver(
        self,
        kind: str,
        payload: bytes,
        stream: bool,
        meter: Meter,
        node: Node,
        candidates: list[UUID],
        *,
        resuming: bool = False,
    ) -> Delivery:
        """Send to `node`; each time a node fails before its first byte, move the job on (failover, or
        handoff when resuming a stream) and send there. The meter follows the job from node to node.
        When a second node fails a new request exactly as the one before it did, the request is at
        fault: the job is rejected (no node to blame)."""
        move: Move = self.placement.handoff if resuming else self.placement.failover
        waited = 0.0
        earlier: Retryable | None = None
        while True:
            meter.node_id, meter.sent = node.id, time.perf_counter()
            try:
                response, chunks, first = await self.send(node, PATHS[kind], payload, stream)
                return Delivery(node, response, chunks, first, waited)
            except Retryable as failure:
                waited += time.perf_counter() - meter.sent
                if not resuming and failure.same_as(earlier):
                    await self.placement.reject(meter.job_id, str(failure), failure.status)
                    raise Rejected(failure) from None
                earlier = failure
                nxt = await move(meter.job_id, str(failure), failure.status, candidates)
                if nxt is None:  # counted by whoever ends the job
                    raise NoNodeLeft(failure) from None
                self.metrics.count(node.id, "failed")
                self.metrics.failovers.inc()
                node = nxt

    async def send(
        self, node: Node, path: str, payload: bytes, stream: bool
    ) -> tuple[NodeResponse, AsyncIterator[bytes], bytes]:
        """Ask one node. Returns once the answer is committed to: a status that is not a failure,
        and the whole body (plain) or its first chunk (streams). Anything before that is Retryable."""
        try:
            resp = await self._open(node, path, payload)
            try:
                if (
                    resp.status == 429
                    or (resp.status >= 500 and resp.status != 501)
                    or 300 <= resp.status < 400
                ):
                    body = (await resp.read())[:200].decode(errors="replace")
                    raise Retryable(f"HTTP {resp.status}: {body}", status=resp.status)
                chunks = resp.chunks()
                if not stream:
                    return resp, chunks, await resp.read()
                if resp.status >= 400:
                    raise ClientError(resp.status, await resp.read(), resp.content_type)
                return resp, chunks, await anext(chunks)
            except BaseException:
                await resp.close()
                raise
        except NodeTimeout as err:
            raise Retryable(str(err), timeout=True) from err
        except NodeError as err:
            raise Retryable(str(err)) from err
        except StopAsyncIteration:
            raise Retryable("the node ended the stream before its first event") from None

    async def _open(self, node: Node, path: str, payload: bytes) -> NodeResponse:
        if not node.url.startswith("tunnel:"):
            headers = {"content-type": "application/json"}
            if node.key is not None:  # the node runs an agent: it checks the gateway's signature
                headers[signing.HEADER] = signing.sign(node.key, path, payload)
            return await self.nodes.post(node.url.rstrip("/") + path, payload, headers)
        tunnel = self.tunnels.get(node.id)
        if tunnel is None:
            raise NodeError("the node's tunnel is not connected to this gateway")
        resp = await tunnel.request(path, payload)
        await resp.start(self.first_byte_timeout_s)
        return resp
