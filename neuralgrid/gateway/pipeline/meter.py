"""Stage 5, meter: a job's end (usage, timings, outcome) written by complete_jobs() in SQL, off the
request's path, then charged to the key's token limit."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg

from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.queries import JobEnd, JobOutcome
from neuralgrid.gateway.auth import ApiKey
from neuralgrid.gateway.completions import Completions, NotWritten
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.ratelimit import RateLimiter
from neuralgrid.protocol.sse import Usage

log = logging.getLogger(__name__)


@dataclass
class Meter:
    """What a job's end records; follows the job from node to node."""

    job_id: UUID
    node_id: UUID
    sent: float  # when the current node was asked
    first_byte: float = 0.0
    usage: Usage | None = None  # set when the answer is over


class Metering:
    """Ends jobs in the background: a client that leaves cannot cancel the write, and the response
    does not wait for it (a BackgroundTask would hold the keep-alive connection until it is done)."""

    def __init__(self, completions: Completions, limiter: RateLimiter, metrics: Metrics) -> None:
        self.completions = completions
        self.limiter = limiter
        self.metrics = metrics
        self._pending: set[asyncio.Task[None]] = set()

    def finish(self, key: ApiKey, meter: Meter, outcome: JobOutcome, error: str | None) -> None:
        self.later(self._finish(key, meter, outcome, error))

    def later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _finish(self, key: ApiKey, meter: Meter, outcome: JobOutcome, error: str | None) -> None:
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
        except NotWritten:
            pass  # given up on shutdown: Completions counted these in one line
        except (psycopg.Error, DatabaseError):
            log.exception("could not complete job %s", meter.job_id)
        self.metrics.count(meter.node_id, outcome)
        await self.limiter.spend_tokens(key, usage.prompt_tokens + usage.completion_tokens)

    async def drain(self) -> None:
        """Wait for the jobs still being recorded (on shutdown). Their endings are handed in first
        (a task's first step hands its ending in), so that the completions' drain bounds how long
        they are retried while the database is down; waiting for the tasks first would not."""
        await asyncio.sleep(0)
        await self.completions.drain()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
