"""The map's feed (issue 41): a map viewer hears a summary of the fleet on the public `map:summary`
topic, at most once a second however many nodes change, never a message per node.

The summary is computed in SQL (private.send_map_summary(), supabase/schemas/115_map.sql), which
broadcasts it with realtime.send() when it changed, as the changes from the last one. Each gateway
calls it every second while it has a viewer: while someone subscribes to map:summary on its embedded
Realtime, or always when a hosted project's Realtime serves the viewers (the gateway cannot see them
there). Between all the gateways one call in 950 ms computes it; the others return at once. The
map's page is served by a gateway, so wherever a viewer is, a gateway runs to feed it: no pg_cron job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from neuralgrid.db import queries as q
from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.store import Store

log = logging.getLogger(__name__)

TOPIC = "map:summary"
INTERVAL_S = 1.0
WARN_EVERY_S = 60.0


async def run_map_feed(store: Store, stop: asyncio.Event, wanted: Callable[[], bool]) -> None:
    """Until stopped: every second that `wanted()` says a viewer may be listening, asks the database
    to send the summary (it decides whether one is due and changed). A failure is logged, at most a
    line a minute, and the next second tries again."""
    warned_at = float("-inf")
    while not stop.is_set():
        if wanted():
            try:
                await store.get(q.SEND_MAP_SUMMARY)
            except DatabaseError as err:
                if time.monotonic() - warned_at > WARN_EVERY_S:
                    warned_at = time.monotonic()
                    log.warning("the map's summary could not be sent (%s); retrying every second", err)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), INTERVAL_S)
