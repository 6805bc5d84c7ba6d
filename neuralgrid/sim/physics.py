"""How fast a GPU serves a model, and what the platform around it does: every constant of the
simulator's performance model, with its source. docs/simulation.md explains the model at length.

Prefill is bound by compute: 2 x parameters x prompt tokens FLOPs, at MFU of the node's dense FP16
TFLOPS. Decode is bound by memory bandwidth: each decode step reads every weight of each model being
decoded once, whatever the number of streams, plus each stream's KV cache, at BANDWIDTH_EFFICIENCY of
the datasheet bandwidth; each stream also costs 2 x parameters FLOPs per token. So one step serves
every stream on the GPU: per-stream speed falls slowly with the batch and aggregate throughput rises
(continuous batching, as vLLM and llama.cpp's server do), up to the node's slots. If
neuralgrid/sim/data/batching.json exists (measured on a real llama.cpp server), its per-stream
slowdown replaces the analytic batching curve. A cold model loads at LOAD_GB_PER_S from local disk plus
INIT_S, and serves nothing until it is loaded.

Sources:
- GPU memory bandwidth, VRAM and dense FP16 tensor TFLOPS (no sparsity): NVIDIA datasheets and
  architecture whitepapers (GA102 for RTX 3090, AD102 for RTX 4090, A10, L4, A100 (the SXM4 parts:
  40 GB 1,555 GB/s, 80 GB 2,039 GB/s), H100 (the SXM5 part: 3,350 GB/s, 989 TFLOPS; the PCIe card
  has 2,000 GB/s and 756 TFLOPS)). The TFLOPS are what nodes claim and what the scorer reads.
- Hourly rates: typical community-marketplace prices (Vast.ai, RunPod, 2024), an assumption; each
  generated node gets +-25% around them.
- Model shapes (parameters, layers, KV heads, head size) from each model's config.json on Hugging
  Face. KV cache per token = 2 (K and V) x layers x KV heads x head size x 2 bytes (FP16 cache).
- AWQ 4-bit weights: 0.5 byte per parameter plus group-128 FP16 scales and zeros (~0.02 byte), with
  the embedding and output layers kept in FP16: 68.5 B x 0.52 + 2.1 B x 2 = ~39.8 GB for Llama 3.3
  70B, the size of the published AWQ INT4 checkpoints.
- BANDWIDTH_EFFICIENCY 0.7: single-stream decode reaches 60-75% of datasheet bandwidth in published
  runs (MLC LLM on an RTX 4090, Llama 2 7B 4-bit, 191 tok/s x ~3.8 GB = ~72% of 1,008 GB/s;
  mlc-ai/llm-perf-bench#1). An 8B FP16 model then decodes at 41 tok/s on an RTX 3090 and 146 tok/s
  on an H100 SXM (3.6x apart, the bandwidth ratio).
- MFU 0.4 for prefill and per-stream decode compute: an assumption (prefill at 30-50% of peak is
  typical of vLLM and llama.cpp on these GPUs).
- LOAD_GB_PER_S 2.0: weights read from a local NVMe SSD (PCIe 3.0 x4 drives read ~3.5 GB/s
  sequentially; deserializing and copying to the GPU costs the rest), an assumption. INIT_S 5 s:
  process start, CUDA context, KV cache allocation, an assumption (vLLM's CUDA-graph capture adds
  more; llama.cpp has none). An 8B FP16 model loads in 13 s, the 70B AWQ in 25 s, near the catalog's
  cold_start_s (15 and 30 s).
- Network round trips: 10 ms within a region, 40 ms within a continent, 150 ms across, assumed.
- The platform's own settings (their defaults in the code): heartbeat every 5 s, offline after 3
  missed (platform_settings), swept every 1 s (NEURALGRID_SWEEP_INTERVAL_S); connect timeout 2 s
  (NEURALGRID_CONNECT_TIMEOUT_S); a request that finds every capable node busy waits up to 30 s in a
  line of at most 256 per model (NEURALGRID_QUEUE_TIMEOUT_S, NEURALGRID_QUEUE_MAX_WAITING); 3
  fallbacks after the first node (neuralgrid.db.matching.MatchRequest); a failed node cools down 5 s,
  doubling, at most 300 s (platform_settings). The heartbeat and cooldown figures are read from the
  database when it is given (see report.load_platform).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Gpu:
    name: str
    vram_gb: float
    tflops: float  # dense FP16 tensor TFLOPS, as nodes claim them
    bandwidth_gb_s: float  # datasheet memory bandwidth
    usd_per_hour: float
    slots: int
    fleet_share: float


GPUS = (
    Gpu("RTX 3090", 24, 71, 936, 0.20, 4, 0.22),
    Gpu("RTX 4090", 24, 165, 1008, 0.35, 4, 0.28),
    Gpu("A10", 24, 125, 600, 0.60, 4, 0.10),
    Gpu("L4", 24, 121, 300, 0.45, 4, 0.10),
    Gpu("A100 40GB", 40, 312, 1555, 1.10, 8, 0.10),  # SXM4
    Gpu("A100 80GB", 80, 312, 2039, 1.50, 8, 0.12),  # SXM4
    Gpu("H100 80GB", 80, 989, 3350, 2.50, 16, 0.08),  # SXM5
)
GPU_BY_NAME = {g.name: g for g in GPUS}


@dataclass(frozen=True)
class ModelShape:
    id: str
    params_b: float  # billions of parameters
    weight_gb: float  # bytes of weights read per decode step (and loaded from disk)
    kv_bytes_per_token: int  # 0: an embedding model (no decode)
    share: float  # share of requests in the default workload


LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
MISTRAL_7B = "mistralai/Mistral-7B-Instruct-v0.3"
QWEN_14B = "Qwen/Qwen2.5-14B-Instruct"
LLAMA_70B_AWQ = "meta-llama/Llama-3.3-70B-Instruct-AWQ"
BGE = "BAAI/bge-large-en-v1.5"


def _kv(layers: int, kv_heads: int, head_dim: int) -> int:
    return 2 * layers * kv_heads * head_dim * 2


MODELS = (  # FP16 weights are 2 bytes a parameter; the AWQ model's size is derived above
    ModelShape(LLAMA_8B, 8.03, 16.06, _kv(32, 8, 128), 0.40),
    ModelShape(MISTRAL_7B, 7.25, 14.50, _kv(32, 8, 128), 0.15),
    ModelShape(QWEN_14B, 14.77, 29.54, _kv(48, 8, 128), 0.15),
    ModelShape(LLAMA_70B_AWQ, 70.6, 39.8, _kv(80, 8, 128), 0.10),
    ModelShape(BGE, 0.335, 0.67, 0, 0.20),
)
BIG_MODEL = LLAMA_70B_AWQ  # the model only 80 GB nodes can serve

BANDWIDTH_EFFICIENCY = 0.7
MFU = 0.4
LOAD_GB_PER_S = 2.0
INIT_S = 5.0
RTT_S = {"region": 0.010, "continent": 0.040, "world": 0.150}

CONTINENT = {
    "us-east": "na",
    "us-west": "na",
    "eu-west": "eu",
    "eu-central": "eu",
    "ap-northeast": "as",
    "ap-southeast": "as",
    "ap-south": "as",
    "sa-east": "sa",
    "oceania": "oc",
    "af-south": "af",
}
REGIONS = list(CONTINENT)
CALLER_WEIGHTS = np.array([0.25, 0.15, 0.2, 0.1, 0.08, 0.06, 0.06, 0.04, 0.03, 0.03])


@dataclass(frozen=True)
class Platform:
    """What the platform does around a placement (defaults: the code's and the database's)."""

    heartbeat_interval_s: float = 5.0
    missed_heartbeats_offline: int = 3
    sweep_interval_s: float = 1.0
    connect_timeout_s: float = 2.0
    queue_timeout_s: float = 30.0
    queue_max_waiting: int = 256
    fallbacks: int = 3
    cooldown_base_s: float = 5.0
    cooldown_max_s: float = 300.0
    reserve_window_s: float = 30.0
    reserve_threshold: float | None = 0.2  # platform_settings'; None: no scarcity rule
    waiting_demand: bool = True  # the gateways' lines count toward the VRAM pressure (issue 43)

    @property
    def offline_after_s(self) -> float:
        return self.heartbeat_interval_s * self.missed_heartbeats_offline

    def offline_at(self, lost_at: float, heartbeat_phase: float) -> float:
        """When the sweeper marks a node lost at `lost_at` offline: at its first sweep once
        `missed_heartbeats_offline` beats were missed after the node's last one (`heartbeat_phase`:
        when in the interval it beats, as a share of it)."""
        interval = self.heartbeat_interval_s
        phase = heartbeat_phase * interval
        last_heartbeat = phase + math.floor((lost_at - phase) / interval) * interval
        sweeps = math.ceil((last_heartbeat + self.offline_after_s) / self.sweep_interval_s)
        return sweeps * self.sweep_interval_s

    def cooldown_s(self, consecutive_failures: int) -> float:
        """How long a node that failed that many times in a row is passed over: doubling, capped."""
        return min(self.cooldown_max_s, self.cooldown_base_s * 2.0 ** (consecutive_failures - 1))


def rtt_s(a: int, b: int) -> float:
    if a == b:
        return RTT_S["region"]
    return RTT_S["continent"] if CONTINENT[REGIONS[a]] == CONTINENT[REGIONS[b]] else RTT_S["world"]


def prefill_s(params_b: float, prompt_tokens: int, tflops: float) -> float:
    return 2 * params_b * 1e9 * prompt_tokens / (tflops * 1e12 * MFU)


def load_s(weight_gb: float) -> float:
    return weight_gb / LOAD_GB_PER_S + INIT_S


def stream_cost_s(params_b: float, kv_bytes: float, bandwidth_gb_s: float, tflops: float) -> float:
    """What one more stream adds to a decode step: reading its KV cache, and its FLOPs."""
    return kv_bytes / (bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY) + 2 * params_b * 1e9 / (
        tflops * 1e12 * MFU
    )


def weights_s(weight_gb: float, bandwidth_gb_s: float) -> float:
    """Reading a model's weights once: the floor of every decode step."""
    return weight_gb / (bandwidth_gb_s * BANDWIDTH_EFFICIENCY)


