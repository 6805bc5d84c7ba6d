"""Benchmarks: each prints a table and writes JSON; none asserts a time (machines are noisy)."""

from __future__ import annotations

import json
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    arr = np.asarray(samples_ms)
    return {
        "p50_ms": round(float(np.percentile(arr, 50)), 3),
        "p99_ms": round(float(np.percentile(arr, 99)), 3),
        "mean_ms": round(float(arr.mean()), 3),
    }


def write_report(path: Path, name: str, results: list[dict[str, Any]], **extra: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": name,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": _cpus(),
            "python": platform.python_version(),
            "system": platform.platform(),
        },
        **extra,
        "results": results,
    }
    path.write_text(json.dumps(report, indent=2) + "\n")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
