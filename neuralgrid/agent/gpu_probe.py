"""The agent's side of the GPU probe (neuralgrid/verify/gpu_probe.py): fill GPU memory from the
gateway's nonce, then answer the digests it asks for, timed by the gateway.

The arithmetic runs on the GPU through CuPy (`pip install 'neuralgrid[gpu]'`); on a machine without
an NVIDIA GPU, or without CuPy, the agent says so and why, and fills nothing. One probe at a time;
its memory is given back once it has answered, or when a fill is left unanswered for FORGET_S.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from types import ModuleType
from typing import Any

from neuralgrid.verify import gpu_probe as probe

log = logging.getLogger(__name__)

FORGET_S = 120.0


def gpu_arrays() -> tuple[ModuleType | None, str]:
    """CuPy on this machine's first GPU, and its name; or None and why there is none."""
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None, "no GPU library: the GPU probe needs CuPy (pip install 'neuralgrid[gpu]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "no NVIDIA GPU found (CUDA sees no device)"
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    except Exception as err:  # CUDA's own errors: no driver, no device
        return None, f"no NVIDIA GPU found (CUDA: {err})"
    return cupy, name.decode() if isinstance(name, bytes) else str(name)


class GpuProbeHost:
    """Answers the gateway's probe requests: {"op": "fill" | "digest" | "ping", ...}."""

    def __init__(self, xp: ModuleType | None, device: str) -> None:
        self.xp, self.device = xp, device  # device: the GPU's name, or why there is none
        self._filled: Any = None  # the fill's array, until its digests are asked for
        self._expiry: asyncio.TimerHandle | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def detect(cls) -> GpuProbeHost:
        return cls(*gpu_arrays())

    async def answer(self, body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            request = json.loads(body)
            op = request["op"]
        except (ValueError, KeyError, TypeError):
            return 400, _error('a probe request is a JSON object with an "op"')
        if op == "ping":
            return 200, {"gpu": self.xp is not None}
        if self.xp is None:
            return 200, {"gpu": False, "reason": self.device}
        if op == "fill":
            return await self._fill(request)
        if op == "digest":
            return await self._digest(request)
        return 400, _error(f"unknown probe op: {str(op)[:40]}")

    async def _fill(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        nonce: Any = request.get("nonce")
        size: Any = request.get("bytes")
        block_bytes: Any = request.get("block_bytes", probe.BLOCK_BYTES)
        why = probe.plan_error(size, block_bytes)
        if why is not None:
            return 400, _error(why)
        if not (isinstance(nonce, str) and 16 <= len(nonce) <= 128):
            return 400, _error("nonce must be a string of 16 to 128 characters")
        plan = probe.Plan(nonce, size, block_bytes)
        async with self._lock:
            self._filled = None  # one at a time: a new fill replaces an unanswered one
            started = time.perf_counter()
            try:
                data = await asyncio.to_thread(self._fill_now, plan)
            except (
                MemoryError
            ) as err:  # CuPy's OutOfMemoryError is one (a 409: a 5xx would read as a failing node)
                return 409, _error(f"not enough free GPU memory for {size} bytes: {err}")
            self._filled = data
            self._drop_expiry()
            self._expiry = asyncio.get_running_loop().call_later(FORGET_S, self._forget)
        return 200, {"gpu": True, "device": self.device, "seconds": round(time.perf_counter() - started, 3)}

    def _fill_now(self, plan: probe.Plan) -> Any:
        data = probe.fill(self._xp(), plan)
        probe.ready_digests(self._xp(), plan.words)
        self._synchronize()
        return data

    async def _digest(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        nonce2 = request.get("nonce")
        if not (isinstance(nonce2, str) and 16 <= len(nonce2) <= 128):
            return 400, _error("nonce must be a string of 16 to 128 characters")
        async with self._lock:
            filled, self._filled = self._filled, None
            self._drop_expiry()
            if filled is None:
                return 409, _error("nothing is filled: a digest follows a fill")
            digests = await asyncio.to_thread(self._digest_now, filled, nonce2)
            del filled  # its memory goes back to the GPU's pool
        return 200, {"digests": base64.b64encode(digests).decode("ascii")}

    def _digest_now(self, data: Any, nonce2: str) -> bytes:
        xp = self._xp()
        h = probe.digests(xp, data, probe.seed(nonce2, b"digest"))
        host = h.get() if hasattr(h, "get") else h  # CuPy's arrays come back to the host
        return bytes(host.astype("<u8").tobytes())

    def _forget(self) -> None:
        self._filled, self._expiry = None, None

    def _drop_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _xp(self) -> ModuleType:
        assert self.xp is not None
        return self.xp

    def _synchronize(self) -> None:
        cuda = getattr(self.xp, "cuda", None)
        if cuda is not None:
            cuda.Stream.null.synchronize()


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}
