"""Where Supabase's Realtime serves the database, the gateway's own Realtime server stays off.

The feed the embedded server listens to (db/sql/realtime_feed.sql) is installed only where Supabase's
Realtime is absent. Against a Supabase database the gateway used to try it anyway and log "realtime
feed lost (function realtime.feed_notify(jsonb) does not exist)" five times a second, forever.
"""

from __future__ import annotations

import logging
import time

import httpx
import psycopg
import pytest
import websockets

from neuralgrid.server.settings import PLACEHOLDER_SECRET
from neuralgrid.server.stack import api_key as anon_or_service_key


def test_without_the_feed_realtime_is_off_quietly_and_the_api_still_serves(
    conn: psycopg.Connection, db_url: str, api_key: str, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    from neuralgrid.server.app import create_app
    from neuralgrid.server.serving import ThreadedServer
    from neuralgrid.server.settings import Settings

    conn.execute("drop function realtime.feed_notify(jsonb) cascade")  # as on a Supabase project
    caplog.set_level(logging.INFO)
    with ThreadedServer(create_app(Settings(), db_url, sweep=False)) as server:
        time.sleep(1.5)
        models = httpx.get(f"{server.url}/v1/models", headers={"authorization": f"Bearer {api_key}"})
        assert models.status_code == 200, models.text
        ws_url = server.url.replace("http://", "ws://") + "/realtime/v1/websocket?vsn=1.0.0&apikey="

        async def refused() -> int:
            with pytest.raises(websockets.InvalidStatus) as err:
                await websockets.connect(ws_url + anon_or_service_key(PLACEHOLDER_SECRET, "anon"))
            return err.value.response.status_code

        assert asyncio.run(refused()) == 403
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "realtime feed lost" in m], messages
    assert sum("embedded Realtime off" in m for m in messages) == 1, messages
