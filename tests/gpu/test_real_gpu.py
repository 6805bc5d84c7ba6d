"""On a real NVIDIA GPU, with CuPy: skipped without them (CI has no GPU; these ran on a lent H200,
docs/security.md "GPU claims"). NVML detection against what CUDA sees; the probe's CuPy kernels
against the NumPy arithmetic a gateway checks with; the agent answering a probe out of GPU memory;
an honest GPU passing its datasheet's threshold."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from typing import Any

import numpy as np
import pytest

from neuralgrid.agent import gpu
from neuralgrid.agent.gpu_probe import GpuProbeHost
from neuralgrid.verify import gpu_probe as probe

cupy: Any = pytest.importorskip("cupy")


def _devices() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # CUDA's own errors: no driver
        return 0


pytestmark = pytest.mark.skipif(_devices() < 1, reason="no NVIDIA GPU")


def _name() -> str:
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def test_nvml_reads_the_gpu_cuda_sees() -> None:
    info = gpu.detect()
    _free, total = cupy.cuda.runtime.memGetInfo()
    assert (info.model, info.count) == (_name(), _devices())
    assert info.vram_total_gb == pytest.approx(total * _devices() / 2**30, rel=0.02)
    assert 0 < info.vram_free_gb <= info.vram_total_gb and 0 <= info.utilization <= 1
    per_gpu = gpu.tflops_for(info.model)
    assert info.tflops == (None if per_gpu is None else per_gpu * info.count)
    load = gpu.load()  # what heartbeats carry
    assert load is not None and 0 <= load[0] <= 1 and abs(load[1] - info.vram_free_gb) < 8


def test_cupys_kernels_make_the_fill_and_digests_numpy_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernels (made on the GPU, checked on a CPU) agree word for word, across chunks."""
    monkeypatch.setattr(probe, "CHUNK_BYTES", 1 << 20)  # 37 blocks of 64 KiB: 3 chunks, the last short
    plan = probe.Plan("n" * 32, 37 * (64 << 10), 64 << 10)
    on_gpu, on_cpu = probe.fill(cupy, plan), probe.fill(np, plan)
    assert np.array_equal(on_gpu.get(), on_cpu)
    digest_seed = probe.seed("m" * 32, b"digest")
    assert np.array_equal(
        probe.digests(cupy, on_gpu, digest_seed).get(), probe.digests(np, on_cpu, digest_seed)
    )
    answered = [int(d) for d in probe.digests(cupy, on_gpu, digest_seed).get()]
    assert probe.wrong_digests(plan, "m" * 32, answered, range(plan.blocks)) == []
    big = probe.Plan("b" * 32, 5 * probe.BLOCK_BYTES)  # a block's row split among thread blocks
    on_gpu, on_cpu = probe.fill(cupy, big), probe.fill(np, big)
    assert np.array_equal(
        probe.digests(cupy, on_gpu, digest_seed).get(), probe.digests(np, on_cpu, digest_seed)
    )


def test_the_agent_answers_a_probe_out_of_gpu_memory() -> None:
    host = GpuProbeHost.detect()
    assert host.xp is cupy and host.device == _name()
    plan = probe.Plan("f" * 32, 512 << 20)

    async def probed() -> tuple[int, dict[str, Any], int, dict[str, Any]]:
        fill = {"op": "fill", "nonce": plan.nonce, "bytes": plan.size}
        filled = await host.answer(json.dumps(fill).encode())
        digested = await host.answer(json.dumps({"op": "digest", "nonce": "d" * 32}).encode())
        return *filled, *digested

    fill_status, filled, digest_status, digested = asyncio.run(probed())
    assert (fill_status, filled["gpu"], filled["device"], digest_status) == (200, True, _name(), 200)
    raw = base64.b64decode(digested["digests"])
    answered = np.frombuffer(raw, dtype="<u8").tolist()
    assert len(answered) == plan.blocks
    picks = random.sample(range(plan.blocks), 8)
    assert probe.wrong_digests(plan, "d" * 32, answered, picks) == []


def test_an_honest_gpu_reaches_its_datasheets_threshold() -> None:
    free, _total = cupy.cuda.runtime.memGetInfo()
    plan = probe.Plan("h" * 32, int(free * 0.25) // probe.BLOCK_BYTES * probe.BLOCK_BYTES)
    figures = probe.run_here(cupy, plan, cupy.cuda.Stream.null.synchronize)
    print(_name(), figures)
    assert figures["wrong"] == 0
    datasheet = probe.bandwidth_for(_name())
    if datasheet is not None:
        assert figures["gbps"] >= probe.MIN_SHARE * datasheet


def test_a_gpu_holding_half_the_fill_is_too_slow() -> None:
    """The cheapest lie about memory: hold half the fill and make the other half again in every
    pass, with the honest fill's own fused kernel. Its digests check out; its time does not."""
    free, _total = cupy.cuda.runtime.memGetInfo()
    plan = probe.Plan("c" * 32, int(free * 0.25) // probe.BLOCK_BYTES * probe.BLOCK_BYTES)
    n, words, half = plan.blocks, plan.words, plan.blocks // 2
    held = probe.fill(cupy, probe.Plan(plan.nonce, half * plan.block_bytes))  # blocks 0 .. half - 1
    fill_seed, digest_seed = probe.seed(plan.nonce, b"fill"), probe.seed("e" * 32, b"digest")
    key, macs = probe._key(cupy, digest_seed, words), probe._gpu_macs(cupy)
    step = (1 << 30) // plan.block_bytes
    probe.ready_digests(cupy, words)
    cupy.cuda.Stream.null.synchronize()
    started = time.perf_counter()
    h = cupy.zeros(n, dtype=cupy.uint64)
    for offset in probe.offsets(digest_seed, n, probe.PASSES):
        salts = cupy.roll(h, -offset)
        parts = [macs(held, salts[:half], key)]
        for first in range(half, n, step):
            count = min(step, n - first)
            made = probe.blocks(cupy, fill_seed, first, count, words)
            parts.append(macs(made, salts[first : first + count], key))
        h = cupy.concatenate(parts)
    cupy.cuda.Stream.null.synchronize()
    seconds = time.perf_counter() - started
    answered = [int(d) for d in h.get()]
    assert probe.wrong_digests(plan, "e" * 32, answered, random.sample(range(n), probe.CHECKS)) == []
    datasheet = probe.bandwidth_for(_name())
    print(_name(), "holding half:", round(probe.PASSES * plan.size / seconds / 1e9), "GB/s")
    if datasheet is not None:
        assert not probe.judge(plan.size, seconds, 0.0, datasheet).passed
