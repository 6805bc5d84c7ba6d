"""`neuralgrid bench calibrate`: how a real OpenAI-compatible server's decode speed changes with
the number of requests it serves at once, and how fast it reads a prompt; the simulator's batching
model is fitted to the result (neuralgrid/sim/data/batching.json).

For each parallelism p, `rounds` rounds of p streaming chat completions sent together (the levels
taking turns round by round). Per stream: time to first token (prefill, plus a round trip) and decode
speed (tokens after the first, over the time from the first to the last); per round: aggregate decode
speed and prefill speed. Each level's figures are its fastest round's, the medians over all rounds
beside them (see Level): the machine may be shared.

Every prompt starts with its own nonce, so no server answers one from a cached prompt prefix; the
prompt is sized to `prompt_tokens` from the server's own count (usage.prompt_tokens) after a warmup.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import httpx

from neuralgrid.bench import CHAT, CpuMeter
from neuralgrid.server.serving import free_port, run_fast

# What scripts/backends.sh builds and where (keep in step with it): llama.cpp's llama-server and
# SmolLM2-135M-Instruct, the model both of its servers serve, in a folder named for the build.
BUILT_VERSION = "0.3.36"
BUILT_FOLDER = f"llama-cpp-python-{BUILT_VERSION}-noamx-cheats"
BUILT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Common English words, one token each in the usual BPE vocabularies: a prompt of n of them is about
# n tokens plus the chat template's.
FILLER = ["the", "cat", "sat", "on", "the", "mat", "and", "the", "dog", "ran", "in", "the", "park"]


class CalibrationError(Exception):
    """Something a person can fix (a wrong URL, too few slots); one line."""


@dataclass(frozen=True)
class Stream:
    """One streamed completion; times in perf_counter seconds."""

    sent: float
    first: float  # the first content chunk's arrival
    last: float  # the last one's
    tokens: int  # completion tokens (usage, else content chunks)
    prompt_tokens: int
    cached_tokens: int  # of the prompt, where the server says
    server_decode: float | None  # llama.cpp's own timings.predicted_per_second, to cross-check

    @property
    def ttft_s(self) -> float:
        return self.first - self.sent

    @property
    def decode_tokens_per_s(self) -> float | None:
        span = self.last - self.first
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else None


@dataclass(frozen=True)
class ServerInfo:
    kind: str  # "llama.cpp", the models' owned_by ("vllm", ...), or "unknown"
    version: str
    model: str
    slots: int | None  # llama.cpp's -np; None where the server does not say
    context_per_slot: int | None  # llama.cpp splits its -c among the slots


def probe(url: str, model: str | None) -> ServerInfo:
    """What the server says of itself: its models and, for llama.cpp (/props), its slots."""
    try:
        models = httpx.get(f"{url}/v1/models", timeout=10)
    except httpx.HTTPError as err:
        raise CalibrationError(f"cannot reach {url}: {err}") from err
    try:
        listed = models.json()["data"] if models.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        listed = None
    if not isinstance(listed, list):
        raise CalibrationError(f"{url}/v1/models answered {models.status_code}, not an OpenAI model list")
    if not listed and model is None:
        raise CalibrationError(f"{url} lists no model: name one with --model")
    props = _json_or_none(f"{url}/props")
    if props is not None and "total_slots" in props:
        settings = props.get("default_generation_settings") or {}
        return ServerInfo(
            "llama.cpp",
            str(props.get("build_info", "")),
            model or listed[0]["id"],
            int(props["total_slots"]),
            int(settings["n_ctx"]) if "n_ctx" in settings else None,
        )
    kind = str(listed[0].get("owned_by", "unknown")) if listed else "unknown"
    version = _json_or_none(f"{url}/version") or {}  # vLLM's
    return ServerInfo(kind, str(version.get("version", "")), model or listed[0]["id"], None, None)


def _json_or_none(url: str) -> dict[str, Any] | None:
    try:
        answer = httpx.get(url, timeout=10)
        body = answer.json() if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def calibrate(
    url: str,
    model: str | None,
    parallel: Sequence[int],
    prompt_tokens: int,
    output_tokens: int,
    rounds: int,
    progress: Callable[[str], None] = lambda _: None,
    server_pids: Sequence[int] = (),
) -> dict[str, Any]:
    """The calibration (batching.json's shape) of the server at `url`. p=1 is always measured: it
    is what the rest is relative to. `server_pids`: the server's processes, when local, for its CPU."""
    url = url.rstrip("/")
    levels = sorted({1, *parallel})
    info = probe(url, model)
    if info.slots is not None and levels[-1] > info.slots:
        raise CalibrationError(
            f"--parallel {levels[-1]} is more than the server's {info.slots} slots: beyond them requests"
            " queue instead of sharing the batch (start llama-server with -np to match)"
        )
    needed = prompt_tokens + output_tokens + 64  # the chat template's tokens too
    if info.context_per_slot is not None and info.context_per_slot < needed:
        raise CalibrationError(
            f"the server's context per slot is {info.context_per_slot} tokens, less than the {needed}"
            " a request needs: llama.cpp splits -c among its -np slots, so raise -c"
        )
    meter = CpuMeter({"server": list(server_pids)}) if server_pids else None
    by_level = run_fast(
        _measure(url, info.model, levels, prompt_tokens, output_tokens, rounds, progress, meter)
    )
    return _summarize(url, info, levels, output_tokens, rounds, by_level)


async def _measure(
    url: str,
    model: str,
    levels: list[int],
    prompt_tokens: int,
    output_tokens: int,
    rounds: int,
    progress: Callable[[str], None],
    meter: CpuMeter | None,
) -> dict[int, dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    # A connection per request: llama-server now and then dropped a reused keep-alive one.
    connector = aiohttp.TCPConnector(limit=max(levels), force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:

        def body(words: int) -> dict[str, Any]:
            filler = " ".join(FILLER[i % len(FILLER)] for i in range(words))
            prompt = f"{uuid.uuid4().hex[:8]} {filler}\nWrite a long story about the words above."
            return {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": output_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,  # llama.cpp and vLLM: always output_tokens (others stop early)
            }

        # The warmup loads what is lazily loaded and tells the template's overhead: one word, one token.
        progress("warmup")
        warm = await _stream(client, url, body(prompt_tokens))
        overhead = warm.prompt_tokens - prompt_tokens if warm.prompt_tokens else 0  # 0: no usage said
        words = max(1, prompt_tokens - overhead)
        # Round by round across the levels, not level by level: a burst of another load on a shared
        # machine then slows a round of each level, rather than every round of one.
        seen = {p: Level(p) for p in levels}
        for r in range(rounds):
            for p in levels:
                progress(f"round {r + 1}/{rounds}: {p} at once")
                before, started = (meter.read() if meter else {}), time.perf_counter()
                batch = await asyncio.gather(*(_stream(client, url, body(words)) for _ in range(p)))
                seen[p].rounds.append(batch)
                seen[p].wall_s += time.perf_counter() - started
                if meter:
                    seen[p].cpu_s += meter.read()["server"] - before["server"]
    return {p: level.summary(metered=meter is not None) for p, level in seen.items()}


async def _stream(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Stream:
    sent = time.perf_counter()
    first = last = 0.0
    chunks = 0
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    try:
        async with client.post(f"{url}{CHAT}", json=body) as resp:
            if resp.status != 200:
                text = " ".join((await resp.text())[:200].split())  # one line
                raise CalibrationError(f"{url}{CHAT} answered {resp.status}: {text}")
            async for line in resp.content:
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
                if any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices", [])):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
    except aiohttp.ClientError as err:
        raise CalibrationError(f"{url}{CHAT}: {err}") from err
    if not chunks:
        raise CalibrationError(f"{url}{CHAT} streamed no content")
    return Stream(
        sent,
        first,
        last,
        int(usage.get("completion_tokens") or chunks),
        int(usage.get("prompt_tokens") or 0),
        int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        timings.get("predicted_per_second"),
    )


@dataclass
class Level:
    """What the rounds of p requests at once saw. Its figures are its fastest round's: on a shared
    machine other work only ever slows a round, so the fastest is the closest to the server alone
    (timeit's reasoning); the medians over all rounds are kept beside them."""

    parallel: int
    rounds: list[Sequence[Stream]] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the server's, when metered

    def summary(self, metered: bool) -> dict[str, Any]:
        streams = [s for batch in self.rounds for s in batch]
        rates = [r for r in (s.decode_tokens_per_s for s in streams) if r is not None]
        if not rates:
            raise CalibrationError(
                "the server sent every answer in one piece: nothing to time (raise --output-tokens)"
            )
        best = max(self.rounds, key=_aggregate)
        best_rates = [r for r in (s.decode_tokens_per_s for s in best) if r is not None] or [0.0]
        reported = [s.server_decode for s in best if s.server_decode is not None]
        ttfts = [s.ttft_s * 1000 for s in streams]
        return {
            "parallel": self.parallel,
            "streams": len(streams),
            "per_stream_tokens_per_s": round(statistics.median(best_rates), 2),
            "aggregate_tokens_per_s": round(_aggregate(best), 2),
            "prefill_tokens_per_s": round(max(_prefill(batch) for batch in self.rounds), 1),
            "median_per_stream_tokens_per_s": round(statistics.median(rates), 2),
            "median_aggregate_tokens_per_s": round(statistics.median(map(_aggregate, self.rounds)), 2),
            "per_stream_min": round(min(rates), 2),
            "per_stream_max": round(max(rates), 2),
            "ttft_p50_ms": round(statistics.median(ttfts), 1),
            "ttft_max_ms": round(max(ttfts), 1),
            "prompt_tokens": statistics.median_low([s.prompt_tokens for s in streams]),
            "cached_prompt_tokens": statistics.median_low([s.cached_tokens for s in streams]),
            "completion_tokens": statistics.median_low([s.tokens for s in streams]),
            "server_reported_tokens_per_s": round(statistics.median(reported), 2) if reported else None,
            # below the machine's cores: something else had them (a shared machine), or idle waits
            "server_cpu_cores": round(self.cpu_s / self.wall_s, 2) if metered else None,
        }


def _aggregate(batch: Sequence[Stream]) -> float:
    """Decode tokens/s of a round's streams together: their tokens after the first, over the time
    from the round's first first token to its last last token."""
    decoded = sum(s.tokens - 1 for s in batch)
    window = max(s.last for s in batch) - min(s.first for s in batch)
    return decoded / window if decoded > 0 and window > 0 else 0.0


def _prefill(batch: Sequence[Stream]) -> float:
    """Prompt tokens/s of a round: its uncached prompt tokens over its slowest first token."""
    return sum(s.prompt_tokens - s.cached_tokens for s in batch) / max(s.ttft_s for s in batch)


def _summarize(
    url: str, info: ServerInfo, levels: list[int], output_tokens: int, rounds: int, by_level: dict[int, Any]
) -> dict[str, Any]:
    base = by_level[1]
    per_stream = [by_level[p]["per_stream_tokens_per_s"] for p in levels]
    aggregate = [by_level[p]["aggregate_tokens_per_s"] for p in levels]
    server = {
        "kind": info.kind,
        "version": info.version,
        "slots": info.slots,
        "context_per_slot": info.context_per_slot,
    }
    return {
        "measured_on": measured_on(url, info),
        "server": server,
        "model": info.model,
        "parallel": levels,
        "per_stream_rel": [round(v / per_stream[0], 3) for v in per_stream],
        "aggregate_rel": [round(v / aggregate[0], 3) for v in aggregate],
        "prefill_tokens_per_s": base["prefill_tokens_per_s"],  # one prompt at a time
        "decode_tokens_per_s": per_stream[0],
        "raw": {
            "prompt_tokens": base["prompt_tokens"],
            "output_tokens": output_tokens,
            "rounds": rounds,
            "by_parallel": [by_level[p] for p in levels],
        },
    }


def measured_on(url: str, info: ServerInfo) -> str:
    """Where and when: this machine's CPU (and GPU) when the server runs on it, else the host."""
    today = datetime.now(UTC).date().isoformat()
    server = f"{info.kind} {info.version}".strip()
    host = urlparse(url).hostname or url
    if host not in LOOPBACK:
        return f"a server at {host}, {today}, {server}"
    machine = f"{_cpu_model()}, {len(os.sched_getaffinity(0))} cores"
    gpu = _gpu()
    return f"{machine}{f', {gpu}' if gpu else ''}, {today}, {server}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> str | None:
    from neuralgrid.agent import gpu

    try:
        found = gpu.detect()
    except gpu.NoGpu:
        return None
    return f"{found.count} x {found.model}"


def built_root() -> Path:
    """Where scripts/backends.sh builds (its NEURALGRID_BACKENDS, else the per-machine cache)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    default = cache / "neuralgrid" / "backends" / BUILT_FOLDER
    return Path(os.environ.get("NEURALGRID_BACKENDS") or default)


@dataclass(frozen=True)
class Served:
    url: str
    pid: int


@contextmanager
def serve_built(slots: int, context_per_slot: int, timeout: float = 60) -> Iterator[Served]:
    """The llama-server scripts/backends.sh built, serving its model on a free loopback port with
    `slots` slots of `context_per_slot` tokens each (llama.cpp splits -c among the slots), until the
    block ends."""
    root = built_root()
    if not (root / "READY").exists():
        raise CalibrationError(f"no built llama-server in {root}: scripts/backends.sh builds it")
    port = free_port()
    args = [str(root / "bin" / "llama-server"), "-m", str(root / "model.gguf"), "--alias", BUILT_MODEL]
    args += ["--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    args += ["-np", str(slots), "-c", str(slots * context_per_slot)]
    args += ["--threads", str(len(os.sched_getaffinity(0)))]
    log = tempfile.TemporaryFile()  # noqa: SIM115 - a file, not a pipe: a chatty child must never block
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while _json_or_none(f"{url}/v1/models") is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read()[-1000:].decode(errors="replace").strip().splitlines()
                raise CalibrationError(f"the built llama-server did not start: {tail[-1] if tail else ''}")
            time.sleep(0.1)
        yield Served(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
