"""One request's way through the platform: match in SQL, forward, fail over, relay, meter.

A node that fails before its first byte (refused, timed out, 5xx, 429) is recorded by
failover_job(), which cools it down and claims the next fallback. A node that drops a stream after
its first byte is handed over the same way (handoff_job()), and the next node goes on with the
answer so far (see stream.py); when none can, the stream ends with an OpenAI-style error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from uuid import UUID

import psycopg
from psycopg.rows import class_row
from psycopg_pool import AsyncConnectionPool
from starlette.responses import Response, StreamingResponse

from neuralgrid.db import errors as db_errors
from neuralgrid.gateway import errors
from neuralgrid.gateway.auth import ApiKey
from neuralgrid.gateway.completions import Completions
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.ratelimit import RateLimiter
from neuralgrid.gateway.stream import SseEvents, Usage, continuation
from neuralgrid.gateway.tunnel import Tunnels
from neuralgrid.gateway.upstream import HttpNodes, NodeError, NodeResponse, NodeTimeout
from neuralgrid.matching import MATCH_JOB, JobEnd, Match, MatchRequest, match_params
from neuralgrid.protocol import signing
from neuralgrid.server.settings import Settings

log = logging.getLogger(__name__)

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings"}
FAILOVER = "select node_id, endpoint_url, node_key, attempt from public.failover_job(%s, %s, %s, %s::uuid[])"
HANDOFF = "select node_id, endpoint_url, node_key, attempt from public.handoff_job(%s, %s, %s::uuid[])"
CONTINUING = "select public.continuing_nodes(%s::uuid[])"
REJECT = "select public.reject_job(%s, %s, %s)"
CATALOG = "select id, kind, input_usd_per_mtok::float8, output_usd_per_mtok::float8 from public.models"


@dataclass(frozen=True)
class Call:
    """A client's request as the gateway received it."""

    kind: str
    body: dict[str, Any]
    key: ApiKey
    region: str | None = None
    max_hourly_rate: float | None = None
    policy: str = "balanced"
    received: float = field(default_factory=time.perf_counter)


class _ClientError(Exception):
    """The node refused the request itself (4xx but 429): the client's mistake, passed through."""

    def __init__(self, status: int, body: bytes, media_type: str) -> None:
        super().__init__(f"HTTP {status} from the node: {body[:200]!r}")
        self.status, self.body, self.media_type = status, body, media_type


