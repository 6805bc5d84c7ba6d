"""The peer `bench gateway` measures beside ours: SGLang's model gateway (smg, a router in Rust, in the
dev extras), in front of the same fake node, in the same interleaved rounds.

smg is launched as its docs launch a router over plain OpenAI-compatible workers (`smg launch
--worker-urls URL --policy round_robin`), at its defaults otherwise, except where a default would
reach past this machine or add work ours does not do (each flag says which). It keeps nothing in a
database and checks no key, so it sits between the bare relay (the floor: one hop through Python) and
our gateway (auth, match, metering in Postgres): what it adds is what a lean router in Rust costs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NOT_INSTALLED = "smg is not installed (it comes with neuralgrid's dev extras); measuring without it"
READY = "/readiness"  # 200 once a worker has passed its health check
# Should anything in it still reach for the Hugging Face Hub, it gets a closed port on loopback.
ENV = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
# Ours against smg, each ratio over smg's figure: (key, our path, what is compared).
RATIOS = (
    ("gateway_over_smg_added_p50", "gateway", "added_p50"),
    ("gateway_over_smg_rps", "gateway", "rps"),
    ("gateway_over_smg_cpu", "gateway", "cpu"),
    ("relay_over_smg_added_p50", "relay", "added_p50"),
    ("relay_over_smg_rps", "relay", "rps"),
)


def find_smg() -> str | None:
    """The smg command: the console script beside this Python (a virtual environment run without
    activating it), else one on PATH."""
    beside = Path(sys.executable).parent / "smg"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("smg")


def version(command: str) -> str:
    done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def flags(worker_urls: Sequence[str]) -> list[str]:
    """`smg launch`'s arguments besides its ports."""
    return [
        "launch",
        "--worker-urls",
        *worker_urls,
        "--policy",
        "round_robin",
        "--disable-tokenizer-autoload",  # else it fetches the model's tokenizer from the Hub
        "--disable-load-monitoring",  # round robin reads no load: no polls of the node mid-round
        "--log-level",
        "warn",  # no log line per request: our gateway writes none either
    ]


def launch(command: str, worker_urls: Sequence[str], port: int, metrics_port: int) -> list[str]:
    """smg on loopback only: its metrics listener's default is 0.0.0.0:29000, which would also clash
    with a second run."""
    ports = ["--host", "127.0.0.1", "--port", str(port)]
    ports += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    return [command, *flags(worker_urls), *ports]


def ratios(result: dict[str, Any]) -> dict[str, float | None]:
    """Ours over smg, for a case that measured smg and our path (None where smg's figure is not
    above 0: noise on a short run can leave its added latency at 0 or below)."""
    if "smg" not in result:
        return {}

    def figure(path: str, measure: str) -> float | None:
        if measure == "added_p50":
            value = result.get("added_p50_ms" if path == "gateway" else f"{path}_added_p50_ms")
        elif measure == "rps":
            value = result[path].get("rps")
        else:  # the process on the path: the gateway's alone (Postgres is reported apart), smg's
            value = result[path].get("gateway_cpu_ms_per_request")
        return None if value is None else float(value)

    found: dict[str, float | None] = {}
    for key, path, measure in RATIOS:
        if path in result:
            ours, theirs = figure(path, measure), figure("smg", measure)
            found[key] = None if ours is None or theirs is None or theirs <= 0 else round(ours / theirs, 3)
    return found
