"""One request's way through the platform, as five stages with one job each:

admit   catalog check, rate limit, the body nodes get, the budget hold      (admit.py)
place   place_job() in SQL claims a node and names fallbacks, or waits a turn (place.py)
send    ask the node; failover_job() moves the job on if it fails first     (send.py)
relay   pass a stream on; handoff_job() resumes it if the node drops it     (relay.py)
meter   the job's end written in SQL (behind the answer, with leases on)    (meter.py)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from starlette.responses import Response

from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.queries import JobOutcome
from neuralgrid.gateway import errors
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline.admit import Admission, Admitted, Call
from neuralgrid.gateway.pipeline.kinds import ANSWER_LIMIT
from neuralgrid.gateway.pipeline.meter import Bounds, Meter, Metering
from neuralgrid.gateway.pipeline.place import QUEUE_MS, Placement, queue_ms
from neuralgrid.gateway.pipeline.relay import STREAM_HEADERS, Relay
from neuralgrid.gateway.pipeline.send import ClientError, Delivery, NoNodeLeft, Rejected, Sender
from neuralgrid.protocol import wire_json
from neuralgrid.protocol.sse import Usage

__all__ = ["Call", "Pipeline"]


class Pipeline:
    def __init__(
        self,
        admission: Admission,
        placement: Placement,
        sender: Sender,
        relay: Relay,
        metering: Metering,
        metrics: Metrics,
    ) -> None:
        self.admission = admission
        self.placement = placement
        self.sender = sender
        self.relay = relay
        self.metering = metering
        self.metrics = metrics
        # Whole answers that model verification may audit (gateway/verifier.py): (node, model, job,
        # the body the node was sent, its answer). None: no referee.
        self.audit: Callable[[UUID, str, UUID, dict[str, Any], bytes], None] | None = None

    async def handle(self, call: Call) -> Response:
        admitted = await self.admission.admit(call)
        try:
            return await self._serve(call, admitted)
        except errors.GatewayError as err:  # a refusal after admission still tells the key's limits
            err.headers = {**admitted.limit_headers, **(err.headers or {})}
            raise
        except DatabaseError as err:  # e.g. the budget is spent: the same, in the API's terms
            refusal = errors.from_database(err)
            refusal.headers = dict(admitted.limit_headers)
            raise refusal from err

    async def _serve(self, call: Call, admitted: Admitted) -> Response:
        try:
            placed = await self.placement.place(admitted)
        except BaseException:  # refused, or the client left while waiting in line: nothing was used
            self.metering.later(self.metering.limiter.release(admitted.tpm_hold))
            raise
        admitted = placed.admitted
        meter = Meter(
            placed.job_id,
            placed.node.id,
            sent=time.perf_counter(),
            tpm_hold=admitted.tpm_hold,
            model=call.model,
            stream=admitted.stream,
            bounds=Bounds(
                len(admitted.payload),
                admitted.max_output_tokens if call.kind in ANSWER_LIMIT else None,
                admitted.prompt_limit,
            ),
        )
        try:
            delivery = await self.sender.deliver(
                call.kind,
                admitted.payload,
                admitted.stream,
                meter,
                placed.node,
                placed.candidates,
                answer_tokens=admitted.max_output_tokens,
                speeds=placed.speeds,
                content_type=admitted.content_type,
            )
        except Rejected as rejected:  # reject_job() has ended the job: no tokens were used
            self.metering.later(self.metering.limiter.release(meter.tpm_hold))
            self.metrics.count(meter.node_id, "cancelled")
            raise errors.BadRequest(
                "two nodes failed this request the same way, so the request itself is at fault:"
                f" {rejected.failure}"
            ) from None
        except NoNodeLeft as gone:  # failover_job() has ended the job as failed, no tokens used
            self.metering.later(self.metering.limiter.release(meter.tpm_hold))
            self.metrics.count(meter.node_id, gone.failure.outcome)
            kind = errors.UpstreamTimeout if gone.failure.timeout else errors.UpstreamFailed
            raise kind(f"no node could serve the request; last error: {gone.failure}") from None
        except ClientError as refusal:  # passed through; neutral for the node's reputation
            meter.first_byte = time.perf_counter()
            await self.metering.end(meter, "cancelled", str(refusal))  # the slot is free first
            headers = {
                **admitted.limit_headers,
                "x-neuralgrid-node": str(meter.node_id),
                "x-neuralgrid-job": str(meter.job_id),
            }
            return errors.from_node(refusal.status, refusal.body, refusal.media_type, headers)
        except BaseException as err:
            # The client left while a node was thinking (cancelled), or something broke: the job
            # still ends, and the node's slot is given back.
            outcome: JobOutcome = "cancelled" if isinstance(err, asyncio.CancelledError) else "failed"
            reason = "the client disconnected" if outcome == "cancelled" else f"gateway error: {err!r}"
            meter.first_byte = time.perf_counter()
            self.metering.finish(meter, outcome, reason)
            raise

        meter.first_byte = time.perf_counter()
        # The gateway's overhead is everything from arrival to answering but the node's own time and
        # the time spent waiting for a slot or on nodes that failed. A whole answer is timed once it
        # is metered, just before it leaves; a stream when its first event does.
        not_ours = _node_time(meter, delivery, admitted.stream) + delivery.waited + placed.waited
        headers = {
            **admitted.limit_headers,
            "x-neuralgrid-node": str(meter.node_id),
            "x-neuralgrid-attempts": str(delivery.node.attempt),
            "x-neuralgrid-job": str(meter.job_id),
            QUEUE_MS: queue_ms(placed.waited),
        }
        if admitted.stream:
            self._stamp_overhead(headers, call.received, not_ours)
            return self.relay.response(admitted, delivery, meter, placed.candidates, headers | STREAM_HEADERS)
        return await self._answer(admitted, delivery, meter, headers, call.received, not_ours)

    def _stamp_overhead(self, headers: dict[str, str], received: float, not_ours: float) -> None:
        overhead = time.perf_counter() - received - not_ours
        self.metrics.overhead.observe(overhead)
        headers["x-neuralgrid-overhead-ms"] = f"{overhead * 1000:.3f}"

    async def _answer(
        self,
        admitted: Admitted,
        delivery: Delivery,
        meter: Meter,
        headers: dict[str, str],
        received: float,
        not_ours: float,
    ) -> Response:
        """A whole (non-streamed) answer, metered from the usage it reports."""
        resp, content = delivery.response, delivery.first
        outcome: JobOutcome = "succeeded"
        error: str | None = None
        if resp.status >= 400:  # the client's mistake, told by the node: neutral for the node
            outcome, error = "cancelled", f"HTTP {resp.status} from the node: {content[:200]!r}"
        try:
            usage = Usage.parse(wire_json.loads_answer(content)) if outcome == "succeeded" else None
        except ValueError:  # not JSON, or nested past what can be read: passed on unread
            usage = None
        meter.usage = usage or Usage()
        await self.metering.end(meter, outcome, error)  # the slot is free first
        if self.audit is not None and outcome == "succeeded" and admitted.call.kind == "chat":
            self.audit(meter.node_id, admitted.call.model, meter.job_id, admitted.body, content)
        self._stamp_overhead(headers, received, not_ours)
        if resp.status >= 400:
            return errors.from_node(resp.status, content, resp.content_type, headers)
        if resp.status in (204, 205, 304):
            content = b""
        return Response(content, status_code=resp.status, headers=headers, media_type=resp.content_type)

    async def drain(self) -> None:
        await self.metering.drain()


def _node_time(meter: Meter, delivery: Delivery, stream: bool) -> float:
    """The node's own time on the request that it answered: from when it had the whole request to
    a stream's first event, or to a whole answer's end (when it came with its headers, as servers
    send one, the time they were in; else once read). Where the way there does not tell when the
    request was written (tunnels), from sending it."""
    timing = delivery.response.timing
    if timing is None or not timing.asked:
        return meter.first_byte - meter.sent
    return (meter.first_byte if stream or not timing.answered else timing.answered) - timing.asked
