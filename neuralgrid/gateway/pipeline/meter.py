"""Stage 5, meter: a job's end (usage, timings, outcome) written by complete_jobs() in SQL, then
charged to the key's token limit. With leases off a delivered answer waits for the write (its slot
is then free); with leases on every end the journal can write (leased or SQL placed) is written
behind (pipeline/leased.py). A job that ends otherwise (failed, cancelled) is written in the
background."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg

from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.queries import JobEnd, JobOutcome
from neuralgrid.gateway.completions import Completions, NotWritten
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.ratelimit import BYTES_PER_TOKEN, RateLimiter, TokenHold
from neuralgrid.protocol.sse import Usage

if TYPE_CHECKING:
    from neuralgrid.gateway.pipeline.leased import LeasedJobs

log = logging.getLogger(__name__)
# How long an answer is held for its job's ending to be written (its node's slot freed) before it is
# delivered anyway: only a database that is down or overloaded takes this long.
RELEASE_WAIT_S = 2.0
DRAIN_S = 5.0  # on shutdown, how long the endings under way may take beyond writing them
# A prompt is at most a token a byte (byte-level tokenizers), plus what the server's chat template
# adds around it (a default system prompt, tool instructions): the most a node may report for one.
TEMPLATE_TOKENS = 1024


@dataclass(frozen=True)
class Bounds:
    """What a request can use, known when it is admitted: a node's account of usage is not trusted
    past it (a node could bill any key whatever it liked), and an answer cut off before the node's
    account came is charged its prompt as estimated here."""

    prompt_bytes: int  # the request's body, as the node was sent it
    max_output_tokens: int | None  # over all choices; None for a kind with no answer limit
    prompt_limit: int | None = None  # for media by reference, the model's context (admit.py)

    def settle(self, usage: Usage) -> Usage:
        most_prompt = max(self.prompt_bytes + TEMPLATE_TOKENS, self.prompt_limit or 0)
        prompt = usage.prompt_tokens
        if not prompt and usage.completion_tokens:  # tokens came, the node's account did not
            prompt = -(-self.prompt_bytes // BYTES_PER_TOKEN)
        most_completion = most_prompt if self.max_output_tokens is None else self.max_output_tokens
        return Usage(min(prompt, most_prompt), min(usage.completion_tokens, most_completion))


@dataclass
class Meter:
    """What a job's end records; follows the job from node to node."""

    job_id: UUID
    node_id: UUID
    sent: float  # when the current node was asked
    first_byte: float = 0.0
    usage: Usage | None = None  # set when the answer is over
    tpm_hold: TokenHold | None = None  # what admission held on the key's tpm limit, settled at the end
    model: str = ""  # a model some node serves (the job was placed): a bounded metrics label
    stream: bool = False
    bounds: Bounds | None = None  # None: the node's account as it is (tests of the meter alone)


