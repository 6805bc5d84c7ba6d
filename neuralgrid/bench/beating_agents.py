"""Simulated node agents for `neuralgrid bench heartbeats`: one process beating for many node ids
over HTTP, each `interval_s` after its last beat ended, as the agent does, saying what an idle node
says every beat (its warm model, no load).

They beat from a thread of their own at AGENTS_NICE: their HTTP clients stand for machines of their
own, and on a machine of two cores they took CPU from the database and the gateway under test that a
real fleet does not.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from neuralgrid.agent.run import HEARTBEAT_KEEPALIVE_S
from neuralgrid.server.serving import run_fast

AGENTS_NICE = 10


class Switch(Protocol):
    """Beats on or off (the bench's Toggle): a beat whose time falls while off is skipped."""

    on: bool


def secret(i: int) -> str:
    """Node i's secret (the bench registers each node with its SHA-256)."""
    return f"bench-node-{i}"


@dataclass
class Beats:
    """What the simulated agents saw: each beat's end (perf_counter) and latency, by outcome."""

    ok: list[tuple[float, float]] = field(default_factory=list)
    failed: list[float] = field(default_factory=list)
    nice: int | None = None  # their thread's, as read from it

    def between(self, start: float, end: float) -> tuple[int, list[float], int]:
        done = [ms for at, ms in self.ok if start <= at < end]
        return len(done), done, len([at for at in self.failed if start <= at < end])


async def beating(
    gateway: str,
    ids: list[str],
    model: str,
    interval_s: float,
    beats: Beats,
    stop: asyncio.Event,
    toggle: Switch,
) -> None:
    """Every node beats, staggered over an interval, `interval_s` after its last beat ended (a beat
    whose time falls while the toggle is off is skipped: no burst when it turns on again)."""
    timeout = aiohttp.ClientTimeout(total=30)
    body = f'{{"models": ["{model}"]}}'.encode()

    async def agent(i: int) -> None:
        url = f"{gateway}/v1/nodes/{ids[i - 1]}/heartbeat"
        headers = {"authorization": f"Bearer {secret(i)}", "content-type": "application/json"}
        # A connection of its own, kept alive as the agent keeps it (not a pool's, shared).
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=HEARTBEAT_KEEPALIVE_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s * i / len(ids))
            while not stop.is_set():
                if not toggle.on:
                    with suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), interval_s)
                    continue
                started = time.perf_counter()
                try:
                    async with http.post(url, data=body, headers=headers) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                ended = time.perf_counter()
                if ok:
                    beats.ok.append((ended, (ended - started) * 1000))
                else:
                    beats.failed.append(ended)
                with suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_s)

    await asyncio.gather(*(agent(i) for i in range(1, len(ids) + 1)))


def beating_elsewhere(
    gateway: str, ids: list[str], model: str, interval_s: float, beats: Beats, toggle: Switch
) -> Callable[[], None]:
    """The agents, beating from a thread of their own at AGENTS_NICE (its own event loop); returns
    the call that stops them and waits for their last beats."""
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    ready = threading.Event()

    async def beat() -> None:
        stop = asyncio.Event()
        running.append((asyncio.get_running_loop(), stop))
        ready.set()
        await beating(gateway, ids, model, interval_s, beats, stop, toggle)

    def main() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), AGENTS_NICE)  # this thread only
        beats.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        run_fast(beat())

    thread = threading.Thread(target=main, name="agents", daemon=True)
    thread.start()
    ready.wait(30)

    def halt() -> None:
        loop, stop = running[0]
        loop.call_soon_threadsafe(stop.set)
        thread.join()

    return halt
