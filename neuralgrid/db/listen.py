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
                gen = conn.notifies()
                stopper = asyncio.ensure_future(stop.wait())
                while not stop.is_set():
                    nxt = asyncio.ensure_future(anext(gen))
                    done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    if nxt in done:
                        notify = nxt.result()
                        by_channel[notify.channel](notify.payload)
                    else:
                        nxt.cancel()
                stopper.cancel()
        except (psycopg.OperationalError, StopAsyncIteration) as err:
            log.warning("the listener lost the database (%s); retrying", err)
            reconnected()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1)
