"""Challenges: this gateway checks that nodes serve the models they claim (issue 39).

Where the operator runs a referee (neuralgrid/verify/referee.py: the reference models, by their
files' sha256), the gateway asks SQL which (node, model)s of those artifacts are due a challenge
(due_challenges(): at random times, more often for suspects), places each on its node as a paid job
of the platform's own key (place_challenge()), sends it as any request is sent (signed, with its
key's cache salt, through the node's tunnel if it has one), ends the job as any job ends, has the
referee score the answer and records the verdicts in SQL (record_challenges()), which keeps the
sequential test, the states and their consequences. Python decides one challenge's verdict
(verify/verdict.py); SQL decides what the verdicts add up to.

Where no referee of this gateway holds a pinned model's artifact (a Hugging Face revision, a GGUF it
lacks), the (node, model)s due are cross-checked (due_cross_checks(), `cross_check()`): the node and
a peer serving the same artifact answer the same challenge with their log-probabilities, and where
their answers part each token must be a near tie in the other's distribution (verify/agreement.py);
when they disagree, a second peer decides and the odd one out fails.

A share of real traffic is audited the same way (`audit()`, `audit_stream()`): a short greedy chat
answer to a user's message, whole or streamed, whose request says nothing else that changes the
answer, is scored after it was delivered and counts as a challenge would. A node that could tell
challenges from such traffic gains nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline.kinds import PATHS
from neuralgrid.gateway.pipeline.meter import Bounds, Meter, Metering
from neuralgrid.gateway.pipeline.place import Node
from neuralgrid.gateway.pipeline.send import Retryable, Sender
from neuralgrid.gateway.prompt_cache import PromptCaches
from neuralgrid.protocol import wire_json
from neuralgrid.protocol.sse import Usage
from neuralgrid.verify import agreement
from neuralgrid.verify import challenge as challenges
from neuralgrid.verify.client import RefereeClient, RefereeError, Unscorable
from neuralgrid.verify.verdict import Verdict, judge, refused, unreadable, unscorable

log = logging.getLogger(__name__)

ARTIFACTS_EVERY_S = 60.0  # how often the referee is asked which models it holds
AUDITS_WAITING = 8  # audits queued for the referee at most; more are not taken (traffic is not held up)
STOP_GRACE_S = 5.0  # on shutdown, how long challenges under way may take to end their jobs
FINISHES = ("stop", "length")  # why a greedy chat answer may end


class NoFreeSlot(Exception):
    """The node had no free slot for a challenge."""


@dataclass
class Outcome:
    """A challenge's verdict, as record_challenges() takes it."""

    due: q.Due
    job_id: UUID
    verdict: Verdict
    detail: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "node": str(self.due.node_id),
            "model": self.due.model_id,
            "job": str(self.job_id),
            "passed": self.verdict.passed,
            "distance": self.verdict.distance,
            "detail": {**self.verdict.detail, **self.detail},
        }


@dataclass(frozen=True)
class Answered:
    """A node's chat answer: its text, why it ended, and how many tokens it was asked for at most."""

    text: str
    finish: str
    max_tokens: int | None
    steps: list[agreement.Step] | None = None  # its tokens and their candidates, when asked for


@dataclass(frozen=True)
class Audit:
    """A client's answer to score: whose, and what was asked and answered."""

    due: q.Due
    job_id: UUID
    messages: list[dict[str, str]]
    answered: Answered


