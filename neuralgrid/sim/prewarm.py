"""Predictive pre-warm as the platform runs it (supabase/migrations/20261127000200_prewarm.sql),
for the simulator: the same demand figures and the same rule, in numpy and dicts.

- Every `refresh_s`, demand per (model, caller region) over the last `window_s`: requests, unmet
  ones (cold or refused) since the last pre-load asked for there, load (slot-seconds used over the
  window) and warm slots now (online nodes of the region with the model loaded, not cooling). A
  pre-load is wanted when something went unmet, nothing is warm, or load reaches `busy_ratio` of the
  warm slots (private.refresh_prewarm_demand()).
- At each heartbeat, an idle node (online, nothing in flight, not cooling, no load under way) is
  asked to load the model in its region's demand with the most unmet requests, then the most
  requests, that it can hold and has not loaded, at most once per (model, region) per `interval_s`
  (private.prewarm_for()). The first idle node to heartbeat gets it, as in the platform.

What is not modelled: refusals (every simulated server can load any model that fits) and expiry.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrewarmSettings:
    """platform_settings' prewarm_* columns (defaults: the migration's)."""

    enabled: bool = True
    window_s: float = 300.0
    refresh_s: float = 10.0
    interval_s: float = 60.0
    busy_ratio: float = 0.75


@dataclass
class Job:
    """What refresh_prewarm_demand() reads of a job."""

    model: int
    region: int
    created: float
    unmet: bool  # refused, or placed where its model was not loaded
    ended: float | None = None


@dataclass
class Demand:
    requests: int
    unmet: int
    load: float
    warm_slots: int
    wanted: bool


@dataclass
class Prewarm:
    settings: PrewarmSettings
    jobs: list[Job] = field(default_factory=list)
    demand: dict[tuple[int, int], Demand] = field(default_factory=dict)
    last_requested: dict[tuple[int, int], float] = field(default_factory=dict)
    refreshed_at: float = -1e18

    def record(self, job: Job) -> Job:
        self.jobs.append(job)
        return job

    def refresh(self, t: float, warm_slots: dict[tuple[int, int], int]) -> None:
        """The demand figures at `t`; `warm_slots[(model, region)]`: warm capacity there now."""
        s = self.settings
        start = t - s.window_s
        self.jobs = [j for j in self.jobs if j.created >= start]  # older jobs never count again
        tally: dict[tuple[int, int], list[float]] = {}
        for job in self.jobs:
            key = (job.model, job.region)
            row = tally.setdefault(key, [0, 0, 0.0])
            row[0] += 1
            if job.unmet and job.created > self.last_requested.get(key, -1e18):
                row[1] += 1
            row[2] += min((job.ended if job.ended is not None else t) - job.created, s.window_s)
        self.demand = {}
        for key, (requests, unmet, busy_s) in tally.items():
            warm = warm_slots.get(key, 0)
            load = busy_s / s.window_s
            self.demand[key] = Demand(
                int(requests), int(unmet), load, warm, unmet > 0 or warm == 0 or load >= s.busy_ratio * warm
            )
        self.refreshed_at = t

    def due(self, t: float) -> bool:
        return t - self.refreshed_at >= self.settings.refresh_s

    def pick(self, t: float, region: int, can_load: set[int]) -> int | None:
        """The model an idle node of `region` is asked to load (it could load `can_load`), if any."""
        best: tuple[int, int, int] | None = None
        for (model, where), d in self.demand.items():
            if where != region or model not in can_load or not d.wanted:
                continue
            if t - self.last_requested.get((model, where), -1e18) < self.settings.interval_s:
                continue
            rank = (-d.unmet, -d.requests, model)
            if best is None or rank < best:
                best = rank
        if best is None:
            return None
        self.last_requested[(best[2], region)] = t
        return best[2]
