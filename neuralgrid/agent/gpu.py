"""GPU detection through NVML, and the TFLOPS a GPU model is good for.

TFLOPS are dense (no sparsity) FP16/BF16 tensor throughput from NVIDIA's datasheets and architecture
whitepapers; for GeForce cards, FP16 with FP32 accumulate, which inference uses:
  H100 SXM 989 (H100 datasheet: 1,979 with sparsity), H100 PCIe 756, H200 989,
  A100 312 (A100 datasheet: 624 with sparsity), L40S 362, L4 121 (242 with sparsity), A10 125,
  A6000 155, T4 65, V100 125, RTX 4090 165 (Ada whitepaper), RTX 4080 97, RTX 3090 71 and
  RTX 3080 60 (GA102 whitepaper).
An agent never invents a GPU: no NVIDIA GPU means explicit specs, and an unknown model means an
explicit --tflops.
"""

from __future__ import annotations

from dataclasses import dataclass

import pynvml

# Substrings of NVML device names, most specific first.
TFLOPS_BY_MODEL: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("A6000", 155.0),
    ("T4", 65.0),
    ("V100", 125.0),
    ("4090", 165.0),
    ("4080", 97.0),
    ("3090", 71.0),
    ("3080", 60.0),
)


@dataclass(frozen=True)
class GpuInfo:
    model: str
    count: int
    vram_total_gb: float
    vram_free_gb: float
    utilization: float  # 0..1, averaged over the GPUs
    mig_instances: int
    tflops: float | None  # total over the GPUs; None when the model is not in the table


class NoGpu(Exception):
    """No NVIDIA GPU (or driver) on this machine."""


def tflops_for(model: str) -> float | None:
    for fragment, tflops in TFLOPS_BY_MODEL:
        if fragment in model:
            return tflops
    return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def detect() -> GpuInfo:
    """Read the GPUs through NVML; raises NoGpu when there is no driver or no device."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NoGpu(f"no NVIDIA GPU found (NVML: {err})") from err
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            raise NoGpu("no NVIDIA GPU found (NVML sees no device)")
        names, total, free, busy, mig = [], 0, 0, 0.0, 0
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            names.append(_text(pynvml.nvmlDeviceGetName(handle)))
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            total += memory.total
            free += memory.free
            busy += _utilization(handle)
            mig += _mig_instances(handle)
        model = names[0]
        per_gpu = tflops_for(model)
        return GpuInfo(
            model=model,
            count=count,
            vram_total_gb=round(total / 2**30, 1),
            vram_free_gb=round(free / 2**30, 1),
            utilization=round(busy / count, 3),
            mig_instances=mig,
            tflops=None if per_gpu is None else per_gpu * count,
        )
    finally:
        pynvml.nvmlShutdown()


def _utilization(handle: object) -> float:
    try:
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100
    except pynvml.NVMLError:  # not offered with MIG enabled
        return 0.0


def _mig_instances(handle: object) -> int:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:  # no MIG support on this GPU
        return 0
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return 0
    found = 0
    for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            found += 1
        except pynvml.NVMLError:
            continue
    return found


def load() -> tuple[float, float] | None:
    """(utilization 0..1, free VRAM GB) now, for heartbeats; None without a GPU."""
    try:
        info = detect()
    except (NoGpu, pynvml.NVMLError):  # a GPU lost, or a reading NVML does not offer (MIG)
        return None
    return info.utilization, info.vram_free_gb
