"""The gateway's one LISTENing connection: Postgres announces API key changes and freed slots on it.

LISTEN needs a session of its own (behind a pooler: session pooling, see docs/scaling.md), so every
channel shares one. While it is lost, announcements are missed: on each (re)connect `reconnected`
runs, for the listeners to assume they missed something.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from neuralgrid.db.queries import Query
from neuralgrid.db.store import Store

log = logging.getLogger(__name__)


def channel(listen: Query[Any]) -> str:
    """The channel a LISTEN statement names (its last word)."""
    return listen.sql.split()[-1]


async def listen(
    url: str,
    handlers: Mapping[Query[Any], Callable[[str], None]],
    stop: asyncio.Event,
    reconnected: Callable[[], None],
) -> None:
    """Run each LISTEN statement and pass every notification's payload to its handler, until `stop`;
    on a lost connection, reconnect after a second."""
    by_channel = {channel(query): handle for query, handle in handlers.items()}
    while not stop.is_set():
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                for query in handlers:
                    await Store(conn).all(query)
                reconnected()
                # One task reads the notifications for as long as the connection lasts (a future
                # per notification cost the gateway ~2% of its CPU: one comes with each freed slot).
                reader = asyncio.ensure_future(_deliver(conn, by_channel))
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not reader.done():  # stopping
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reader
                else:
                    reader.result()  # the connection's end, raised
        except psycopg.OperationalError as err:
            log.warning("the listener lost the database (%s); retrying", err)
            reconnected()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1)


async def _deliver(
    conn: psycopg.AsyncConnection[Any], by_channel: Mapping[str, Callable[[str], None]]
) -> None:
    """Pass each notification to its channel's handler; raises when the connection ends."""
    async for notify in conn.notifies():
        by_channel[notify.channel](notify.payload)
    raise psycopg.OperationalError("the listening connection closed")
