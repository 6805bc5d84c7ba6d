"""Stage 4, relay: a node's stream passed on event by event, and, when the node drops it, resumed
on another node that goes on with the answer so far (or ended with an OpenAI-style error event)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple
from uuid import UUID

import psycopg
from prometheus_client import Histogram
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.queries import JobOutcome
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline.admit import Admitted
from neuralgrid.gateway.pipeline.meter import Meter, Metering
from neuralgrid.gateway.pipeline.place import Placement
from neuralgrid.gateway.pipeline.send import ClientError, Delivery, NoNodeLeft, Sender
from neuralgrid.gateway.tunnel import MISDIRECTED, TunnelUnreachable
from neuralgrid.gateway.upstream import NodeError
from neuralgrid.protocol.sse import NotAnAnswer, ResponseEvents, SseEvents

log = logging.getLogger(__name__)
# Streams are passed on as they come: no cache keeps one, and no proxy in front (nginx reads
# X-Accel-Buffering) holds its events back to send them in bulk.
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# vLLM's request fields for guided decoding (OpenAI's is response_format).
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
# Events a stream may have besides a token's each (two, with a slack): the role's, the finish, usage,
# keep-alives, the Responses API's lifecycle events.
EXTRA_EVENTS = 1024
# A job still running at its deadline (platform_settings.job_deadline_s) is ended by the sweep as
# failed, unbilled. So a stream is cut off this long before it: the gateway ends its job, charged
# for what the node sent. A client that does not read (its writes wait) is given up CUT_GRACE_S later.
CUT_EARLY_S = 10.0
CUT_GRACE_S = 5.0
# Reading the node is timed against the cut-off only in its last minute: a timer per chunk costs
# several µs, and before then a silent node is ended by its read timeout (30 s) well before the cut.
TIMED_S = 60.0


class JobDeadline:
    """How long a job may run, as the gateway's last check-in read it: when its streams are cut."""

    def __init__(self, seconds: float = 900.0) -> None:
        self.seconds = seconds

    def learned(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def cut(self, received: float) -> tuple[float, float]:
        """When a stream of a request received then (time.perf_counter()) is cut off, and when one
        whose client does not read is given up: both before the sweep would end its job."""
        early = min(CUT_EARLY_S, self.seconds / 2)
        cut = received + self.seconds - early
        return cut, cut + min(CUT_GRACE_S, early / 2)


class PastDeadline(Exception):
    """The stream reached its cut-off before its end."""


class CutStream(StreamingResponse):
    """A stream given up at `give_up` (time.perf_counter()) if it is still being written then: a
    client that stops reading holds the write, and the stream's events with it, for as long as it
    likes. Closing the events ends the job (see Relay.events)."""

    def __init__(self, content: AsyncIterator[bytes], give_up: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.give_up = give_up

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + self.give_up - time.perf_counter()):
                await super().__call__(scope, receive, send)
        except TimeoutError:
            log.warning("a stream's client read too slowly to have it before the job deadline: cut off")
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


class Relay:
    def __init__(
        self,
        sender: Sender,
        placement: Placement,
        metering: Metering,
        metrics: Metrics,
        resume_streams: bool,
        deadline: JobDeadline | None = None,
    ) -> None:
        self.sender = sender
        self.placement = placement
        self.metering = metering
        self.metrics = metrics
        self.resume_streams = resume_streams
        self.deadline = deadline or JobDeadline()
        # Streams that model verification may audit (gateway/verifier.py): (node, model, job, the
        # client's body, the answer's text, why it ended); set by the app when a referee is configured.
        self.audit: Callable[[UUID, str, UUID, dict[str, Any], str, str], None] | None = None

    def response(
        self,
        admitted: Admitted,
        delivery: Delivery,
        meter: Meter,
        candidates: list[UUID],
        headers: dict[str, str],
    ) -> StreamingResponse:
        """The client's stream as a response, cut off before its job's deadline."""
        cut, give_up = self.deadline.cut(admitted.call.received)
        events = self.events(admitted, delivery, meter, candidates, cut)
        return CutStream(events, give_up, media_type="text/event-stream", headers=headers)

    async def events(
        self,
        admitted: Admitted,
        delivery: Delivery,
        meter: Meter,
        candidates: list[UUID],
        cut: float = math.inf,
    ) -> AsyncIterator[bytes]:
        """The client's stream; the job ends (metered) however the stream does. A whole answer's
        job is ended before its last event ([DONE]; the Responses API's response.completed) is
        passed on, so the slot is free when the client is told. At `cut` (time.perf_counter()) a
        stream still going ends with an error event, its job charged for what the node sent."""
        wants_usage = bool((admitted.call.body.get("stream_options") or {}).get("include_usage"))
        most = 2 * admitted.max_output_tokens + EXTRA_EVENTS if admitted.max_output_tokens else None
        events = ResponseEvents(most) if admitted.call.kind == "responses" else SseEvents(wants_usage, most)
        outcome: JobOutcome = "succeeded"
        error: str | None = None
        ended = False
        gaps = TokenGaps(self.metrics.child(self.metrics.inter_token, admitted.call.model))
        try:
            while True:
                try:
                    # Until the last event: the answer is then whole, whenever the node hangs up (a
                    # tunnel's end frame may come later than a client that has read it and left).
                    last = gaps.fed(events, delivery.first)
                    while not events.done:
                        if last:  # a chunk's events in one write: each write costs the same, however small
                            yield b"".join(last)
                        if (left := cut - time.perf_counter()) > TIMED_S:
                            raw = await anext(delivery.chunks, None)
                        else:
                            try:
                                async with asyncio.timeout(max(left, 0)):
                                    raw = await anext(delivery.chunks, None)
                            except TimeoutError:
                                raise PastDeadline() from None
                        if raw is None:
                            raise NodeError("the node ended the stream before its last event")
                        last = gaps.fed(events, raw)
                    break
                except NodeError as err:
                    await delivery.response.close()
                    resumed = await self._resume(admitted, events, meter, candidates, err)
                    if resumed is None:
                        raise
                    delivery = resumed
            if len(last) > 1:
                yield b"".join(last[:-1])
            meter.usage, ended = events.used(), True
            await self.metering.end(meter, outcome, error)
            if self.audit is not None and admitted.call.kind == "chat" and audited(events):
                self.audit(
                    meter.node_id,
                    admitted.call.model,
                    meter.job_id,
                    admitted.body,
                    "".join(events.text),
                    str(events.finish_reason),
                )
            yield last[-1]  # [DONE], or the Responses API's last event
        except NodeError as err:
            drop = Drop.of(err)
            outcome, error = drop.outcome, drop.message
            for event in _stream_error(admitted.call.kind, error):
                yield event
        except PastDeadline:  # neither the node's fault nor the client's: charged, neutral
            outcome, error = "cancelled", f"the stream passed the job deadline ({self.deadline.seconds:g} s)"
            for event in _stream_error(admitted.call.kind, error, "deadline_exceeded"):
                yield event
        except BaseException:
            if not events.done:  # the client went away before the end (cancelled): keep what was used
                outcome, error = "cancelled", "the client disconnected"
                if time.perf_counter() >= cut:
                    error = "the client did not read the stream before the job deadline"
            raise
        finally:
            # Recorded before anything is awaited: a client that left cancels every await here.
            if not ended:
                meter.usage = events.used()
                self.metering.finish(meter, outcome, error)
            if events.done:  # read the node's answer to its end, so its connection can be kept
                self.metering.later(_read_to_end(delivery))
            else:
                await delivery.response.close()

    async def _resume(
        self, admitted: Admitted, events: SseEvents, meter: Meter, candidates: list[UUID], err: NodeError
    ) -> Delivery | None:
        """Go on with a dropped stream on another node, or None when it cannot (then the job ends
        failed, with the tokens already streamed)."""
        kind = admitted.call.kind
        payload = continuation(kind, admitted.body, events) if self.resume_streams else None
        if payload is None:
            return None
        dropped, drop = meter.node_id, Drop.of(err)
        try:
            if kind == "chat":  # only a server verified to go on with an open message
                candidates = await self.placement.continuing(candidates)
            node = await self.placement.handoff(meter.job_id, drop.message, drop.status, candidates)
            if node is None:
                return None
            self.metrics.count(dropped, drop.outcome)
            delivery = await self.sender.deliver(kind, payload, True, meter, node, candidates, resuming=True)
        except (NoNodeLeft, ClientError) as refused:
            log.warning("job %s: no node went on with the stream: %s", meter.job_id, refused)
            return None
        except (psycopg.Error, DatabaseError):
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


def audited(events: SseEvents) -> bool:
    """Whether a whole chat stream's text is one answer from one node, as an audit needs: plain
    text of one choice, ended with a reason, never resumed (a second node wrote its end)."""
    return events.plain_text and events.finish_reason is not None and not events.resumes


def _stream_error(kind: str, message: str, code: str = "upstream_dropped") -> list[bytes]:
    """How a stream that cannot go on ends, in its API's own terms: the Responses API's `error` event
    (its streams have no [DONE]), else an error body and [DONE] as OpenAI's chat streams end."""
    if kind == "responses":
        event = {"type": "error", "code": code, "message": message, "param": None}
        return [f"event: error\ndata: {json.dumps(event)}\n\n".encode()]
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return [f"data: {json.dumps(body)}\n\n".encode(), b"data: [DONE]\n\n"]


class Drop(NamedTuple):
    """Whose failure a dropped stream is, as the job and its attempt record it."""

    outcome: JobOutcome
    message: str
    status: int | None  # for handoff_job(): 421 ends the dropped attempt neutral for the node

    @classmethod
    def of(cls, err: NodeError) -> Drop:
        # A holder of the node's tunnel that broke off is the platform's failure; anything else the
        # node dropped is the node's.
        if isinstance(err, TunnelUnreachable):
            return cls("cancelled", str(err), MISDIRECTED)
        return cls("failed", f"the node dropped the stream: {err}", None)


async def _read_to_end(delivery: Delivery) -> None:
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


class TokenGaps:
    """The inter-token latency of one stream: the wait before each chunk from the node, shared among
    the token events it carries (a chunk of three after 30 ms: three gaps of 10 ms). The first token's
    wait is the time to first token, measured elsewhere."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.last_token: float | None = None

    def fed(self, events: SseEvents, raw: bytes) -> list[bytes]:
        before = events.chunks
        try:
            out = events.feed(raw)
        except NotAnAnswer as err:  # the node's fault, as a stream it broke off
            raise NodeError(str(err)) from None
        tokens = events.chunks - before
        if tokens > 0:
            now = time.perf_counter()
            if self.last_token is not None:
                gap = (now - self.last_token) / tokens
                for _ in range(tokens):
                    self.histogram.observe(gap)
            elif tokens > 1:  # the first token's chunk: the others in it came with no wait
                for _ in range(tokens - 1):
                    self.histogram.observe(0.0)
            self.last_token = now
        return out


def continuation(kind: str, body: dict[str, Any], events: SseEvents) -> bytes | None:
    """The request that has another node go on with a dropped stream, or None when it cannot.

    Chat: the conversation plus the answer so far as an open assistant message, with vLLM's
    `continue_final_message` (the node goes on with that message instead of starting a new one).
    Completions: the prompt plus the text so far. The token limit shrinks by what was streamed."""
    if events.finished or not events.plain_text or body.get("n") not in (None, 1) or body.get("echo"):
        return None
    form = body.get("response_format")
    if any(body.get(key) for key in GUIDED) or (isinstance(form, dict) and form.get("type") != "text"):
        return None  # a grammar restarted mid-answer would not hold: JSON mode, schemas, guided output
    text = "".join(events.text)
    if not text:  # nothing but a role so far: ask again
        return json.dumps(body).encode()
    body = dict(body)
    for limit in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(limit), int):
            body[limit] -= events.tokens()
            if body[limit] < 1:
                return None
    if kind == "chat":
        messages = list(body.get("messages") or [])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") and isinstance(last, dict) and last.get("role") == "assistant":
            if not isinstance(last.get("content"), str):
                return None
            messages[-1] = {**last, "content": last["content"] + text}  # the client's own prefill
        else:
            messages.append({"role": "assistant", "content": text})
        body.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
    elif kind == "completion" and isinstance(body.get("prompt"), str):
        body["prompt"] += text
    else:
        return None
    return json.dumps(body).encode()
