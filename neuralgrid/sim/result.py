"""What a run of the simulation measured, for one policy, and its summary as the report shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from neuralgrid.sim.physics import BIG_MODEL
from neuralgrid.sim.scenarios import MODEL_IDS


@dataclass
class Result:
    policy: str
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    served_by_model: dict[str, int] = field(default_factory=dict)
    failed_by_model: dict[str, int] = field(default_factory=dict)
    refused: int = 0  # no capable node online, the line full, or waited past the queue timeout
    lost: int = 0  # failed over until no fallback was left
    load_waits: int = 0  # served requests that waited for a model load (started or under way)
    loads: int = 0  # model loads started
    prewarm_loads: int = 0  # of those, started by pre-warm
    prewarm_used: int = 0  # pre-loads a request used before the model was evicted or lost
    prewarm_unused_gb_s: float = 0.0  # VRAM held by pre-loaded models until first use (or eviction)
    retries: int = 0
    tokens: int = 0
    bill_usd: float = 0.0
    supply_usd: float = 0.0
    vram_idle_gb: list[float] = field(default_factory=list)
    busy_slot_s: dict[str, float] = field(default_factory=dict)
    slot_s: dict[str, float] = field(default_factory=dict)

    @property
    def served(self) -> int:
        return sum(self.served_by_model.values())

    @property
    def failed(self) -> int:
        return sum(self.failed_by_model.values())

    def summary(self) -> dict[str, Any]:
        total = self.served + self.failed
        by_model = {}
        for m in MODEL_IDS:
            served, failed = self.served_by_model.get(m, 0), self.failed_by_model.get(m, 0)
            if served + failed:
                by_model[m] = _pct(served, served + failed)
        return {
            "policy": self.policy,
            "requests": total,
            "served": self.served,
            "failed": self.failed,
            "served_pct": _pct(self.served, total),
            "big_model_served_pct": by_model.get(BIG_MODEL, 0.0),
            "served_pct_by_model": by_model,
            "p50_s": _q(self.latencies, 50),
            "p95_s": _q(self.latencies, 95),
            "p99_s": _q(self.latencies, 99),
            "ttft_p50_s": _q(self.ttfts, 50),
            "ttft_p95_s": _q(self.ttfts, 95),
            "supply_usd_per_mtok": round(1e6 * self.supply_usd / max(self.tokens, 1), 4),
            "bill_usd_per_mtok": round(1e6 * self.bill_usd / max(self.tokens, 1), 4),
            "cold_start_pct": _pct(self.load_waits, self.served),
            "loads": self.loads,
            "prewarm_loads": self.prewarm_loads,
            "prewarm_used_pct": _pct(self.prewarm_used, self.prewarm_loads),
            "prewarm_unused_gb_s": round(self.prewarm_unused_gb_s, 1),
            "retries": self.retries,
            "lost_to_churn": self.lost,
            "refused": self.refused,
            "vram_idle_gb_mean": round(float(np.mean(self.vram_idle_gb)), 2) if self.vram_idle_gb else 0.0,
            "utilization_by_gpu": {
                g: round(self.busy_slot_s.get(g, 0.0) / s, 4) for g, s in sorted(self.slot_s.items()) if s
            },
        }


def _pct(part: int, whole: int) -> float:
    return round(100 * part / whole, 3) if whole else 0.0


def _q(values: list[float], q: float) -> float | None:
    """A percentile, or None when nothing was served."""
    return round(float(np.percentile(values, q)), 3) if values else None
