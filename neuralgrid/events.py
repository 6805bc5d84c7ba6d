"""asyncio waits the gateway's background writers share."""

from __future__ import annotations

import asyncio


async def any_set(*events: asyncio.Event, timeout: float) -> None:
    """Return once any of `events` is set, or after `timeout` seconds (a writer's next turn)."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
