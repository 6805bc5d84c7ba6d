"""The performance model's figures: decode bound by bandwidth, batching, loads, calibration."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from neuralgrid.sim import physics
from neuralgrid.sim.physics import GPU_BY_NAME, LLAMA_8B, LLAMA_70B_AWQ, MODELS, read_batching

SHAPE = {m.id: m for m in MODELS}


def single_stream_tok_s(gpu: str, model: str, context: int = 1000) -> float:
    g, m = GPU_BY_NAME[gpu], SHAPE[model]
    step = physics.weights_s(m.weight_gb, g.bandwidth_gb_s) + physics.stream_cost_s(
        m.params_b, m.kv_bytes_per_token * context, g.bandwidth_gb_s, g.tflops
    )
    return 1 / step


def test_decode_is_bound_by_memory_bandwidth_not_tflops() -> None:
    h100, rtx3090 = single_stream_tok_s("H100 80GB", LLAMA_8B), single_stream_tok_s("RTX 3090", LLAMA_8B)
    # The bandwidth ratio (3,350 / 936 = 3.58), not the TFLOPS ratio (989 / 71 = 14).
    assert h100 / rtx3090 == pytest.approx(3350 / 936, rel=0.02)
    # Under the 209 tok/s roofline (16.06 GB read per token at 3,350 GB/s), at 70% of it.
    assert 130 < h100 < 209 * 0.7
    assert 35 < rtx3090 < 936 / 16.06 * 0.7
    # The 70B AWQ model reads ~40 GB a token: bigger than the 8B FP16 model, and slower.
    assert single_stream_tok_s("H100 80GB", LLAMA_70B_AWQ) == pytest.approx(3350 * 0.7 / 39.8, rel=0.03)


def test_one_step_serves_the_batch() -> None:
    """Per-stream speed falls slowly with the batch; aggregate throughput rises."""
    g, m = GPU_BY_NAME["H100 80GB"], SHAPE[LLAMA_8B]
    weights = physics.weights_s(m.weight_gb, g.bandwidth_gb_s)
    per_stream = physics.stream_cost_s(m.params_b, m.kv_bytes_per_token * 1000, g.bandwidth_gb_s, g.tflops)
    speed = {n: 1 / (weights + n * per_stream) for n in (1, 4, 16)}
    assert speed[4] / speed[1] > 0.9 and speed[16] / speed[1] > 0.6
    assert 16 * speed[16] > 10 * speed[1]


def test_a_cold_start_is_the_weights_read_from_disk_plus_init() -> None:
    assert physics.load_s(SHAPE[LLAMA_8B].weight_gb) == pytest.approx(16.06 / 2.0 + 5.0)
    assert physics.load_s(SHAPE[LLAMA_70B_AWQ].weight_gb) == pytest.approx(39.8 / 2.0 + 5.0)


def test_a_measured_batching_curve_is_interpolated_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "batching.json"
    assert read_batching(path) is None  # no file: the analytic model
    path.write_text(
        json.dumps(
            {
                "measured_on": "a test",
                "parallel": [1, 2, 4, 8],
                "per_stream_rel": [1.0, 0.8, 0.5, 0.3],
                "aggregate_rel": [1.0, 1.6, 2.0, 2.4],
                "prefill_tokens_per_s": 100.0,
                "decode_tokens_per_s": 10.0,
            }
        )
    )
    curve = read_batching(path)
    assert curve is not None and curve.measured_on == "a test"
    assert curve.rel(1) == 1.0 and curve.rel(4) == 0.5
    assert curve.rel(3) == pytest.approx(0.8 - 0.3 * (math.log2(3) - 1))  # linear in log2(streams)
    assert 16 * curve.rel(16) == pytest.approx(8 * 0.3)  # past the last point, aggregate stays flat
    path.write_text(json.dumps({"parallel": [2, 4], "per_stream_rel": [1.0, 0.5]}))
    with pytest.raises(ValueError, match="parallel must start at 1"):
        read_batching(path)
