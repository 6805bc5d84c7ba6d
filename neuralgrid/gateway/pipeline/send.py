"""Stage 3, send: ask a node (directly, signed, or over its agent's tunnel) and, when it fails
before its first byte, move the job on to the next node and ask there."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from uuid import UUID

from neuralgrid.db.queries import JobOutcome
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline.kinds import PATHS
from neuralgrid.gateway.pipeline.meter import Meter
from neuralgrid.gateway.pipeline.place import Node, Placement
from neuralgrid.gateway.tunnel import MISDIRECTED, Tunnels, TunnelUnreachable
from neuralgrid.gateway.upstream import HttpNodes, NodeError, NodeResponse, NodeTimeout
from neuralgrid.protocol import signing

# A whole answer's time to its first (and last) byte: SLACK times what max_tokens take at the node's
# speed (a node's measured speed is an average; a busy moment may halve it), never below
# SLOWEST_TOKENS_PER_S (a node without a record), at most LONGEST_ANSWER_S (the sweep ends any job
# after platform_settings.job_deadline_s, 900 s by default).
SLACK = 3.0
SLOWEST_TOKENS_PER_S = 5.0
LONGEST_ANSWER_S = 600.0

JSON = "application/json"
# What is read of a node's refusal: enough for its message, whatever size it says it is.
ERROR_BYTES = 64 << 10


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

    @property
    def outcome(self) -> JobOutcome:
        """How the attempt ended, as failover_job() records it: 421 (no gateway reached the node's
        tunnel) is the platform's failure, cancelled; anything else is the node's."""
        return "cancelled" if self.status == MISDIRECTED else "failed"

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
        request_keys: bytes,
        max_answer_bytes: int = 64 << 20,
    ) -> None:
        self.nodes = nodes
        self.request_keys = request_keys  # what nodes' request keys derive from (protocol/signing.py)
        self.tunnels = tunnels
        self.placement = placement
        self.metrics = metrics
        self.first_byte_timeout_s = first_byte_timeout_s
        self.max_answer_bytes = max_answer_bytes

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
        answer_tokens: int = 0,
        speeds: Mapping[UUID, float | None] | None = None,
        content_type: str = JSON,
    ) -> Delivery:
        """Send to `node`; each time a node fails before its first byte, move the job on (failover, or
        handoff when resuming a stream) and send there. The meter follows the job from node to node.
        When a second node fails a new request exactly as the one before it did, the request is at
        fault: the job is rejected (no node to blame). A whole answer of up to `answer_tokens` is
        given the time those take at each node's speed (`speeds`, see first_byte_timeout_s). The
        payload goes with its `content_type` (an upload's, with its boundary)."""
        move: Move = self.placement.handoff if resuming else self.placement.failover
        waited = 0.0
        earlier: Retryable | None = None
        while True:
            meter.node_id, meter.sent = node.id, time.perf_counter()
            try:
                timeout_s = self.first_byte_timeout(stream, answer_tokens, (speeds or {}).get(node.id))
                response, chunks, first = await self.send(
                    node, PATHS[kind], payload, stream, timeout_s, content_type
                )
                return Delivery(node, response, chunks, first, waited)
            except Retryable as failure:
                waited += time.perf_counter() - meter.sent
                if not resuming and failure.same_as(earlier):
                    await self.placement.reject(meter.job_id, str(failure), failure.status)
                    raise Rejected(failure) from None
                earlier = failure
                nxt = await move(meter.job_id, str(failure), failure.status, candidates)
                if failure.outcome == "failed":  # the node's own failure, not a tunnel none reached
                    self.placement.node_failed(node.id)  # after the move, which cooled it down in SQL
                if nxt is None:  # counted by whoever ends the job
                    raise NoNodeLeft(failure) from None
                self.metrics.count(node.id, failure.outcome)
                self.metrics.failovers.inc()
                node = nxt

    def first_byte_timeout(self, stream: bool, answer_tokens: int, tokens_per_s: float | None) -> float:
        """How long a node may take to its first byte. A stream's is its first token: the first-byte
        timeout. A whole answer's first byte comes with its last token, so on top of that it gets
        SLACK times what its max_tokens take at the node's measured decode speed
        (SLOWEST_TOKENS_PER_S until measured), up to LONGEST_ANSWER_S. Only a node slower
        than that is at fault."""
        if stream or answer_tokens <= 0:
            return self.first_byte_timeout_s
        speed = max(tokens_per_s or SLOWEST_TOKENS_PER_S, SLOWEST_TOKENS_PER_S)
        return min(self.first_byte_timeout_s + SLACK * answer_tokens / speed, LONGEST_ANSWER_S)

    async def send(
        self,
        node: Node,
        path: str,
        payload: bytes,
        stream: bool,
        timeout_s: float | None = None,
        content_type: str = JSON,
    ) -> tuple[NodeResponse, AsyncIterator[bytes], bytes]:
        """Ask one node. Returns once the answer is committed to: a status that is not a failure,
        and the whole body (plain) or its first chunk (streams). Anything before that is Retryable."""
        try:
            resp = await self._open(node, path, payload, timeout_s or self.first_byte_timeout_s, content_type)
            try:
                if (
                    resp.status == 429
                    or (resp.status >= 500 and resp.status != 501)
                    or 300 <= resp.status < 400
                ):
                    body = (await read_at_most(resp, 200, cut=True)).decode(errors="replace")
                    raise Retryable(f"HTTP {resp.status}: {body}", status=resp.status)
                if not stream:
                    return resp, resp.chunks(), await read_at_most(resp, self.max_answer_bytes)
                if resp.status >= 400:
                    error = await read_at_most(resp, ERROR_BYTES, cut=True)
                    raise ClientError(resp.status, error, resp.content_type)
                chunks = resp.chunks()
                return resp, chunks, await anext(chunks)
            except BaseException:
                await resp.close()
                raise
        except NodeTimeout as err:
            raise Retryable(str(err), timeout=True) from err
        except TunnelUnreachable as err:  # no gateway reached the node: moved on neutral for the node
            raise Retryable(str(err), status=MISDIRECTED) from err
        except NodeError as err:
            raise Retryable(str(err)) from err
        except StopAsyncIteration:
            raise Retryable("the node ended the stream before its first event") from None

    async def _open(
        self, node: Node, path: str, payload: bytes, timeout_s: float, content_type: str
    ) -> NodeResponse:
        if not node.url.startswith("tunnel:"):
            headers = {"content-type": content_type}
            if node.key is not None:  # the node runs an agent: it checks the gateway's signature
                key = signing.request_key(self.request_keys, node.key)
                headers[signing.HEADER] = signing.sign(key, path, payload)
            return await self.nodes.post(node.url.rstrip("/") + path, payload, headers, timeout_s)
        # Over the agent's tunnel, held here or by another gateway (which the request goes through).
        return await self.tunnels.open(node.id, path, payload, timeout_s, content_type)


async def read_at_most(resp: NodeResponse, limit: int, cut: bool = False) -> bytes:
    """A node's body, read whole while it fits `limit` (a node is not trusted with a gateway's
    memory: a 1 GiB answer took 2 GiB), else a NodeError; `cut`: its first `limit` bytes, the rest
    left unread (the response is closed after)."""
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.chunks():
        parts.append(chunk)
        size += len(chunk)
        if size >= limit:
            if cut:
                return b"".join(parts)[:limit]
            if size > limit:
                raise NodeError(f"the node's answer is larger than {limit >> 20} MiB")
    return b"".join(parts)
