"""The SQL matching policies as vectorized numpy, for simulating thousands of requests per second.

`score()` mirrors score_nodes(): the same hard filters, the same components, the same weights
(read from matching_policies), ties broken the same way (node id); `kept_level()` and `kept_last()`
mirror place()'s scarcity rule; `VramPressure` mirrors the sweeper's refresh_vram_pressure(), the
requests waiting in the gateways' lines included. tests/db/matching/test_sim_twin.py checks each
equals the SQL's on random fleets, weights and pressures, so the simulator decides as production does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
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
    reserve: float = 0.0

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
            + self.reserve
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
    # What the platform measures or decides about a node (None: nothing yet): the delivered share of
    # its claimed speed, a failure cooldown in force, requests its server runs from outside.
    speed_ratio: F | None = None
    cooling: B | None = None
    outside_load: npt.NDArray[np.int64] | None = None


def score(
    policy: str,
    weights: Weights | None,
    fleet: FleetArrays,
    min_vram_gb: float,
    holds: B,
    loaded: B,
    caller_region: int | None,
    max_hourly_rate: float | None = None,
    pressure: Sequence[tuple[float, float]] = (),
) -> tuple[npt.NDArray[np.int64], F]:
    """Eligible node indexes, best first, and their scores (as score_nodes ranks them).

    `pressure`: (VRAM level in GB, pressure) pairs, as VramPressure.pairs() (vram_pressure) gives them.
    """
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
        if fleet.cooling is not None:
            ok &= ~fleet.cooling
        w = weights
        # NaN: not measured yet (SQL's null), taken at its word.
        measured = np.ones_like(fleet.tflops) if fleet.speed_ratio is None else fleet.speed_ratio
        ratio = np.minimum(1.0, np.nan_to_num(measured, nan=1.0))
        delivered = fleet.tflops * ratio  # claimed TFLOPS, discounted to what was measured
        load = fleet.inflight if fleet.outside_load is None else fleet.inflight + fleet.outside_load
        fit = np.minimum(1.0, min_vram_gb / fleet.vram_gb)
        compute = delivered / (delivered + w.compute_half_tflops)
        price = w.price_half_usd_per_tflop_hour / (
            w.price_half_usd_per_tflop_hour + fleet.hourly_rate / delivered
        )
        warm = loaded.astype(np.float64)
        capacity = np.maximum(0.0, 1.0 - load / fleet.max_concurrency)
        reputation = (
            (fleet.successes + 1) / (fleet.successes + fleet.failures + 2) * np.minimum(1.0, ratio / 0.25)
        )
        proximity = (
            np.full_like(fit, 0.5)
            if caller_region is None
            else (fleet.region == caller_region).astype(np.float64)
        )
        reserve = reserve_component(fleet.vram_gb, min_vram_gb, pressure)
        s = (
            w.fit * fit
            + w.compute * compute
            + w.price * price
            + w.warm * warm
            + w.capacity * capacity
            + w.reputation * reputation
            + w.proximity * proximity
            + w.reserve * reserve
        ) / w.total
    idx = np.flatnonzero(ok)
    order = np.lexsort((idx, -s[idx]))  # score descending, then node order
    return idx[order], s[idx[order]]


def reserve_component(vram_gb: F, need_gb: float, pressure: Sequence[tuple[float, float]]) -> F:
    """private.reserve_component(): 1 minus the highest pressure among the VRAM levels above the
    request's need that each node reaches."""
    taken = np.zeros_like(vram_gb)
    for level, p in pressure:
        if level > need_gb and p > 0:
            taken = np.where(vram_gb >= level, np.maximum(taken, p), taken)
    return 1.0 - taken


def kept_level(need_gb: float, levels: Sequence[tuple[float, float, int]], threshold: float) -> float | None:
    """private.kept_level(): the smallest VRAM level above the request's need whose pressure is at
    least `threshold` (platform_settings.reserve_threshold) and below which some online node could
    still hold the request (fewer slots have the level than have the request's own); None if none.
    `levels`: (level, pressure, slots) rows, as VramPressure.rows() (vram_pressure) gives them."""
    own = [slots for level, _p, slots in levels if level <= need_gb]
    own_slots = own[-1] if own else max((slots for _l, _p, slots in levels), default=0)
    kept = [level for level, p, slots in levels if level > need_gb and p >= threshold and slots < own_slots]
    return min(kept) if kept else None


