"""GPU claims that cost something to fake (issue 39, part 3): the probe's arithmetic, the same for
the agent that answers it (on a GPU, through CuPy) and the gateway that checks it (NumPy, on a CPU).

1. **Fill.** The gateway sends a nonce and a size; the agent fills that much GPU memory with blocks
   derived from the nonce (`blocks()`): each 64-bit word is ROUNDS rounds of a mixer away from its
   index, so that making a block costs several times what reading it does.
2. **Digest, timed.** The gateway sends a second nonce and times the answer: PASSES passes over every
   block, each block's digest keyed by another block's digest of the pass before (`digests()`), so
   that the passes run one after another and each reads every block again, or makes it again. What
   it answers is the last pass's digests, 8 bytes a block.
3. **Check.** Afterwards the gateway picks a few blocks, makes the blocks their digests depend on,
   pass by pass, and compares (`wrong_digests()`); and it judges the time against the datasheet
   bandwidth of the GPU the node claims (`judge()`).

What it proves, and what not, is in docs/security.md ("GPU claims").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

PATH = "/v1/neuralgrid/gpu-probe"  # signed like any request the gateway sends a node
ROUNDS = 24  # mixer rounds a word: the cost of making a block, against that of reading it
PASSES = 4
CHECKS = 4  # blocks the gateway checks afterwards, each by making PASSES blocks on its CPU
BLOCK_BYTES = 2 << 20
MIN_BLOCK_BYTES = 64 << 10
MAX_BLOCK_BYTES = 64 << 20
CHUNK_BYTES = 256 << 20  # what the agent works on at once: its temporaries are this size
MAX_BYTES = 1 << 41  # 2 TiB: more than any one GPU holds
# The share of the datasheet bandwidth a probe must reach. On an H200 (2026-12-04, docs/security.md)
# an idle GPU showed 85%, one shared with another process's full load 38%, one holding half the
# fill and making the rest again 8%; a CPU shows tens of GB/s against hundreds.
MIN_SHARE = 0.2

_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

# Datasheet memory bandwidth (GB/s) of one GPU, by substring of its NVML name, most specific first;
# the lower figure where a name covers two memory sizes (A100 40 GB, H100 PCIe).
BANDWIDTH_BY_MODEL: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10", 600.0),
    ("A6000", 768.0),
    ("T4", 320.0),
    ("V100", 900.0),
    ("4090", 1008.0),
    ("4080", 717.0),
    ("3090", 936.0),
    ("3080", 760.0),
)


def bandwidth_for(gpu_model: str) -> float | None:
    """The datasheet bandwidth of one such GPU in GB/s; None for a model not in the table."""
    for fragment, gbps in BANDWIDTH_BY_MODEL:
        if fragment in gpu_model:
            return gbps
    return None


def seed(nonce: str, label: bytes) -> int:
    return int.from_bytes(hashlib.sha256(label + nonce.encode()).digest()[:8], "little")


@dataclass(frozen=True)
class Plan:
    """One probe's shape, as the gateway asks for it."""

    nonce: str
    size: int  # bytes filled
    block_bytes: int = BLOCK_BYTES

    @property
    def blocks(self) -> int:
        return self.size // self.block_bytes

    @property
    def words(self) -> int:
        return self.block_bytes // 8


def plan_error(size: Any, block_bytes: Any) -> str | None:
    """Why a fill of `size` bytes in blocks of `block_bytes` cannot be asked; None when it can."""
    if type(block_bytes) is not int or not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
        return f"block_bytes must be an integer from {MIN_BLOCK_BYTES} to {MAX_BLOCK_BYTES}"
    if block_bytes & (block_bytes - 1):
        return "block_bytes must be a power of two"
    if type(size) is not int or not block_bytes <= size <= MAX_BYTES or size % block_bytes:
        return f"bytes must be a whole number of blocks, at most {MAX_BYTES}"
    return None


def _mix(xp: ModuleType, x: Any) -> Any:
    """One round of SplitMix64's finalizer (after its increment), on uint64 arrays, in place."""
    x += xp.uint64(_GOLDEN)
    x ^= x >> xp.uint64(30)
    x *= xp.uint64(_M1)
    x ^= x >> xp.uint64(27)
    x *= xp.uint64(_M2)
    x ^= x >> xp.uint64(31)
    return x


_FUSED: dict[tuple[str, str], Any] = {}  # (kernel, array module) -> CuPy kernel


def blocks(xp: ModuleType, fill_seed: int, first: int, count: int, words: int) -> Any:
    """Blocks first..first+count-1 of a fill, as a (count, words) uint64 array."""
    kernel = _fused_make(xp)
    if kernel is not None:
        made = kernel(xp.uint64(first * words), xp.uint64(fill_seed), size=count * words)
        return made.reshape(count, words)
    x = xp.arange(first * words, (first + count) * words, dtype=xp.uint64).reshape(count, words)
    x ^= xp.uint64(fill_seed)
    for _ in range(ROUNDS):
        _mix(xp, x)
    return x


