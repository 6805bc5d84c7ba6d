"""Request lengths and arrival bursts in the shape of a published trace: the Azure LLM inference
trace 2023 (Patel et al., "Splitwise", ISCA 2024; github.com/Azure/AzurePublicDataset,
data/AzureLLMInferenceTrace_{conv,code}.csv, CC-BY). Nothing is downloaded: the figures below were
computed once from those two files (commit b469a11) and the generator draws from them.

- Conversation: 19,366 requests in 58 min (5.5/s). Prompt tokens p50 1,020, p90 2,734, p99 4,142;
  output tokens p50 129, p90 424, p99 601. Arrivals nearly Poisson within a minute (1-s counts:
  CV 0.50 against Poisson's 0.43), the rate drifting from minute to minute (per-minute counts: CV
  0.25).
- Code: 8,819 requests in 57 min (2.6/s). Prompt tokens p50 1,469, p90 5,188, p99 7,436; output
  tokens p50 13, p90 55, p99 251. Arrivals come in bursts: 73% of seconds see no request; runs of
  busy seconds last 7.6 s on average and quiet runs 21 s, and a busy second averages 9.6 requests.

Lengths are drawn by inverse CDF through the quantiles below (interpolated in log space), so the
medians and tails match the trace. Conversation arrivals are Poisson at a rate redrawn each minute
(lognormal, sigma 0.25); code arrivals are Poisson within on-periods (exponential, mean 7.6 s) and
absent in off-periods (mean 21 s), at the rate that gives the mean. Request counts split 69/31
between the two, as in the trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUANTILES = (0.0, 0.01, 0.05, 0.10, 0.25, 0.50, 0.75, 0.90, 0.95, 0.99, 1.0)


@dataclass(frozen=True)
class TraceShape:
    name: str
    share: float  # of requests
    prompt_tokens: tuple[int, ...]  # at QUANTILES
    output_tokens: tuple[int, ...]
    on_mean_s: float | None  # bursts: mean on- and off-period; None for minute-to-minute drift
    off_mean_s: float | None


CONVERSATION = TraceShape(
    "conversation",
    19366 / (19366 + 8819),
    (2, 29, 181, 207, 396, 1020, 1189, 2734, 4083, 4142, 14050),
    (7, 16, 41, 54, 85, 129, 395, 424, 451, 601, 1000),
    None,
    None,
)
CODE = TraceShape(
    "code",
    8819 / (19366 + 8819),
    (3, 17, 75, 147, 578, 1469, 2744, 5188, 7303, 7436, 7437),
    (6, 6, 6, 7, 9, 13, 24, 55, 90, 251, 1899),
    7.6,
    21.0,
)
SHAPES = (CONVERSATION, CODE)
MINUTE_DRIFT_SIGMA = 0.25


def draw_lengths(quantiles: tuple[int, ...], rng: np.random.Generator, n: int) -> np.ndarray:
    """n token counts by inverse CDF through the quantile table."""
    u = rng.random(n)
    logs = np.interp(u, QUANTILES, np.log(np.array(quantiles, dtype=np.float64)))
    return np.maximum(1, np.round(np.exp(logs))).astype(np.int64)


def intensity(
    shape: TraceShape, duration_s: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The shape's arrival intensity over time, mean 1: times and the expected arrivals by then per
    request/s of mean rate (a piecewise-linear cumulative intensity, for scenarios.poisson_times)."""
    if shape.on_mean_s is None or shape.off_mean_s is None:
        edges = np.append(np.arange(0.0, duration_s, 60.0), duration_s)
        # Lognormal with mean 1: the rate drifts from minute to minute, the mean stays.
        drift = rng.lognormal(-(MINUTE_DRIFT_SIGMA**2) / 2, MINUTE_DRIFT_SIGMA, len(edges) - 1)
        return edges, np.concatenate([[0.0], np.cumsum(drift * np.diff(edges))])
    on_share = shape.on_mean_s / (shape.on_mean_s + shape.off_mean_s)
    times, cum = [0.0], [0.0]
    on = bool(rng.random() < on_share)
    while times[-1] < duration_s:
        length = float(rng.exponential(shape.on_mean_s if on else shape.off_mean_s))
        times.append(times[-1] + length)
        # Arrivals only while on, at the rate that keeps the mean; a sliver while off keeps the
        # cumulative intensity strictly rising.
        cum.append(cum[-1] + length * (1 / on_share if on else 1e-9))
        on = not on
    return np.array(times), np.array(cum)
