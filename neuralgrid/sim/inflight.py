"""A request in flight in the simulation: its state across attempts, and the slot each attempt holds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from neuralgrid.sim.prewarm import Job
from neuralgrid.sim.scenarios import Request


class Req:
    """One request, across its attempts."""

    __slots__ = (
        "arrival",
        "attempt",
        "caller",
        "claimed",
        "id",
        "job",
        "kv_bytes",
        "left",
        "model",
        "node",
        "output",
        "placement",
        "prompt",
        "state",
        "tried",
        "waited_load",
    )

    def __init__(self, rid: int, request: Request, kv_bytes: float) -> None:
        self.id = rid
        self.arrival, self.model, self.caller, self.prompt, self.output = request
        self.kv_bytes = kv_bytes  # KV cache read per decode step, at the answer's mean context
        self.attempt = 1
        self.tried: set[int] = set()
        self.node = -1
        self.claimed = 0.0
        self.left = 0.0  # output tokens still to decode
        self.state = "new"  # queued | loading | prefill | decode | doomed | served | failed
        self.waited_load = False
        self.placement: Placement | None = None
        self.job: Job | None = None  # as pre-warm's demand counts it


@dataclass
class Placement:
    """A slot held: on which node, for a model needing how much VRAM, from when to when."""

    node: int
    need_gb: float
    start: float
    end: float = math.inf
