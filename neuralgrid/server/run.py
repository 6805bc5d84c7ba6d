"""The platform as one process: gateway (with Realtime and the web map), sweeper, demo fleet.

`neuralgrid up` calls serve(); it returns once SIGINT or SIGTERM has drained the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable

import psycopg

from neuralgrid.admin import fleet
from neuralgrid.db.migrate import Progress, Quiet
from neuralgrid.dev import demo as demo_fleet
from neuralgrid.server import running, stack
from neuralgrid.server.app import create_app
from neuralgrid.server.serving import make_server, tune_collector
from neuralgrid.server.settings import Settings
from neuralgrid.web.signin import signin_link

log = logging.getLogger(__name__)


def listen(host: str, port: int) -> socket.socket:
    """The gateway's socket, bound before anything else starts: a taken port fails here, at once
    (uvicorn would exit from inside its task and leave the process hanging), and port 0 gets a free
    port whose number is then known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)  # uvicorn's backlog


async def serve(
    settings: Settings,
    url: str,
    demo: int,
    say: Callable[[str], None],
    listener: socket.socket,
    progress: Progress | None = None,
) -> None:
    """Serve on `listener` until a signal; `demo` nodes of the demo fleet are served by one fake
    node. While it serves, the stack is recorded in NEURALGRID_HOME for the other commands."""
    progress = progress or Quiet()
    settings = settings.model_copy(update={"port": listener.getsockname()[1]})  # the port really bound
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    gateway = make_server(create_app(settings, url), settings.host, settings.port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(gateway, "should_exit", True))
    # Entered resources (the demo node) stop after the gateway has drained.
    async with contextlib.AsyncExitStack() as resources:
        if demo:
            progress.step(f"registering {demo} demo nodes")
            backend_url = await resources.enter_async_context(demo_fleet.backend())
            with psycopg.connect(url, autocommit=True) as conn:
                specs = fleet.read_fleet(demo_fleet.DEMO_FLEET)[:demo]
                served = {"endpoint_url": backend_url, "backend": demo_fleet.FAKE_BACKEND}
                fleet.import_fleet(conn, [s.model_copy(update=served) for s in specs])
            heartbeats = asyncio.create_task(demo_fleet.keep_alive(url, stop), name="demo heartbeats")
            heartbeats.add_done_callback(_report_early_end)
            tasks.append(heartbeats)
        # Recorded before the gateway answers its first request (the socket already listens), so
        # whoever sees /readyz answer also finds the record.
        me = running.this_process(settings, url, settings.host, settings.port)
        if other := running.record(settings, me):
            say(f"note      commands keep talking to the stack of pid {other.pid} ({other.gateway_url})")
        resources.callback(running.forget, settings, me.pid)  # on every way out but kill -9
        progress.step(f"starting the gateway on {settings.host}:{settings.port}")
        tasks.append(asyncio.create_task(gateway.serve(sockets=[listener])))
        gateway_url = stack.public_base_url(settings)
        realtime_url = gateway_url.replace("http", "ws", 1)
        say(f"database  {url}")
        say(f"gateway   {gateway_url}/v1  (OpenAI-compatible; docs at {gateway_url}/docs)")
        say(f"map       {gateway_url}/  (live; Realtime at {realtime_url}/realtime/v1)")
        say(f"sweeper   every {settings.sweep_interval_s:g}s")
        if demo:
            say(f"demo      {demo} nodes online, served by a fake OpenAI-compatible node")
        if link := signin_link(settings, gateway_url):  # one use, 10 minutes
            say(f"sign in   {link}")
        while not gateway.started and not tasks[-1].done():  # its services built (the lifespan)
            await asyncio.sleep(0.05)
        tune_collector()
        await tasks[-1]  # returns once a signal sets should_exit and the gateway has drained
        stop.set()
        for task in tasks[:-1]:
            task.cancel()
        await asyncio.gather(*tasks[:-1], return_exceptions=True)


def _report_early_end(task: asyncio.Task[None]) -> None:
    """A background task that fails says so when it does: the gather at shutdown keeps its error quiet."""
    if not task.cancelled() and (err := task.exception()) is not None:
        log.error("%s stopped: %s", task.get_name(), err, exc_info=err)