class Metering:
    """Ends jobs in tasks of its own: a client that leaves cannot cancel the write. A delivered
    answer waits for its write (end()), which completions.py batches with the others under way."""

    def __init__(
        self,
        completions: Completions,
        limiter: RateLimiter,
        metrics: Metrics,
        leased: LeasedJobs | None = None,
    ) -> None:
        self.leased = leased  # jobs served from this gateway's leases, ended behind
        self.completions = completions
        self.limiter = limiter
        self.metrics = metrics
        self._pending: set[asyncio.Task[None]] = set()

    def finish(self, meter: Meter, outcome: JobOutcome, error: str | None) -> asyncio.Future[None]:
        """End the job, its write in the background; the future is done once its ending is written
        (its node's slot free again) or could not be. A leased job's slot is free on return: its
        end is written behind, and the answer does not wait for it."""
        now = time.perf_counter()
        usage = meter.usage or Usage()
        if meter.bounds is not None:
            usage = meter.bounds.settle(usage)
        end = JobEnd(
            meter.job_id,
            outcome,
            usage.prompt_tokens,
            usage.completion_tokens,
            ttft_ms=(meter.first_byte - meter.sent) * 1000,
            latency_ms=(now - meter.sent) * 1000,
            error=error,
        )
        behind = None
        if self.leased is not None:
            try:
                behind = self.leased.end(end)  # its slot free first, whatever comes of the spool
            except OSError:  # the spool could not be written (a full disk): SQL's own path ends it
                log.exception("job %s: its end could not be spooled", meter.job_id)
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if behind is not None:
            written.set_result(None)
        if behind is not None and meter.tpm_hold is None:  # nothing to settle: no task to wait in
            behind.add_done_callback(lambda done: self._counted(meter, end, usage, now, _outcome(done), None))
        else:
            self.later(self._finish(meter, end, usage, now, behind, written))
        return written

    async def end(self, meter: Meter, outcome: JobOutcome, error: str | None) -> None:
        """End the job and wait until its node's slot is free, so that the client's next request
        finds it free: answers are delivered after this. Bounded by RELEASE_WAIT_S (a database that
        is down or overloaded), and a client that leaves meanwhile does not stop the write."""
        written = self.finish(meter, outcome, error)
        if not written.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(written), RELEASE_WAIT_S)

    def abandon(self, job_id: UUID) -> None:
        """End a job placed for a client that had left by then (claims.py): nothing was sent."""
        end = JobEnd(job_id, "cancelled", error="the client disconnected while its request was placed")
        self.later(self._abandon(end))

    async def _abandon(self, end: JobEnd) -> None:
        try:
            await self.completions.record(end)
        except (psycopg.Error, DatabaseError, NotWritten):
            log.error("could not end job %s, placed after its client left", end.job_id, exc_info=True)

    def later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _finish(
        self,
        meter: Meter,
        end: JobEnd,
        usage: Usage,
        now: float,
        behind: asyncio.Future[Decimal | None] | None,
        written: asyncio.Future[None],
    ) -> None:
        tokens = usage.prompt_tokens + usage.completion_tokens
        try:
            # The key's tpm is settled alongside the write, so both are done when the answer goes.
            recorded, settled = await asyncio.gather(
                self.completions.record(end) if behind is None else behind,
                self.limiter.settle(meter.tpm_hold, tokens),
                return_exceptions=True,
            )
        finally:
            if not written.done():
                written.set_result(None)
        self._counted(meter, end, usage, now, recorded, settled)

    def _counted(
        self, meter: Meter, end: JobEnd, usage: Usage, now: float, recorded: object, settled: object
    ) -> None:
        """The job's end in the metrics, once written (`recorded`: its cost, or what went wrong)."""
        outcome = end.status
        if recorded is None:
            log.warning("job %s had already ended (swept?) when its completion came", meter.job_id)
        elif isinstance(recorded, (psycopg.Error, DatabaseError)):
            log.error("could not complete job %s", meter.job_id, exc_info=recorded)
        elif isinstance(recorded, BaseException) and not isinstance(recorded, NotWritten):
            raise recorded  # NotWritten: given up on shutdown, counted by Completions in one line
        if isinstance(settled, BaseException):
            log.error("could not settle the tpm charge of job %s", meter.job_id, exc_info=settled)
        self.metrics.count(meter.node_id, outcome)
        cost = float(recorded) if isinstance(recorded, float | Decimal) else None
        self.metrics.ended(meter.model, outcome, usage, cost, self._timings(meter, outcome, usage, now))

    @staticmethod
    def _timings(meter: Meter, outcome: JobOutcome, usage: Usage, now: float) -> tuple[float, float] | None:
        """A whole stream's time to first token and time per output token after it (vLLM's two
        latency metrics); None for a plain answer, whose first byte is its last."""
        if not meter.stream or outcome != "succeeded" or not meter.first_byte:
            return None
        later_tokens = max(usage.completion_tokens - 1, 1)
        return meter.first_byte - meter.sent, (now - meter.first_byte) / later_tokens

    async def drain(self) -> None:
        """Wait for the jobs still being recorded (on shutdown). Their endings are handed in first
        (a task's first step hands its ending in), so that the completions' drain bounds how long
        they are retried while the database is down; waiting for the tasks first would not. What
        else they wait for (a tpm settlement on a Redis that does not answer) gets DRAIN_S."""
        await asyncio.sleep(0)
        await self.completions.drain()
        if not self._pending:
            return
        _, stuck = await asyncio.wait(set(self._pending), timeout=DRAIN_S)
        if stuck:
            log.error("%d job endings were still under way %.0f s into shutdown; left", len(stuck), DRAIN_S)
            for task in stuck:
                task.cancel()


def _outcome(done: asyncio.Future[Decimal | None]) -> object:
    """What a finished write came to: its cost (None: not written), or its error."""
    return None if done.cancelled() else (done.exception() or done.result())