def kept_last(
    order: npt.NDArray[np.int64], vram_gb: F, kept_gb: float | None, wait: bool
) -> npt.NDArray[np.int64]:
    """private.kept_last(): a ranking under the scarcity rule. The nodes with at least `kept_gb` of
    VRAM, kept for bigger jobs, are left out while the request may `wait`, else moved last."""
    if kept_gb is None:
        return order
    kept = vram_gb[order] >= kept_gb
    return order[~kept] if wait else order[np.argsort(kept, kind="stable")]


def placement_order(
    policy: str,
    weights: Weights | None,
    fleet: FleetArrays,
    need_gb: float,
    holds: B,
    loaded: B,
    caller_region: int | None,
    pressure: Sequence[tuple[float, float]],
    kept_gb: float | None,
    wait: bool,
) -> npt.NDArray[np.int64]:
    """The order in which place() tries the nodes for a request: score_nodes()'s ranking (`seed` for
    seed_warm too, which puts the nodes with the model loaded first, as the original system did),
    then, under a policy that weighs the reserve, the scarcity rule (kept_last())."""
    sql_policy = "seed" if policy in ("seed", "seed_warm") else policy
    order, _ = score(sql_policy, weights, fleet, need_gb, holds, loaded, caller_region, pressure=pressure)
    if policy == "seed_warm":
        order = order[np.argsort(~loaded[order], kind="stable")]
    if weights is not None and weights.reserve > 0:
        order = kept_last(order, fleet.vram_gb, kept_gb, wait)
    return order


class VramPressure:
    """private.refresh_vram_pressure(), called once a simulated second as the sweeper calls it: per
    catalog VRAM level, the running jobs at that level (smoothed over `window_s`) per slot they can
    use (online nodes that have the level, less what bigger levels' jobs take). Requests waiting in
    the gateways' lines count at their level as running jobs do: in a burst the line is where the
    demand is."""

    def __init__(self, levels: Sequence[float], window_s: float = 30.0) -> None:
        self.levels = sorted(set(levels))
        self.window_s = window_s
        self.busy: dict[float, float] = {}
        self.pressure: dict[float, float] = {}
        self.slots: dict[float, int] = {}
        self.updated_at: float | None = None

    def level_of(self, need_gb: float) -> float:
        """The biggest level a job needing `need_gb` needs at least (the smallest, below them all)."""
        below = [level for level in self.levels if level <= need_gb]
        return below[-1] if below else self.levels[0]

    def refresh(
        self,
        now: float,
        running_needs: Sequence[float],
        fleet: FleetArrays,
        waiting_needs: Sequence[float] = (),
    ) -> None:
        at_level = Counter(self.level_of(need) for need in [*running_needs, *waiting_needs])
        keep = 0.0 if self.updated_at is None else math.exp(-(now - self.updated_at) / self.window_s)
        taken_above = 0.0  # jobs of bigger levels, which can use no smaller node
        for level in reversed(self.levels):
            before = self.busy.get(level)
            busy = at_level[level] if before is None else before * keep + at_level[level] * (1 - keep)
            self.slots[level] = int(fleet.max_concurrency[fleet.online & (fleet.vram_gb >= level)].sum())
            left_over = self.slots[level] - taken_above
            self.busy[level] = busy
            self.pressure[level] = 0.0 if busy == 0 else 1.0 if left_over <= 0 else min(1.0, busy / left_over)
            taken_above += busy
        self.updated_at = now

    def pairs(self) -> list[tuple[float, float]]:
        return [(level, self.pressure.get(level, 0.0)) for level in self.levels]

    def rows(self) -> list[tuple[float, float, int]]:
        """(level, pressure, slots), smallest level first, as kept_level() reads them."""
        return [(level, self.pressure.get(level, 0.0), self.slots.get(level, 0)) for level in self.levels]

    def kept_level(self, need_gb: float, threshold: float | None) -> float | None:
        """The scarcity rule's level for a request needing `need_gb` (None: no rule, or none kept)."""
        return None if threshold is None else kept_level(need_gb, self.rows(), threshold)
