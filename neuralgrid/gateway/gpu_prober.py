"""GPU probes: this gateway checks that nodes have the GPUs they claim (issue 39, part 3).

SQL says which nodes are due (due_gpu_probes(): every node with an agent, once proven every
platform_settings.gpu_probe_every_s); for each, the gateway asks the node's agent, signed as any
request is and through its tunnel if it has one, to fill a share of one claimed GPU's memory from a
nonce (NEURALGRID_GPU_PROBE_FILL_SHARE: the server holds much of the rest), then times the digests of
a second nonce (neuralgrid/verify/gpu_probe.py), checks probe.CHECKS blocks it picks afterwards on its own
CPU, judges the bandwidth the time shows against the claimed GPU's datasheet, and records the outcome
in SQL (record_gpu_probe()), which keeps the states and the matcher's hard filter. The agent's NVML
report plays no part: it is what is being checked.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
import secrets
import time
from typing import Any

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline.place import Node
from neuralgrid.gateway.pipeline.send import Retryable, Sender
from neuralgrid.verify import gpu_probe as probe

log = logging.getLogger(__name__)

PINGS = 3  # round trips timed before the digests, the fastest taken off their time
FILL_TIMEOUT_S = 300.0
DIGEST_TIMEOUT_S = 120.0


def fill_size(vram_gb: float, gpu_count: int, share: float, block_bytes: int = probe.BLOCK_BYTES) -> int:
    """The bytes a probe fills: `share` of one GPU's claimed memory, in whole blocks."""
    per_gpu = vram_gb / max(gpu_count, 1) * 2**30
    return max(1, int(per_gpu * share) // block_bytes) * block_bytes


class GpuProber:
    def __init__(
        self,
        store: Store,
        sender: Sender,
        metrics: Metrics,
        *,
        fill_share: float = 0.5,
        every_s: float = 2.0,
        in_flight: int = 1,
    ) -> None:
        self.store, self.sender, self.metrics = store, sender, metrics
        self.fill_share = fill_share
        self.every_s = every_s
        self.in_flight = in_flight  # probes at once: each checks blocks on this gateway's CPU
        self._probing: set[asyncio.Task[str | None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # a database hiccup: the next tick tries again
                log.exception("GPU probes: this round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)
        for task in self._probing:
            task.cancel()
        await asyncio.gather(*self._probing, return_exceptions=True)

    async def tick(self) -> None:
        free = self.in_flight - len(self._probing)
        if free <= 0:
            return
        for due in await self.store.all(q.DUE_GPU_PROBES, (free,)):
            task = asyncio.get_running_loop().create_task(self.probe_and_record(due))
            self._probing.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[str | None]) -> None:
        self._probing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # due again in ten minutes
            log.error("GPU probe failed", exc_info=task.exception())

    async def probe_and_record(self, due: q.DueProbe) -> str | None:
        """Probe one node and record what it showed; the proof's state after, or None when the node
        failed as a node fails (unreachable: health's business, probed again in ten minutes)."""
        try:
            outcome, detail = await self.probe(due)
        except Retryable as err:
            log.info("GPU probe of node %s: the node did not answer (%s)", due.node_id, err)
            self.metrics.gpu_probes.labels("unreachable").inc()
            return None
        self.metrics.gpu_probes.labels(outcome).inc()
        state: str = await self.store.get(q.RECORD_GPU_PROBE, (due.node_id, outcome, json.dumps(detail)))
        return state

    async def probe(self, due: q.DueProbe) -> tuple[str, dict[str, Any]]:
        node = Node(due.node_id, due.endpoint_url, due.node_key, 1)
        datasheet = probe.bandwidth_for(due.gpu_model)
        size = fill_size(due.vram_gb, due.gpu_count, self.fill_share)
        plan = probe.Plan(secrets.token_hex(16), size)
        fill = {"op": "fill", "nonce": plan.nonce, "bytes": plan.size, "block_bytes": plan.block_bytes}
        status, filled = await self._ask(node, fill, FILL_TIMEOUT_S)
        if status == 200 and filled.get("gpu") is False:
            return "no_gpu", {"reason": str(filled.get("reason", "no GPU"))[:300]}
        if status != 200 or filled.get("gpu") is not True:
            return "refused", {"reason": _why(status, filled), "bytes": plan.size}
        device = str(filled.get("device", ""))[:100]
        rtt = await self._round_trip(node)
        nonce2 = secrets.token_hex(16)
        started = time.perf_counter()
        status, answered = await self._ask(node, {"op": "digest", "nonce": nonce2}, DIGEST_TIMEOUT_S)
        seconds = time.perf_counter() - started
        detail: dict[str, Any] = {
            "bytes": plan.size,
            "device": device,
            "device_is_claimed": device == due.gpu_model,  # both the agent's word: a consistency check only
            "seconds": round(seconds, 4),
            "rtt_s": round(rtt, 4),
        }
        if status != 200:
            return "refused", {**detail, "reason": _why(status, answered)}
        digests = _digests(answered.get("digests"), plan.blocks)
        if digests is None:
            return "wrong", {**detail, "reason": f"the answer is not {plan.blocks} digests"}
        picks = random.sample(range(plan.blocks), min(probe.CHECKS, plan.blocks))
        wrong = await asyncio.to_thread(probe.wrong_digests, plan, nonce2, digests, picks)
        if wrong:
            reason = f"{len(wrong)} of {len(picks)} blocks checked are not what the fill makes"
            return "wrong", {**detail, "wrong_blocks": wrong, "reason": reason}
        if datasheet is None:  # a GPU the table does not know: its data is proven, not its speed
            return "passed", {**detail, "reason": f"no datasheet bandwidth known for {due.gpu_model[:60]}"}
        judged = probe.judge(plan.size, seconds, rtt, datasheet)  # one GPU's
        detail |= {"gbps": judged.gbps, "datasheet_gbps": judged.datasheet_gbps}
        if not judged.passed:
            share = judged.gbps / judged.datasheet_gbps
            reason = f"{judged.gbps:.1f} GB/s is {share:.1%} of a {due.gpu_model[:60]}'s {datasheet:.0f} GB/s"
            return "slow", {**detail, "reason": reason}
        return "passed", detail

    async def _round_trip(self, node: Node) -> float:
        fastest = float("inf")
        for _ in range(PINGS):
            started = time.perf_counter()
            await self._ask(node, {"op": "ping"}, 10.0)
            fastest = min(fastest, time.perf_counter() - started)
        return fastest

    async def _ask(self, node: Node, body: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
        payload = json.dumps(body).encode()
        resp, _, content = await self.sender.send(node, probe.PATH, payload, False, timeout_s)
        try:
            answer = json.loads(content)
        except ValueError:
            answer = {}
        return resp.status, answer if isinstance(answer, dict) else {}


def _digests(value: Any, blocks: int) -> list[int] | None:
    """The answer's digests as integers, or None unless it is exactly `blocks` of them."""
    if not isinstance(value, str):
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return None
    if len(raw) != blocks * 8:
        return None
    return [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]


def _why(status: int, answer: dict[str, Any]) -> str:
    error = answer.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return f"HTTP {status}: {str(message or 'no reason given')[:200]}"