def _fused_make(xp: ModuleType) -> Any:
    """CuPy's kernel for blocks(): each word's rounds in registers, written once (as NumPy's steps
    would, each round reads and writes the whole chunk six times). It is also what a node that
    makes blocks again instead of holding them would run: the cost docs/security.md weighs."""
    make = getattr(xp, "ElementwiseKernel", None)
    if make is None:
        return None
    if ("make", xp.__name__) not in _FUSED:
        mix = f"v += {_GOLDEN}ULL; v ^= v >> 30; v *= {_M1}ULL; v ^= v >> 27; v *= {_M2}ULL; v ^= v >> 31;"
        _FUSED["make", xp.__name__] = make(
            "uint64 start, uint64 seed",
            "uint64 x",
            f"unsigned long long v = (start + i) ^ seed;"
            f" for (int r = 0; r < {ROUNDS}; ++r) {{ {mix} }} x = v;",
            "ng_probe_make",
        )
    return _FUSED["make", xp.__name__]


def fill(xp: ModuleType, plan: Plan) -> Any:
    """The whole fill, made CHUNK_BYTES at a time into one (blocks, words) array."""
    data = xp.empty((plan.blocks, plan.words), dtype=xp.uint64)
    step = max(1, CHUNK_BYTES // plan.block_bytes)
    fill_seed = seed(plan.nonce, b"fill")
    for first in range(0, plan.blocks, step):
        count = min(step, plan.blocks - first)
        data[first : first + count] = blocks(xp, fill_seed, first, count, plan.words)
    return data


def _key(xp: ModuleType, digest_seed: int, words: int) -> Any:
    key = xp.arange(words, dtype=xp.uint64) ^ xp.uint64(digest_seed)
    return _mix(xp, key) | xp.uint64(1)  # odd: every bit of a word moves the product


def offsets(digest_seed: int, n: int, passes: int) -> list[int]:
    """Pass p's block b is keyed by block (b + offsets[p]) % n's digest of pass p - 1."""
    out = []
    for p in range(passes):
        h = hashlib.sha256(digest_seed.to_bytes(8, "little") + p.to_bytes(4, "little")).digest()
        out.append(1 + int.from_bytes(h[:8], "little") % (n - 1) if n > 1 else 0)
    return out


def _macs(xp: ModuleType, rows: Any, salts: Any, key: Any) -> Any:
    """Each row's digest: the sum of (word xor its row's salt) times the key's word, mod 2**64."""
    return ((rows ^ salts[:, None]) * key).sum(axis=1, dtype=xp.uint64)


# _macs() on a GPU: every row of the fill at once, each split among thread blocks of WORDS_PER_CTA
# words; each word read once, the row's sum gathered by one atomic add a thread block (unsigned
# arithmetic wraps in C as in NumPy, and sums mod 2**64 in any order: the same digests). CuPy's
# ReductionKernel did the same sum at 24 GB/s on an H200, half a percent of its bandwidth: it
# computes every word's index through the broadcast salts and key, one thread block a row.
_MAC_CUDA = r"""
extern "C" __global__ void ng_probe_mac(
    const unsigned long long* __restrict__ rows, const unsigned long long* __restrict__ salts,
    const unsigned long long* __restrict__ key, unsigned long long* h, long long words, long long per_cta) {
  const unsigned long long* row = rows + (long long)blockIdx.x * words;
  const unsigned long long salt = salts[blockIdx.x];
  const long long end = min((long long)(blockIdx.y + 1) * per_cta, words);
  unsigned long long sum = 0;
  #pragma unroll 8
  for (long long w = (long long)blockIdx.y * per_cta + threadIdx.x; w < end; w += blockDim.x)
    sum += (row[w] ^ salt) * key[w];
  for (int lane = 16; lane > 0; lane >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, lane);
  __shared__ unsigned long long warps[32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (blockDim.x >> 5); ++w) sum += warps[w];
    atomicAdd(h + blockIdx.x, sum);
  }
}
"""
WORDS_PER_CTA, THREADS_PER_CTA = 16384, 256


def _gpu_macs(xp: ModuleType) -> Any:
    """_macs() over a whole fill in one launch, on CuPy; None for an array module without kernels."""
    make = getattr(xp, "RawKernel", None)
    if make is None:
        return None
    if ("mac", xp.__name__) not in _FUSED:
        _FUSED["mac", xp.__name__] = make(_MAC_CUDA, "ng_probe_mac")
    kernel = _FUSED["mac", xp.__name__]

    def macs(rows: Any, salts: Any, key: Any) -> Any:
        n, words = rows.shape
        h = xp.zeros(n, dtype=xp.uint64)
        grid = (n, -(-words // WORDS_PER_CTA))
        args = (xp.ascontiguousarray(rows), salts, key, h, xp.int64(words), xp.int64(WORDS_PER_CTA))
        kernel(grid, (THREADS_PER_CTA,), args)
        return h

    return macs


def digests(xp: ModuleType, data: Any, digest_seed: int, passes: int = PASSES) -> Any:
    """The last pass's digest of every block of `data` (a fill), as a uint64 array."""
    n, words = data.shape
    key = _key(xp, digest_seed, words)
    on_gpu = _gpu_macs(xp)
    step = max(1, CHUNK_BYTES // (words * 8))  # NumPy's temporaries: a chunk's size
    h = xp.zeros(n, dtype=xp.uint64)
    for offset in offsets(digest_seed, n, passes):
        salts = xp.roll(h, -offset)  # salts[b] = h[(b + offset) % n]
        if on_gpu is not None:
            h = on_gpu(data, salts, key)
            continue
        h = xp.empty(n, dtype=xp.uint64)
        for first in range(0, n, step):
            h[first : first + step] = _macs(xp, data[first : first + step], salts[first : first + step], key)
    return h


def ready_digests(xp: ModuleType, words: int) -> None:
    """Run digests() once on two blocks of zeros, untimed: on a GPU, its kernels are compiled (or
    loaded from CuPy's cache) on first use, which took a fresh process 0.5 s on an H200, as long as
    the digests of 70 GiB themselves, and the gateway's clock would count it against the node."""
    digests(xp, xp.zeros((2, words), dtype=xp.uint64), 1)


def wrong_digests(plan: Plan, nonce2: str, answered: Sequence[int], picks: Sequence[int]) -> list[int]:
    """Of the blocks picked, those whose answered digest is not what their blocks make: each is
    worked out back through the passes, making one block a pass (on this CPU, with NumPy)."""
    import numpy as np  # the gateway's (the server extra); an agent's install needs none

    fill_seed, digest_seed = seed(plan.nonce, b"fill"), seed(nonce2, b"digest")
    n, words = plan.blocks, plan.words
    key = _key(np, digest_seed, words)
    steps = offsets(digest_seed, n, PASSES)
    made: dict[int, Any] = {}
    wrong = []
    for block in picks:
        chain = [block]  # the block whose digest of pass p the next pass's digest needs
        for offset in reversed(steps[1:]):
            chain.append((chain[-1] + offset) % n)
        h = np.zeros(1, dtype=np.uint64)
        for b in reversed(chain):
            if b not in made:
                made[b] = blocks(np, fill_seed, b, 1, words)
            h = _macs(np, made[b], h, key)
        if int(h[0]) != int(answered[block]):
            wrong.append(block)
    return wrong


@dataclass(frozen=True)
class Judged:
    passed: bool
    gbps: float  # the bandwidth the answer's time shows, as the gateway saw it
    datasheet_gbps: float


def run_here(xp: ModuleType, plan: Plan, synchronize: Any) -> dict[str, Any]:
    """The whole probe on this machine, as a gateway would judge it with no network between: the
    fill's time, the digests' time, the blocks checked, and the bandwidth. `synchronize()` waits for
    the device (CuPy runs asynchronously)."""
    import random
    import secrets
    import time

    started = time.perf_counter()
    data = fill(xp, plan)
    synchronize()
    filled = time.perf_counter() - started
    ready_digests(xp, plan.words)
    synchronize()
    nonce2 = secrets.token_hex(16)
    started = time.perf_counter()
    h = digests(xp, data, seed(nonce2, b"digest"))
    synchronize()
    seconds = time.perf_counter() - started
    del data
    answered = [int(d) for d in (h.get() if hasattr(h, "get") else h)]
    picks = random.sample(range(plan.blocks), min(CHECKS, plan.blocks))
    wrong = wrong_digests(plan, nonce2, answered, picks)
    return {
        "bytes": plan.size,
        "fill_s": round(filled, 4),
        "digest_s": round(seconds, 4),
        "make_gbps": round(plan.size / filled / 1e9, 3),  # blocks made a second, as bytes
        "gbps": round(PASSES * plan.size / seconds / 1e9, 3),
        "checked": len(picks),
        "wrong": len(wrong),
    }


def judge(size: int, seconds: float, rtt_s: float, datasheet_gbps: float) -> Judged:
    """Whether PASSES passes over `size` bytes in `seconds` (less one round trip) show at least
    MIN_SHARE of the claimed GPU's datasheet bandwidth."""
    working = max(seconds - rtt_s, 1e-6)
    gbps = PASSES * size / working / 1e9
    return Judged(gbps >= MIN_SHARE * datasheet_gbps, round(gbps, 3), datasheet_gbps)
