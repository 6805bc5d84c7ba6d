"""One request's way through the platform: match in SQL, forward, fail over, relay, meter.

A node that fails before its first byte (refused, timed out, 5xx, 429) is recorded by
failover_job(), which cools it down and claims the next fallback. After the first byte a stream is
committed: a node that drops it ends the stream with an OpenAI-style error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import class_row
from psycopg_pool import AsyncConnectionPool
from starlette.responses import Response, StreamingResponse

from neuralgrid import signing
from neuralgrid.config import Settings
from neuralgrid.db import errors as db_errors
from neuralgrid.gateway import errors
from neuralgrid.gateway.completions import Completions
from neuralgrid.gateway.keys import ApiKey
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.ratelimit import RateLimiter
from neuralgrid.gateway.tunnel import Tunnels
from neuralgrid.gateway.upstream import HttpNodes, NodeError, NodeResponse, NodeTimeout
from neuralgrid.matching import MATCH_JOB, JobEnd, Match, MatchRequest, match_params

log = logging.getLogger(__name__)

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings"}
FAILOVER = "select node_id, endpoint_url, node_key, attempt from public.failover_job(%s, %s, %s, %s::uuid[])"
CATALOG = "select id, input_usd_per_mtok::float8, output_usd_per_mtok::float8 from public.models"
MAX_REPORTED_TOKENS = 10_000_000


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


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def parse(cls, payload: Any) -> Usage | None:
        """The node's own account of usage, if it is a plausible one (nodes are not trusted)."""
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if not isinstance(usage, dict):
            return None
        counts = [usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0]
        if not all(type(c) is int and 0 <= c <= MAX_REPORTED_TOKENS for c in counts):  # not bools
            return None
        return cls(counts[0], counts[1])


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