def read_answer(content: bytes, max_tokens: int | None) -> Answered | Verdict:
    """A chat completion's answer, or the verdict on one that is no greedy chat answer at all."""
    try:
        choice = wire_json.loads_answer(content)["choices"][0]
        text, finish = choice["message"]["content"] or "", choice["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        return unreadable()
    return answered(text, finish, max_tokens, agreement.steps(choice.get("logprobs")))


def answered(
    text: Any, finish: Any, max_tokens: int | None, steps: list[agreement.Step] | None = None
) -> Answered | Verdict:
    """A chat answer's text and why it ended (a whole answer's, or a stream's put together)."""
    if not isinstance(text, str) or finish not in FINISHES:
        return unreadable()
    try:
        text.encode()
    except UnicodeEncodeError:  # JSON may carry a lone surrogate: no text a model writes
        return unscorable("text that is not Unicode")
    return Answered(text, finish, max_tokens, steps)


class Verifier:
    def __init__(
        self,
        store: Store,
        gateway_id: UUID,
        referee: RefereeClient | None,
        sender: Sender,
        metering: Metering,
        caches: PromptCaches,
        metrics: Metrics,
        *,
        in_flight: int = 2,
        every_s: float = 1.0,
        audit_share: float = 0.0,
        cross_checks: bool = True,
    ) -> None:
        self.store = store
        self.gateway_id = gateway_id
        self.referee = referee
        self.sender = sender
        self.metering = metering
        self.caches = caches
        self.metrics = metrics
        self.in_flight = in_flight  # challenges at once: the referee scores one at a time
        self.every_s = every_s
        self.audit_share = audit_share  # of auditable answers, the share scored
        self.cross_checks = cross_checks  # where the referee holds no reference: nodes against each other
        self._audits: asyncio.Queue[Audit] = asyncio.Queue(AUDITS_WAITING)
        self._artifacts: list[str] = []
        self._pinned: dict[str, str] = {}  # model -> the sha256 of its GGUF, for those the referee holds
        self._artifacts_at = -ARTIFACTS_EVERY_S
        self._contexts: dict[str, int] = {}
        self._challenging: set[asyncio.Task[None]] = set()
        self._key_id: UUID | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Challenge what is due, every `every_s`, and score the audits taken, until stopped."""
        auditing = asyncio.get_running_loop().create_task(self._score_audits())
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # a database or referee hiccup: the next tick tries again
                log.exception("challenges: this round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)
        auditing.cancel()
        if self._challenging:  # let them end their jobs; those that cannot are ended as cancelled
            _, late = await asyncio.wait(set(self._challenging), timeout=STOP_GRACE_S)
            for task in late:
                task.cancel()
        await asyncio.gather(auditing, *self._challenging, return_exceptions=True)

    async def tick(self) -> None:
        """One round: take what is due (as many as there is room for) and challenge each: against
        the referee where it holds the artifact, else against other nodes (cross_check.py)."""
        free = self.in_flight - len(self._challenging)
        if free <= 0:
            return
        held = await self._held()
        if held:
            for due in await self.store.all(q.DUE_CHALLENGES, (held, free)):
                self._spawn(self._challenge_and_record(due), f"challenge of node {due.node_id}")
                free -= 1
        if self.cross_checks and free > 0:
            for crossing in await self.store.all(q.DUE_CROSS_CHECKS, (held, free)):
                self._spawn(self.cross_check(crossing), f"cross-check of node {crossing.node_id}")

    def _spawn(self, work: Coroutine[Any, Any, None], what: str) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._challenging.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._challenging.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("%s failed", what, exc_info=task.exception())

        task.add_done_callback(done)

    async def _held(self) -> list[str]:
        """The sha256s of the GGUFs the referee holds (none without one), read again every
        ARTIFACTS_EVERY_S with the catalog's context lengths."""
        if time.monotonic() - self._artifacts_at >= ARTIFACTS_EVERY_S:
            self._artifacts = []
            if self.referee is not None:
                try:
                    self._artifacts = await self.referee.artifacts()
                except RefereeError as err:
                    log.warning("challenges against the referee paused: %s", err)
            self._artifacts_at = time.monotonic()
            self._contexts = {m.id: m.context_length for m in await self.store.all(q.MODEL_KINDS)}
            self._pinned = dict(await self.store.all(q.ARTIFACTS, (self._artifacts,)))
        return self._artifacts

    async def _challenge_and_record(self, due: q.Due) -> None:
        outcome = await self.challenge(due)
        if outcome is not None:
            await self._record(outcome, "")

    async def _record(self, outcome: Outcome, kind: str) -> None:
        await self.record([outcome], kind)

    async def record(self, outcomes: list[Outcome], kind: str) -> None:
        for outcome in outcomes:
            self.metrics.challenges.labels(kind + ("passed" if outcome.verdict.passed else "failed")).inc()
        if outcomes:
            await self.store.all(q.RECORD_CHALLENGES, (json.dumps([o.as_json() for o in outcomes]),))

    def context_of(self, model: str) -> int:
        return self._contexts.get(model, 2048)

    async def challenge(self, due: q.Due) -> Outcome | None:
        """Ask one node one challenge and judge its answer; None when there is no verdict (the node
        had no free slot, failed as a node fails, or the referee could not score)."""
        asked = challenges.make(self.context_of(due.model_id))
        try:
            job_id, answer = await self.answer_of(due.node_id, due.model_id, asked)
        except NoFreeSlot:  # busy: due again in a few seconds
            self.metrics.challenges.labels("deferred").inc()
            await self.store.all(q.DEFER_CHALLENGE, (due.node_id, due.model_id))
            return None
        if answer is None:
            return None
        if isinstance(answer, Verdict):
            return Outcome(due, job_id, answer, {"long": asked.long})
        return await self._judge(due, job_id, asked.messages, answer, {"long": asked.long}, evidence=True)

    async def cross_check(self, due: q.DueCrossCheck) -> None:
        """A challenge whose artifact the referee does not hold: the node's answer against its
        peers' answers to the same challenge, token by token where they part (verify/agreement.py),
        recorded as a challenge's is. A peer found the odd one out is recorded as failing it too; a
        node that gives no log-probabilities when asked cannot be compared, and fails."""
        if not due.peers:  # no other node serves it now: due again at its next time
            self.metrics.challenges.labels("inconclusive").inc()
            return
        asked = challenges.make(self.context_of(due.model_id))
        detail: dict[str, Any] = {"long": asked.long, "cross_check": True}
        outcomes: list[Outcome] = []

        async def steps_of(node_id: UUID) -> tuple[UUID, list[agreement.Step]] | None:
            """The node's answer as steps, or None (recorded when it is a failure)."""
            job_id, answer = await self.answer_of(node_id, due.model_id, asked, agreement.TOP_LOGPROBS)
            if isinstance(answer, Answered) and answer.steps is None:
                answer = unscorable("an answer without the log-probabilities asked for")
            if isinstance(answer, Verdict):  # it refused, or answered nothing comparable
                outcomes.append(Outcome(q.Due(node_id, due.model_id, "", ""), job_id, answer, detail))
            return (
                (job_id, answer.steps) if isinstance(answer, Answered) and answer.steps is not None else None
            )

        try:
            mine = await steps_of(due.node_id)
        except NoFreeSlot:
            self.metrics.challenges.labels("deferred").inc()
            await self.store.all(q.DEFER_CHALLENGE, (due.node_id, due.model_id))
            return
        peers: list[tuple[UUID, UUID, list[agreement.Step]]] = []
        for peer in due.peers:
            if mine is None or (peers and (len(peers) == 2 or agreement.agree(mine[1], peers[0][2]))):
                break  # nothing to compare, or decided
            with contextlib.suppress(NoFreeSlot):
                if (theirs := await steps_of(peer)) is not None:
                    peers.append((peer, *theirs))
        if mine is not None:
            decision = agreement.decide(mine[1], [answer for _, _, answer in peers])
            found = detail | {"peers": [str(peer) for peer, _, _ in peers], "reason": decision.reason}
            if decision.passed is None:
                self.metrics.challenges.labels("inconclusive").inc()
            else:
                subject = q.Due(due.node_id, due.model_id, "", due.state)
                outcomes.append(Outcome(subject, mine[0], Verdict(decision.passed, None, found), {}))
            if decision.odd_peer is not None:
                peer, peer_job, _ = peers[decision.odd_peer]
                odd = found | {"checked_with": str(due.node_id)}
                outcomes.append(
                    Outcome(q.Due(peer, due.model_id, "", ""), peer_job, Verdict(False, None, odd), {})
                )
        await self.record(outcomes, "cross-check ")

    async def answer_of(
        self, node_id: UUID, model: str, asked: challenges.Challenge, logprobs: int = 0
    ) -> tuple[UUID, Answered | Verdict | None]:
        """A challenge's job on `node_id` (a paid job of the platform's key on a free slot) and the
        node's answer: a greedy chat answer, a verdict without the referee (it refused, or answered
        no chat answer), or None when it failed as a node fails. The job has ended when this
        returns. NoFreeSlot when the node has none."""
        key_id = self._key_id
        if key_id is None:
            found: UUID = await self.store.get(q.CHALLENGE_KEY)
            key_id = self._key_id = found
        body = asked.body(model, logprobs)
        self.caches.apply("chat", body, key_id)  # its own key's salt, as every request has
        payload = json.dumps(body).encode()
        placed = await self.store.one(q.PLACE_CHALLENGE, (str(self.gateway_id), node_id, model))
        if placed is None:
            raise NoFreeSlot(node_id)
        meter = Meter(
            placed.job_id,
            placed.node_id,
            sent=time.perf_counter(),
            model=model,
            bounds=Bounds(len(payload), asked.max_tokens),
        )
        try:
            return placed.job_id, await self._ask(placed, payload, asked, meter)
        except BaseException:  # cancelled, or broken: the job still ends and its slot is given back
            meter.first_byte = meter.first_byte or time.perf_counter()
            self.metering.finish(meter, "cancelled", "the challenge was stopped")
            raise

    async def _judge(
        self,
        due: q.Due,
        job_id: UUID,
        messages: list[dict[str, str]],
        answered: Answered,
        detail: dict[str, Any],
        evidence: bool = False,
    ) -> Outcome | None:
        """The referee's verdict on an answer. `evidence`: a failure keeps the messages, the answer
        and its gaps (for a challenge, whose prompt is the platform's: never for audited traffic),
        for the owner to see and anyone to score again."""
        assert self.referee is not None  # only what the referee holds is judged here
        try:
            scores = await self.referee.score(due.sha256, messages, answered.text, answered.finish)
        except Unscorable as why:
            return Outcome(due, job_id, unscorable(str(why)), detail)
        except RefereeError as err:
            log.warning("challenge of node %s (%s) not scored: %s", due.node_id, due.model_id, err)
            self.metrics.challenges.labels("inconclusive").inc()
            return None
        self.metrics.referee_cpu.observe(scores.cpu_s)
        verdict = judge(
            scores.gaps,
            finish=answered.finish,
            answer_tokens=scores.answer_tokens,
            max_tokens=answered.max_tokens,
        )
        detail = {**detail, "prompt_tokens": scores.prompt_tokens, "finish_reason": answered.finish}
        if evidence and not verdict.passed:
            gaps = [round(gap, 3) for gap in scores.gaps]
            detail |= {"messages": messages, "answer": answered.text, "gaps": gaps}
        return Outcome(due, job_id, verdict, detail)

    async def _ask(
        self, placed: q.PlacedChallenge, payload: bytes, asked: challenges.Challenge, meter: Meter
    ) -> Answered | Verdict | None:
        """The node's answer, a verdict without the referee (it refused, or answered no greedy chat
        answer), or None when it failed as a node fails (health's business: no verdict). The job has
        ended when this returns."""
        node = Node(placed.node_id, placed.endpoint_url, placed.node_key, placed.attempt)
        timeout = self.sender.first_byte_timeout(False, asked.max_tokens, placed.tokens_per_s)
        try:
            resp, _, content = await self.sender.send(node, PATHS["chat"], payload, False, timeout)
        except Retryable as failure:
            meter.first_byte = time.perf_counter()
            self.metering.finish(meter, failure.outcome, str(failure))
            self.metrics.challenges.labels("inconclusive").inc()
            return None
        meter.first_byte = time.perf_counter()
        if resp.status >= 400:  # ended as any refused request: neutral for the node's reputation
            await self.metering.end(meter, "cancelled", f"HTTP {resp.status} from the node")
            return refused(resp.status, content.decode(errors="replace"), asked.long)
        with contextlib.suppress(ValueError):
            meter.usage = Usage.parse(wire_json.loads_answer(content)) or Usage()
        await self.metering.end(meter, "succeeded", None)
        return read_answer(content, asked.max_tokens)

    def audit(self, node_id: UUID, model: str, job_id: UUID, body: dict[str, Any], answer: bytes) -> None:
        """A delivered whole chat answer: scored later as a challenge is, if drawn and auditable."""
        if self._drawn(model, body):
            self._take(node_id, model, job_id, body, read_answer(answer, challenges.answer_limit(body)))

    def audit_stream(
        self, node_id: UUID, model: str, job_id: UUID, body: dict[str, Any], text: str, finish: str
    ) -> None:
        """A delivered chat stream, its text put together: audited as a whole answer is."""
        if self._drawn(model, body):
            self._take(node_id, model, job_id, body, answered(text, finish, challenges.answer_limit(body)))

    def _drawn(self, model: str, body: dict[str, Any]) -> bool:
        return model in self._pinned and random.random() < self.audit_share

    def _take(
        self, node_id: UUID, model: str, job_id: UUID, body: dict[str, Any], answer: Answered | Verdict
    ) -> None:
        messages = challenges.auditable(body)
        if messages is None or not isinstance(answer, Answered):
            return  # the client got it as it was; a node's unreadable answer is health's to count
        due = q.Due(node_id, model, self._pinned[model], "")
        with contextlib.suppress(asyncio.QueueFull):  # the referee is behind: this one goes unaudited
            self._audits.put_nowait(Audit(due, job_id, messages, answer))

    async def _score_audits(self) -> None:
        while True:
            audit = await self._audits.get()
            try:
                outcome = await self._judge(
                    audit.due, audit.job_id, audit.messages, audit.answered, {"audit": True}
                )
                if outcome is not None:
                    await self._record(outcome, "audit ")
            except Exception:  # the next audit is scored all the same
                log.exception("audit of node %s not recorded", audit.due.node_id)
