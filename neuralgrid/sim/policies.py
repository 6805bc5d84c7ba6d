"""The SQL matching policies as vectorized numpy, for simulating thousands of requests per second.

`score()` mirrors score_nodes(): the same hard filters, the same components, the same weights
(read from matching_policies), ties broken the same way (node id). tests/test_sim.py checks the
ranking equals the SQL's on thousands of random cases, so the simulator decides as production does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F = npt.NDArray[np.float64]
B = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Weights:
    fit: float
    compute: float
    price: float
    warm: float
    capacity: float
    reputation: float
    proximity: float
    compute_half_tflops: float = 100.0
    price_half_usd_per_tflop_hour: float = 0.003
    distance_half_km: float = 1000.0

    @property
    def total(self) -> float:
        return (
            self.fit
            + self.compute
            + self.price
            + self.warm
            + self.capacity
            + self.reputation
            + self.proximity
        )


@dataclass
class FleetArrays:
    """Per-node columns (index = node order, which is also the tie-break order)."""

    vram_gb: F
    tflops: F
    hourly_rate: F
    region: npt.NDArray[np.int64]
    inflight: npt.NDArray[np.int64]
    max_concurrency: npt.NDArray[np.int64]
    successes: F
    failures: F
    online: B


def score(
    policy: str,
    weights: Weights | None,
    fleet: FleetArrays,
    min_vram_gb: float,
    holds: B,
    loaded: B,
    caller_region: int | None,
    max_hourly_rate: float | None = None,
) -> tuple[npt.NDArray[np.int64], F]:
    """Eligible node indexes, best first, and their scores (as score_nodes ranks them)."""
    ok = fleet.online & (fleet.vram_gb >= min_vram_gb)
    if max_hourly_rate is not None:
        ok &= fleet.hourly_rate <= max_hourly_rate
    if policy == "seed":
        s = (
            0.3 * (fleet.vram_gb / min_vram_gb)
            + 0.5 * (fleet.tflops / 100.0)
            + 0.2 * (1.0 / (fleet.hourly_rate + 0.01))
        )
    else:
        assert weights is not None
        ok &= holds & (fleet.inflight < fleet.max_concurrency)
        w = weights
        fit = np.minimum(1.0, min_vram_gb / fleet.vram_gb)
        compute = fleet.tflops / (fleet.tflops + w.compute_half_tflops)
        price = w.price_half_usd_per_tflop_hour / (
            w.price_half_usd_per_tflop_hour + fleet.hourly_rate / fleet.tflops
        )
        warm = loaded.astype(np.float64)
        capacity = 1.0 - fleet.inflight / fleet.max_concurrency
        reputation = (fleet.successes + 1) / (fleet.successes + fleet.failures + 2)
        proximity = (
            np.full_like(fit, 0.5)
            if caller_region is None
            else (fleet.region == caller_region).astype(np.float64)
        )
        s = (
            w.fit * fit
            + w.compute * compute
            + w.price * price
            + w.warm * warm
            + w.capacity * capacity
            + w.reputation * reputation
            + w.proximity * proximity
        ) / w.total
    idx = np.flatnonzero(ok)
    order = np.lexsort((idx, -s[idx]))  # score descending, then node order
    return idx[order], s[idx[order]]