@dataclass(frozen=True)
class Batching:
    """A measured per-stream slowdown: per-stream speed at n parallel streams over one stream's."""

    measured_on: str
    parallel: tuple[int, ...]
    per_stream_rel: tuple[float, ...]

    def rel(self, n: int) -> float:
        """Interpolated in log2(n); past the last point aggregate throughput stays flat."""
        x = np.log2(np.array(self.parallel, dtype=np.float64))
        y = np.array(self.per_stream_rel, dtype=np.float64)
        if n <= self.parallel[-1]:
            return float(np.interp(np.log2(n), x, y))
        return float(y[-1] * self.parallel[-1] / n)


CALIBRATION = Path(__file__).parent / "data" / "batching.json"


def read_batching(path: Path = CALIBRATION) -> Batching | None:
    """The measured batching curve, when the calibration file exists; None means the analytic one."""
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    parallel, rel = tuple(int(p) for p in raw["parallel"]), tuple(float(r) for r in raw["per_stream_rel"])
    if len(parallel) != len(rel) or not parallel or parallel[0] != 1 or list(parallel) != sorted(parallel):
        raise ValueError(f"{path}: parallel must start at 1, rise, and match per_stream_rel")
    return Batching(str(raw.get("measured_on", "unknown")), parallel, rel)