class _Retryable(Exception):
    def __init__(self, message: str, status: int | None = None, timeout: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.timeout = timeout

    def same_as(self, other: _Retryable | None) -> bool:
        """The same HTTP 500 (status and body) as the node before: what the request, not a node,
        causes. Not 502, 503, 504 or 429: unreachable, loading, draining or overloaded servers (and
        agents) answer those alike with nothing wrong in the request."""
        if other is None or self.status != 500:
            return False
        return (self.status, str(self)) == (other.status, str(other))


class Catalog:
    """The catalog's prices and model kinds, for the budget hold each request places and for
    refusing a request its model cannot serve; reloaded every minute."""

    def __init__(self) -> None:
        self.models: dict[str, tuple[str, float | None, float | None]] = {}
        self.loaded_at = float("-inf")

    async def _load(self, pool: AsyncConnectionPool) -> None:
        if time.monotonic() - self.loaded_at > 60:
            async with pool.connection() as conn:
                rows = await (await conn.execute(CATALOG)).fetchall()
            self.models = {r[0]: (r[1], r[2], r[3]) for r in rows}
            self.loaded_at = time.monotonic()

    async def check(self, pool: AsyncConnectionPool, call_kind: str, model: str) -> None:
        """BadRequest when the catalog says the model does not do this (a chat model's embeddings):
        a server would fail it (HTTP 500 or 501), which is no node's fault."""
        await self._load(pool)
        kind = self.models.get(model, ("",))[0]
        if kind and (kind == "embedding") != (call_kind == "embedding"):
            what = "embeddings" if call_kind == "embedding" else "chat or completions"
            raise errors.BadRequest(f"{model} is a {kind} model: it does not serve {what}", param="model")

    async def estimate(self, pool: AsyncConnectionPool, model: str, prompt_bytes: int, max_out: int) -> float:
        await self._load(pool)
        _, price_in, price_out = self.models.get(model, ("", None, None))
        # About four bytes a token; the answer at its max_tokens: an upper bound, as a hold should be.
        return ((prompt_bytes / 4) * (price_in or 0) + max_out * (price_out or 0)) / 1e6


class Router:
    """Routes calls to nodes. One per app; holds the pool, the node connections and the limiter."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        nodes: HttpNodes,
        settings: Settings,
        limiter: RateLimiter,
        metrics: Metrics,
        tunnels: Tunnels,
    ) -> None:
        self.pool = pool
        self.nodes = nodes
        self.settings = settings
        self.limiter = limiter
        self.metrics = metrics
        self.tunnels = tunnels
        self.catalog = Catalog()
        self.completions = Completions(pool)
        self._finishing: set[asyncio.Task[None]] = set()

    async def handle(self, call: Call) -> Response:
        await self.catalog.check(self.pool, call.kind, call.body["model"])
        await self.limiter.admit(call.key)
        stream = bool(call.body.get("stream")) and call.kind != "embedding"
        upstream_body = dict(call.body)
        if stream:  # ask for usage to meter; stripped again if the client did not ask
            upstream_body["stream_options"] = {
                **(call.body.get("stream_options") or {}),
                "include_usage": True,
            }
        max_out = int(
            call.body.get("max_tokens")
            or call.body.get("max_completion_tokens")
            or self.settings.default_max_tokens
        )
        if call.key.budget_usd is not None and call.kind != "embedding":
            # The hold must bound the cost: the node is told the answer size the hold assumed.
            upstream_body.setdefault("max_tokens", max_out)
        max_out *= max(1, int(call.body.get("n") or 1))
        payload = json.dumps(upstream_body).encode()
        reserve = await self.catalog.estimate(
            self.pool, call.body["model"], len(payload), 0 if call.kind == "embedding" else max_out
        )
        match = await self._match(call, stream, reserve)

        assert match.node_id is not None and match.endpoint_url is not None
        node = _Node(match.node_id, match.endpoint_url, match.node_key, match.attempt)
        meter = _Meter(match.job_id, node.id, sent=time.perf_counter())
        route = _Route(call, upstream_body, match.fallback_ids)
        try:
            delivery = await self._deliver(route, meter, node, payload, stream, self._failover)
        except _NoNodeLeft as gone:  # failover_job() has ended the job as failed
            self._count(meter.node_id, "failed")
            kind = errors.UpstreamTimeout if gone.failure.timeout else errors.UpstreamFailed
            raise kind(f"no node could serve the request; last error: {gone.failure}") from None
        except _Rejected as rejected:
            self._count(meter.node_id, "cancelled")
            raise errors.BadRequest(
                "two nodes failed this request the same way, so the request itself is at fault:"
                f" {rejected.failure}"
            ) from None
        except _ClientError as refusal:  # passed through; neutral for the node's reputation
            meter.first_byte = time.perf_counter()
            self._finish_later(call, meter, "cancelled", str(refusal))
            return Response(
                refusal.body,
                status_code=refusal.status,
                media_type=refusal.media_type,
                headers={"x-neuralgrid-node": str(meter.node_id), "x-neuralgrid-job": str(match.job_id)},
            )
        except BaseException as err:
            # The client left while a node was thinking (cancelled), or something broke: the job
            # still ends, and the node's slot is given back.
            outcome = "cancelled" if isinstance(err, asyncio.CancelledError) else "failed"
            reason = "the client disconnected" if outcome == "cancelled" else f"gateway error: {err!r}"
            meter.first_byte = time.perf_counter()
            self._finish_later(call, meter, outcome, reason)
            raise

        meter.first_byte = time.perf_counter()
        overhead = meter.sent - call.received - delivery.waited
        self.metrics.overhead.observe(overhead)
        headers = {
            "x-neuralgrid-node": str(meter.node_id),
            "x-neuralgrid-attempts": str(delivery.node.attempt),
            "x-neuralgrid-job": str(match.job_id),
            "x-neuralgrid-overhead-ms": f"{overhead * 1000:.3f}",
        }
        if not stream:
            return self._complete_response(call, delivery, meter, headers)
        client_wants_usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
        events = SseEvents(keep_usage_event=client_wants_usage)
        relay = self._relay(route, delivery, events, meter)
        return StreamingResponse(relay, media_type="text/event-stream", headers=headers)

    async def _match(self, call: Call, stream: bool, reserve: float) -> Match:
        request = MatchRequest(
            model=call.body["model"],
            policy=call.policy,
            region=call.region,
            max_hourly_rate=call.max_hourly_rate,
        )
        params = match_params(request, call.key.id, stream, self.settings.max_attempts - 1, reserve)
        started = time.perf_counter()
        try:
            async with self.pool.connection() as conn:
                cur = conn.cursor(row_factory=class_row(Match))
                match = await (await cur.execute(MATCH_JOB, params)).fetchone()
        except psycopg.Error as err:
            raise _domain_error(err) from err
        self.metrics.matcher.observe(time.perf_counter() - started)
        assert match is not None
        if match.node_id is None:
            raise errors.NoCapacity(match.error or "no capable node is online", retry_after=2)
        return match

    async def _send(
        self, node: _Node, path: str, payload: bytes, stream: bool
    ) -> tuple[NodeResponse, AsyncIterator[bytes], bytes]:
        """Ask one node. Returns once the answer is committed to: a status that is not a failure,
        and the whole body (plain) or its first chunk (streams). Anything before that is _Retryable."""
        try:
            resp = await self._open(node, path, payload)
            try:
                if (
                    resp.status == 429
                    or (resp.status >= 500 and resp.status != 501)
                    or 300 <= resp.status < 400
                ):
                    body = (await resp.read())[:200].decode(errors="replace")
                    raise _Retryable(f"HTTP {resp.status}: {body}", status=resp.status)
                chunks = resp.chunks()
                if not stream:
                    return resp, chunks, await resp.read()
                if resp.status >= 400:
                    raise _ClientError(resp.status, await resp.read(), resp.content_type)
                return resp, chunks, await anext(chunks)
            except BaseException:
                await resp.close()
                raise
        except NodeTimeout as err:
            raise _Retryable(str(err), timeout=True) from err
        except NodeError as err:
            raise _Retryable(str(err)) from err
        except StopAsyncIteration:
            raise _Retryable("the node ended the stream before its first event") from None

    async def _open(self, node: _Node, path: str, payload: bytes) -> NodeResponse:
        if not node.url.startswith("tunnel:"):
            headers = _node_headers(node.key, path, payload)
            return await self.nodes.post(node.url.rstrip("/") + path, payload, headers)
        tunnel = self.tunnels.get(node.id)
        if tunnel is None:
            raise NodeError("the node's tunnel is not connected to this gateway")
        resp = await tunnel.request(path, payload)
        await resp.start(self.settings.first_byte_timeout_s)
        return resp

    async def _deliver(
        self,
        route: _Route,
        meter: _Meter,
        node: _Node,
        payload: bytes,
        stream: bool,
        move: _Move,
        candidates: list[UUID] | None = None,
    ) -> _Delivery:
        """Send to `node`; each time a node fails before its first byte, `move` the job on to the
        next candidate and send there. The meter follows the job from node to node. When a second
        node fails a new request exactly as the one before it did, the request is at fault: the job
        is rejected (no node to blame) and _Rejected raised."""
        candidates = route.candidates if candidates is None else candidates
        waited = 0.0  # time spent on nodes that failed, which is not the gateway's overhead
        earlier: _Retryable | None = None
        while True:
            meter.node_id, meter.sent = node.id, time.perf_counter()
            try:
                upstream, chunks, first = await self._send(node, PATHS[route.call.kind], payload, stream)
                return _Delivery(node, upstream, chunks, first, waited)
            except _Retryable as failure:
                waited += time.perf_counter() - meter.sent
                if move == self._failover and failure.same_as(earlier):
                    await self._reject(meter.job_id, failure)
                    raise _Rejected(failure) from None
                earlier = failure
                nxt = await move(meter.job_id, failure, candidates)
                if nxt is None:  # counted by whoever ends the job
                    raise _NoNodeLeft(failure) from None
                self._count(node.id, "failed")
                self.metrics.failovers.inc()
                node = nxt

    async def _failover(self, job_id: UUID, failure: _Retryable, candidates: list[UUID]) -> _Node | None:
        """The next node, or None: then failover_job() has ended the job as failed."""
        return await self._move(FAILOVER, (job_id, str(failure), failure.status, candidates))

    async def _handoff(self, job_id: UUID, failure: _Retryable, candidates: list[UUID]) -> _Node | None:
        """The next node, or None: then handoff_job() has left the job as it was."""
        return await self._move(HANDOFF, (job_id, str(failure), candidates))

    async def _continuing(self, candidates: list[UUID]) -> list[UUID]:
        row = await self._row(CONTINUING, (candidates,))
        return list(row[0]) if row else []

    async def _reject(self, job_id: UUID, failure: _Retryable) -> None:
        await self._row(REJECT, (job_id, str(failure), failure.status))

    async def _move(self, query: str, params: tuple[object, ...]) -> _Node | None:
        row = await self._row(query, params)
        return _Node(row[0], row[1], row[2], row[3]) if row else None

    async def _row(self, query: str, params: tuple[object, ...]) -> tuple[Any, ...] | None:
        """One statement off the request pool; its first row, if it returns one."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(query, params)
            return await cur.fetchone() if cur.description else None

    def _complete_response(
        self, call: Call, delivery: _Delivery, meter: _Meter, headers: dict[str, str]
    ) -> Response:
        resp, content = delivery.response, delivery.first
        outcome, error = "succeeded", None
        if resp.status >= 400:  # the client's mistake, told by the node: neutral for the node
            outcome, error = "cancelled", f"HTTP {resp.status} from the node: {content[:200]!r}"
        try:
            usage = Usage.parse(json.loads(content)) if outcome == "succeeded" else None
        except ValueError:
            usage = None
        meter.usage = usage or Usage()
        self._finish_later(call, meter, outcome, error)
        return Response(content, status_code=resp.status, headers=headers, media_type=resp.content_type)

    async def _relay(
        self, route: _Route, delivery: _Delivery, events: SseEvents, meter: _Meter
    ) -> AsyncIterator[bytes]:
        outcome, error = "succeeded", None
        try:
            while True:
                try:
                    for event in events.feed(delivery.first):
                        yield event
                    # Until [DONE]: the answer is then whole, whenever the node hangs up (a tunnel's
                    # end frame may come later than a client that has read [DONE] and left).
                    while not events.done:
                        raw = await anext(delivery.chunks, None)
                        if raw is None:
                            break
                        for event in events.feed(raw):
                            yield event
                    if not events.done:
                        raise NodeError("the node ended the stream without [DONE]")
                    break
                except NodeError as err:
                    await delivery.response.close()
                    resumed = await self._resume(route, events, meter, err)
                    if resumed is None:
                        raise
                    delivery = resumed
        except NodeError as err:
            outcome, error = "failed", f"the node dropped the stream: {err}"
            body = {
                "error": {"message": error, "type": "server_error", "param": None, "code": "upstream_dropped"}
            }
            yield f"data: {json.dumps(body)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except BaseException:
            if not events.done:  # the client went away before the end (cancelled): keep what was used
                outcome, error = "cancelled", "the client disconnected"
            raise
        finally:
            # Recorded before anything is awaited: a client that left cancels every await here.
            meter.usage = events.used()
            self._finish_later(route.call, meter, outcome, error)
            if events.done:  # read the node's answer to its end, so its connection can be kept
                self._later(_read_to_end(delivery))
            else:
                await delivery.response.close()

    async def _resume(
        self, route: _Route, events: SseEvents, meter: _Meter, err: NodeError
    ) -> _Delivery | None:
        """Go on with a dropped stream on another node, or None when it cannot (then the job
        ends failed, with the tokens already streamed)."""
        payload = continuation(route.call.kind, route.body, events) if self.settings.resume_streams else None
        if payload is None:
            return None
        failure, dropped = _Retryable(f"the node dropped the stream: {err}"), meter.node_id
        try:
            candidates = route.candidates
            if route.call.kind == "chat":  # only a server verified to go on with an open message
                candidates = await self._continuing(candidates)
            node = await self._handoff(meter.job_id, failure, candidates)
            if node is None:
                return None
            self._count(dropped, "failed")
            delivery = await self._deliver(route, meter, node, payload, True, self._handoff, candidates)
        except (_NoNodeLeft, _ClientError) as refused:
            log.warning("job %s: no node went on with the stream: %s", meter.job_id, refused)
            return None
        except psycopg.Error:
            log.exception("could not hand job %s to another node", meter.job_id)
            return None
        finally:
            if meter.node_id != dropped:  # the job's end describes the node it ends on
                meter.first_byte = time.perf_counter()
        log.info("job %s: stream resumed on node %s after: %s", meter.job_id, meter.node_id, err)
        self.metrics.failovers.inc()
        self.metrics.resumes.inc()
        events.resumed()
        return delivery

    def _finish_later(self, call: Call, meter: _Meter, outcome: str, error: str | None) -> None:
        """Record the end off the request's path (not a BackgroundTask: that would hold the
        keep-alive connection until the database answered). A client that leaves cannot cancel it."""
        self._later(self._finish(call, meter, outcome, error))

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(self, call: Call, meter: _Meter, outcome: str, error: str | None) -> None:
        """Record the attempt's end: usage, cost, reputation; then charge the token rate limit."""
        now = time.perf_counter()
        usage = meter.usage or Usage()
        end = JobEnd(
            meter.job_id,
            outcome,
            usage.prompt_tokens,
            usage.completion_tokens,
            ttft_ms=(meter.first_byte - meter.sent) * 1000,
            latency_ms=(now - meter.sent) * 1000,
            error=error,
        )
        try:
            if await self.completions.record(end) is None:
                log.warning("job %s had already ended (swept?) when its completion came", meter.job_id)
        except psycopg.Error:
            log.exception("could not complete job %s", meter.job_id)
        self._count(meter.node_id, outcome)
        await self.limiter.spend_tokens(call.key, usage.prompt_tokens + usage.completion_tokens)

    async def drain(self) -> None:
        """Wait for the jobs still being recorded (on shutdown)."""
        if self._finishing:
            await asyncio.gather(*self._finishing, return_exceptions=True)
        await self.completions.drain()

    def _count(self, node_id: UUID, outcome: str) -> None:
        self.metrics.attempts.labels(outcome).inc()
        self.metrics.node_outcomes.labels(str(node_id), outcome).inc()


@dataclass
class _Meter:
    """What a job's end records; follows the job from node to node."""

    job_id: UUID
    node_id: UUID
    sent: float  # when the current node was asked
    first_byte: float = 0.0
    usage: Usage | None = None  # set when the answer is over (SseEvents.used() for streams)


class _Node(NamedTuple):
    id: UUID
    url: str
    key: bytes | None
    attempt: int


@dataclass(frozen=True)
class _Route:
    """A call on its way: the body nodes are sent, and the nodes it may move on to."""

    call: Call
    body: dict[str, Any]
    candidates: list[UUID]


@dataclass(frozen=True)
class _Delivery:
    """A node's committed answer: its response, body chunks and first bytes (plain: the whole body)."""

    node: _Node
    response: NodeResponse
    chunks: AsyncIterator[bytes]
    first: bytes
    waited: float


class _Rejected(Exception):
    """Two nodes failed the request the same way: the request is at fault, and reject_job() ended it."""

    def __init__(self, failure: _Retryable) -> None:
        super().__init__(str(failure))
        self.failure = failure


class _NoNodeLeft(Exception):
    def __init__(self, failure: _Retryable) -> None:
        super().__init__(str(failure))
        self.failure = failure


_Move = Callable[[UUID, _Retryable, list[UUID]], Awaitable[_Node | None]]


async def _read_to_end(delivery: _Delivery) -> None:
    """What a node sends after [DONE] (its end of stream, at once), read so that its connection goes
    back to the pool; one that lingers is closed."""
    try:
        async with asyncio.timeout(1.0):
            async for _ in delivery.chunks:
                pass
    except (TimeoutError, NodeError):
        pass
    finally:
        await delivery.response.close()


def _node_headers(key: bytes | None, path: str, payload: bytes) -> dict[str, str]:
    """Headers for a node; signed when the node runs an agent (it has a key)."""
    headers = {"content-type": "application/json"}
    if key is not None:
        headers[signing.HEADER] = signing.sign(key, path, payload)
    return headers


def _domain_error(err: psycopg.Error) -> Exception:
    domain = db_errors.translate(err)
    if isinstance(domain, db_errors.UnknownModel):
        return errors.NotFound(str(domain), param="model")
    if isinstance(domain, db_errors.BudgetExhausted):
        return errors.BudgetExceeded(str(domain), retry_after=60)
    if isinstance(domain, db_errors.InvalidRequest):
        return errors.BadRequest(str(domain))
    return domain