class Catalog:
    """Catalog prices, for the budget hold each request places; reloaded every minute."""

    def __init__(self) -> None:
        self.prices: dict[str, tuple[float | None, float | None]] = {}
        self.loaded_at = float("-inf")

    async def estimate(self, pool: AsyncConnectionPool, model: str, prompt_bytes: int, max_out: int) -> float:
        if time.monotonic() - self.loaded_at > 60:
            async with pool.connection() as conn:
                rows = await (await conn.execute(CATALOG)).fetchall()
            self.prices = {r[0]: (r[1], r[2]) for r in rows}
            self.loaded_at = time.monotonic()
        price_in, price_out = self.prices.get(model, (None, None))
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

        node_id, url, key, attempt = match.node_id, match.endpoint_url, match.node_key, match.attempt
        assert node_id is not None and url is not None
        waited = 0.0  # time spent waiting on nodes, which is not the gateway's overhead
        sent = time.perf_counter()
        try:
            while True:
                sent = time.perf_counter()
                try:
                    upstream, chunks, first = await self._send(
                        node_id, url, key, PATHS[call.kind], payload, stream
                    )
                    break
                except _Retryable as failure:
                    waited += time.perf_counter() - sent
                    self._count(node_id, "failed")
                    nxt = await self._failover(match.job_id, failure, match.fallback_ids)
                    if nxt is None:  # failover_job() has ended the job as failed
                        kind = errors.UpstreamTimeout if failure.timeout else errors.UpstreamFailed
                        raise kind(f"no node could serve the request; last error: {failure}") from None
                    self.metrics.failovers.inc()
                    node_id, url, key, attempt = nxt
        except errors.GatewayError:
            raise
        except _ClientError as refusal:  # passed through; neutral for the node's reputation
            now = time.perf_counter()
            self._finish_later(call, _Meter(match.job_id, node_id, sent, now), "cancelled", str(refusal))
            return Response(
                refusal.body,
                status_code=refusal.status,
                media_type=refusal.media_type,
                headers={"x-neuralgrid-node": str(node_id), "x-neuralgrid-job": str(match.job_id)},
            )
        except BaseException as err:
            # The client left while a node was thinking (cancelled), or something broke: the job
            # still ends, and the node's slot is given back.
            outcome = "cancelled" if isinstance(err, asyncio.CancelledError) else "failed"
            reason = "the client disconnected" if outcome == "cancelled" else f"gateway error: {err!r}"
            now = time.perf_counter()
            self._finish_later(call, _Meter(match.job_id, node_id, sent, now), outcome, reason)
            raise

        first_byte = time.perf_counter()
        waited += first_byte - sent
        overhead = first_byte - call.received - waited
        self.metrics.overhead.observe(overhead)
        headers = {
            "x-neuralgrid-node": str(node_id),
            "x-neuralgrid-attempts": str(attempt),
            "x-neuralgrid-job": str(match.job_id),
            "x-neuralgrid-overhead-ms": f"{overhead * 1000:.3f}",
        }
        meter = _Meter(job_id=match.job_id, node_id=node_id, sent=sent, first_byte=first_byte)
        if not stream:
            return self._complete_response(call, upstream, first, meter, headers)
        client_wants_usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
        relay = self._relay(call, upstream, chunks, first, meter, client_wants_usage)
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
        self, node_id: UUID, url: str, key: bytes | None, path: str, payload: bytes, stream: bool
    ) -> tuple[NodeResponse, AsyncIterator[bytes], bytes]:
        """Ask one node. Returns once the answer is committed to: a status that is not a failure,
        and the whole body (plain) or its first chunk (streams). Anything before that is _Retryable."""
        try:
            resp = await self._open(node_id, url, key, path, payload)
            try:
                if resp.status == 429 or resp.status >= 500 or 300 <= resp.status < 400:
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

    async def _open(
        self, node_id: UUID, url: str, key: bytes | None, path: str, payload: bytes
    ) -> NodeResponse:
        if not url.startswith("tunnel:"):
            return await self.nodes.post(url.rstrip("/") + path, payload, _node_headers(key, path, payload))
        tunnel = self.tunnels.get(node_id)
        if tunnel is None:
            raise NodeError("the node's tunnel is not connected to this gateway")
        resp = await tunnel.request(path, payload)
        await resp.start(self.settings.first_byte_timeout_s)
        return resp

    async def _failover(
        self, job_id: UUID, failure: _Retryable, candidates: list[UUID]
    ) -> tuple[UUID, str, bytes | None, int] | None:
        async with self.pool.connection() as conn:
            row = await (
                await conn.execute(FAILOVER, (job_id, str(failure), failure.status, candidates))
            ).fetchone()
        return (row[0], row[1], row[2], row[3]) if row else None

    def _complete_response(
        self, call: Call, resp: NodeResponse, content: bytes, meter: _Meter, headers: dict[str, str]
    ) -> Response:
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
        self,
        call: Call,
        resp: NodeResponse,
        chunks: AsyncIterator[bytes],
        first: bytes,
        meter: _Meter,
        client_wants_usage: bool,
    ) -> AsyncIterator[bytes]:
        outcome, error = "succeeded", None
        events = _SseEvents(meter, client_wants_usage)
        try:
            for event in events.feed(first):
                yield event
            async for raw in chunks:
                for event in events.feed(raw):
                    yield event
            if not events.done:
                raise NodeError("the node ended the stream without [DONE]")
        except NodeError as err:
            outcome, error = "failed", f"the node dropped the stream: {err}"
            body = {
                "error": {"message": error, "type": "server_error", "param": None, "code": "upstream_dropped"}
            }
            yield f"data: {json.dumps(body)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except BaseException:  # the client went away (cancelled): keep what was used
            outcome, error = "cancelled", "the client disconnected"
            raise
        finally:
            await resp.close()
            self._finish_later(call, meter, outcome, error)

    def _finish_later(self, call: Call, meter: _Meter, outcome: str, error: str | None) -> None:
        """Record the end off the request's path (not a BackgroundTask: that would hold the
        keep-alive connection until the database answered). A client that leaves cannot cancel it."""
        task = asyncio.get_running_loop().create_task(self._finish(call, meter, outcome, error))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(self, call: Call, meter: _Meter, outcome: str, error: str | None) -> None:
        """Record the attempt's end: usage, cost, reputation; then charge the token rate limit."""
        now = time.perf_counter()
        # A node that reports no usage is charged by what was seen: a token per streamed chunk.
        usage = meter.usage or Usage(0, meter.chunks)
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
    job_id: UUID
    node_id: UUID
    sent: float
    first_byte: float
    usage: Usage | None = None
    chunks: int = 0


class _SseEvents:
    """Splits the node's SSE bytes into whole events, notes usage, and drops the usage-only event
    the gateway asked for on the client's behalf."""

    def __init__(self, meter: _Meter, keep_usage_event: bool) -> None:
        self.meter = meter
        self.keep_usage_event = keep_usage_event
        self.buffer = b""
        self.done = False

    def feed(self, raw: bytes) -> list[bytes]:
        self.buffer += raw
        out: list[bytes] = []
        while b"\n\n" in self.buffer:
            event, self.buffer = self.buffer.split(b"\n\n", 1)
            if self._keep(event):
                out.append(event + b"\n\n")
        return out

    def _keep(self, event: bytes) -> bool:
        data = event.removeprefix(b"data: ").strip()
        if data == b"[DONE]":
            self.done = True
            return True
        self.meter.chunks += 1
        if b'"usage"' not in data:
            return True
        try:
            payload = json.loads(data)
        except ValueError:
            return True
        usage = Usage.parse(payload)
        if usage is None:
            return True
        self.meter.usage = usage
        self.meter.chunks -= 1
        return self.keep_usage_event or bool(payload.get("choices"))


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
