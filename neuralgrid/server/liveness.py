"""A gateway checks in with the database every couple of seconds, under an id of its own.

Each job records the gateway that placed it (PLACE_JOB), and the sweep ends the running jobs of a
gateway silent for platform_settings.gateway_timeout_s (15 s): a gateway killed mid-request leaves
no node slot or budget hold taken for longer than that. A check-in also says where the other gateways
reach this one (its internal URL), to forward requests for the tunnels it holds; those tunnels are
forgotten, their nodes offline, when it falls silent. And it reads how long a job may run
(platform_settings.job_deadline_s), so that the gateway ends its streams before the sweep would.
With the waiting room's count, it says how many requests wait in its lines per model: the sweep counts
them toward each VRAM level's pressure (the reserve), as running jobs, while this gateway is live.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from uuid import UUID

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.gateway.tunnel import Tunnels

log = logging.getLogger(__name__)

CHECK_IN_EVERY_S = 2.0


async def check_in(
    store: Store,
    gateway_id: UUID,
    internal_url: str | None = None,
    waiting: Mapping[str, int] | None = None,
) -> q.CheckedIn:
    """One check-in; with internal_url, where the other gateways reach this one; with waiting, the
    requests waiting in this gateway's lines per model."""
    if waiting is not None:
        return await store.get(q.GATEWAY_ALIVE_WAITING, (gateway_id, internal_url, json.dumps(dict(waiting))))
    if internal_url is None:
        return await store.get(q.GATEWAY_ALIVE, (gateway_id,))
    return await store.get(q.GATEWAY_ALIVE_AT, (gateway_id, internal_url))


async def keep_checking_in(
    store: Store,
    gateway_id: UUID,
    stop: asyncio.Event,
    internal_url: str | None = None,
    deadline: Callable[[float], None] | None = None,
    tunnels: Tunnels | None = None,
    waiting: Callable[[], Mapping[str, int]] | None = None,
) -> None:
    """Check in until stop is set, through database outages (said once each); each time, the job
    deadline read goes to `deadline`. After a check-in that came late enough for a sweep to have
    judged this gateway silent, the tunnels it holds are restored (`tunnels`). `waiting()`: the requests
    waiting in this gateway's lines now, per model, reported with each check-in."""
    loop = asyncio.get_running_loop()
    down, last, restores = False, loop.time(), 0
    while not stop.is_set():
        try:
            checked = await check_in(store, gateway_id, internal_url, None if waiting is None else waiting())
            if deadline is not None:
                deadline(checked.job_deadline_s)
            if down:
                log.info("gateway %s checks in again", gateway_id)
            down = False
            if loop.time() - last > checked.gateway_timeout_s / 2:
                restores = 2  # at this check-in and the next: a sweep under way may forget them after it
            last = loop.time()
            if restores and tunnels is not None:
                restores -= 1
                if restored := await tunnels.restore(store):
                    log.warning(
                        "gateway %s checked in late: %d tunnels recorded again", gateway_id, len(restored)
                    )
        except Exception as err:  # the database is away (or refuses): try again
            if not down:
                log.warning("gateway %s cannot check in (%s); retrying", gateway_id, err)
            down = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), CHECK_IN_EVERY_S)
