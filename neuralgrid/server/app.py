"""The platform's one assembly point: the gateway's API, Realtime and the web pages mounted as peers
on one FastAPI app, the shared services built in its lifespan, and the error bodies."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from neuralgrid import __version__
from neuralgrid.db import queries as q
from neuralgrid.db.errors import DatabaseError
from neuralgrid.db.listen import listen
from neuralgrid.db.pool import LastInFirstOut, commit_asynchronously
from neuralgrid.db.queries import CHECK_STATES, FLEET_GAUGES, PING
from neuralgrid.db.store import Store
from neuralgrid.gateway import forward, openapi, routes_keys, routes_nodes, routes_openai
from neuralgrid.gateway import peers as forwarding
from neuralgrid.gateway.auth import KeyStore
from neuralgrid.gateway.claims import Claims
from neuralgrid.gateway.completions import Completions
from neuralgrid.gateway.errors import (
    DatabaseUnavailable,
    GatewayError,
    InternalError,
    from_database,
    from_http,
    invalid,
)
from neuralgrid.gateway.escrow import Escrows
from neuralgrid.gateway.gpu_prober import GpuProber
from neuralgrid.gateway.heartbeats import Heartbeats
from neuralgrid.gateway.journal import Journal, Spool, replay_orphans
from neuralgrid.gateway.leases import LeaseBook
from neuralgrid.gateway.metrics import Metrics
from neuralgrid.gateway.pipeline import Pipeline
from neuralgrid.gateway.pipeline.admit import Admission, Catalog
from neuralgrid.gateway.pipeline.leased import LeasedJobs
from neuralgrid.gateway.pipeline.meter import Metering
from neuralgrid.gateway.pipeline.place import Placement
from neuralgrid.gateway.pipeline.relay import JobDeadline, Relay
from neuralgrid.gateway.pipeline.send import Sender
from neuralgrid.gateway.prompt_cache import SALTS, PromptCaches
from neuralgrid.gateway.ratelimit import RateLimiter
from neuralgrid.gateway.renewals import keep_renewing
from neuralgrid.gateway.tunnel import Tunnels
from neuralgrid.gateway.upstream import HttpNodes
from neuralgrid.gateway.verifier import Verifier
from neuralgrid.gateway.waiting import WaitingRoom
from neuralgrid.protocol import signing
from neuralgrid.realtime import socket as realtime_socket
from neuralgrid.realtime.hub import Hub
from neuralgrid.server.asgi import App
from neuralgrid.server.deps import ServicesDep
from neuralgrid.server.liveness import check_in, keep_checking_in
from neuralgrid.server.services import Services
from neuralgrid.server.settings import Settings
from neuralgrid.server.sweeper import run_sweeper
from neuralgrid.server.tokens import TokenKeys, stack_api_keys
from neuralgrid.verify.client import RefereeClient
from neuralgrid.web import routes as web_routes
from neuralgrid.web.map_feed import TOPIC as MAP_TOPIC
from neuralgrid.web.map_feed import run_map_feed
from neuralgrid.web.stats import StatsCache

log = logging.getLogger(__name__)

STOP_S = 2.0  # on shutdown, how long the background loops have to end once told to


def create_app(settings: Settings, database_url: str, *, sweep: bool = True) -> FastAPI:
    """The gateway for one database. `sweep` runs the health sweeper in this process too."""
    metrics_holder: list[Metrics] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        connection: dict[str, Any] = {"autocommit": True}  # prepared none: db/pool.py
        session_url = settings.session_database_url or database_url  # LISTEN and the sweeper
        async_commit = settings.async_commit and not settings.transaction_pooler
        pool = LastInFirstOut(
            database_url, min_size=2, max_size=settings.db_pool_size, kwargs=connection, open=False
        )
        await pool.open(wait=True, timeout=30)
        # The request path's own connections: see Settings.async_commit.
        jobs_pool = LastInFirstOut(
            database_url,
            min_size=settings.request_pool_size,
            max_size=settings.request_pool_size,
            kwargs=connection,
            # A session setting: behind a transaction pooler it would land on others' connections.
            configure=commit_asynchronously if async_commit else None,
            open=False,
        )
        await jobs_pool.open(wait=True, timeout=30)
        nodes = HttpNodes(
            settings.connect_timeout_s,
            settings.first_byte_timeout_s,
            public_only=not settings.private_endpoints_allowed,
        )
        metrics = Metrics()
        metrics_holder.append(metrics)
        store = Store(pool)
        keys = KeyStore(store, settings.key_cache_ttl_s)
        limiter = RateLimiter(settings.redis_url)
        room = WaitingRoom(settings.queue_max_waiting)
        gateway_id = uuid.uuid4()
        peers = forwarding.Peers(
            store, gateway_id, forwarding.forwarding_key(settings), settings.connect_timeout_s
        )
        tunnels = Tunnels(gateway_id, peers)
        internal_url = forwarding.internal_url(settings)
        # Known before it places a job or holds a tunnel; and the job deadline, before it relays a stream.
        deadline = JobDeadline((await check_in(store, gateway_id, internal_url)).job_deadline_s)
        catalog = Catalog(store)  # the models' kinds and prices, for admission and escrows alike
        leased = None
        if settings.leases:  # first what gateways that died here left unwritten
            spool = settings.spool / hashlib.sha256(database_url.encode()).hexdigest()[:16]  # this database's
            await replay_orphans(store, spool)
            leased = _leased(store, gateway_id, spool, room, catalog)
        pipeline = _pipeline(
            settings,
            Store(jobs_pool),
            nodes,
            limiter,
            metrics,
            tunnels,
            room,
            gateway_id,
            deadline,
            catalog,
            leased,
        )
        hub = Hub(pool, session_url)
        tokens = TokenKeys(
            settings.jwt_secret,
            settings.signing_keys_url,
            api_keys=tuple(stack_api_keys(settings.jwt_secret).values()),
        )
        heartbeats = Heartbeats(store, settings.heartbeat_flush_s)
        services = Services(
            settings, store, keys, pipeline, metrics, tunnels, peers, hub, StatsCache(), tokens, heartbeats
        )
        app.state.services = services
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(
                listen(
                    session_url,
                    {
                        q.LISTEN_KEY_CHANGES: keys.forget,
                        q.LISTEN_FREE_SLOTS: room.slot_freed,
                        q.LISTEN_NODE_SECRETS: heartbeats.forget,
                    },
                    stop,
                    reconnected=lambda: _missed(keys, room, heartbeats),
                )
            ),
            asyncio.create_task(
                keep_checking_in(
                    store, gateway_id, stop, internal_url, deadline.learned, tunnels, room.waiting
                )
            ),
            asyncio.create_task(heartbeats.run(stop)),
        ]
        if leased is not None:
            metrics.journal_pending.set_function(leased.journal.pending)
            tasks.append(asyncio.create_task(leased.journal.run(stop)))
            tasks.append(asyncio.create_task(keep_renewing(stop, leased.renew)))
        if await store.get(q.REALTIME_FEED_INSTALLED):
            tasks.append(asyncio.create_task(hub.run(stop)))
            # Serve only once the Realtime feed listens, so no change committed after startup is missed.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hub.listening.wait(), 10)
        else:
            hub.off = "Supabase's Realtime serves this database: connect to the project's /realtime/v1"
            log.info("embedded Realtime off: %s", hub.off)
        # The map's summary on map:summary (web/map_feed.py): while this gateway has a map viewer, or,
        # where a hosted project's Realtime serves the viewers (unseen here), from every sweeping gateway.
        if hub.off is None:
            viewed = functools.partial(hub.rooms.__contains__, (MAP_TOPIC, False))
            tasks.append(asyncio.create_task(run_map_feed(store, stop, viewed)))
        elif sweep:
            tasks.append(asyncio.create_task(run_map_feed(store, stop, lambda: True)))
        referee = RefereeClient(settings.referee_url) if settings.referee_url else None
        if referee is not None or settings.cross_checks:  # sent as any request is, from the pipeline
            verifier = Verifier(
                store,
                gateway_id,
                referee,
                pipeline.sender,
                pipeline.metering,
                pipeline.admission.caches,
                metrics,
                in_flight=settings.challenges_in_flight,
                audit_share=settings.audit_share,
                cross_checks=settings.cross_checks,
            )
            pipeline.audit = verifier.audit
            pipeline.relay.audit = verifier.audit_stream
            tasks.append(asyncio.create_task(verifier.run(stop)))
        if settings.gpu_probes:
            prober = GpuProber(store, pipeline.sender, metrics, fill_share=settings.gpu_probe_fill_share)
            tasks.append(asyncio.create_task(prober.run(stop)))
        if sweep:
            own = functools.partial(check_in, gateway_id=gateway_id, internal_url=internal_url)
            tasks.append(asyncio.create_task(run_sweeper(session_url, settings.sweep_interval_s, stop, own)))
        try:
            yield
        finally:
            stop.set()
            _, stuck = await asyncio.wait(tasks, timeout=STOP_S)
            for task in stuck:  # a loop that does not heed `stop` must not keep the gateway up
                log.warning("%s still ran %.0f s into shutdown; cancelled", task.get_coro(), STOP_S)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Side by side: a leased job's ending waits for the journal's write, so the pipeline's
            # drain would wait its whole bound for the journal's drain if that came after it.
            # What is still unwritten then stays in the spool for the next gateway.
            await asyncio.gather(pipeline.drain(), *([leased.drain()] if leased is not None else []))
            limiter.close()
            await nodes.close()
            await peers.close()
            await tokens.aclose()
            if referee is not None:
                await referee.aclose()
            await jobs_pool.close()
            await pool.close()

    app = App(
        metrics=metrics_holder,
        title="NeuralGrid",
        version=__version__,
        description="OpenAI-compatible inference, routed to the best GPU node by a matcher in Postgres.",
        lifespan=lifespan,
        # `/v1/keys/` is no route, as on OpenAI's API: a 404 in its shape, not a 307 with no body.
        redirect_slashes=False,
        # /docs is web/routes.py's, its files served from here; FastAPI's pages load theirs from a CDN.
        docs_url=None,
        redoc_url=None,
        # FastAPI's own OpenTelemetry hooks look up the global providers on every request (a
        # twentieth of one's CPU here); the gateway's metrics are Prometheus's (gateway/metrics.py).
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.openapi = lambda: openapi.document(app)  # type: ignore[method-assign]
    app.serve_directly(routes_openai.router)
    app.include_router(routes_keys.router)
    app.serve_directly(routes_nodes.router)
    app.include_router(forward.router)
    app.include_router(web_routes.router)
    app.include_router(realtime_socket.router)

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, err: GatewayError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return invalid(err.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return from_http(err.status_code, str(err.detail), err.headers)

    @app.exception_handler(DatabaseError)
    async def database_error(request: Request, err: DatabaseError) -> JSONResponse:
        return from_database(err).response()

    @app.exception_handler(psycopg.OperationalError)
    async def database_unavailable(request: Request, err: psycopg.OperationalError) -> JSONResponse:
        log.warning("%s %s: the database did not answer: %s", request.method, request.url.path, err)
        return DatabaseUnavailable(
            "the platform's database is not answering; try again shortly", retry_after=1
        ).response()

    @app.exception_handler(Exception)  # a bug: still an answer in OpenAI's shape (Starlette logs it)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        return InternalError("the gateway failed on this request; it has been logged").response()

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz(services: ServicesDep) -> JSONResponse:
        try:
            async with asyncio.timeout(2):
                await services.store.get(PING)
        except Exception as err:  # any failure means not ready
            return JSONResponse({"status": "unavailable", "database": str(err)}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["health"])
    async def metrics(services: ServicesDep) -> PlainTextResponse:
        try:  # the fleet as of this scrape; a database that does not answer leaves the last figures
            async with asyncio.timeout(2):
                services.metrics.fleet(await services.store.all(FLEET_GAUGES))
                services.metrics.checks(await services.store.all(CHECK_STATES))
        except Exception:
            log.warning("the fleet gauges could not be read for /metrics", exc_info=True)
        # Rendered off the event loop: requests go on while a large registry is written out.
        text = await asyncio.to_thread(generate_latest, services.metrics.registry)
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    return app


def _missed(keys: KeyStore, room: WaitingRoom, heartbeats: Heartbeats) -> None:
    """Announcements may have been missed: cached keys and node secrets are dropped, waiting requests
    ask again."""
    keys.forget_all()
    room.slot_freed()
    heartbeats.forget_all()


def _leased(
    store: Store, gateway_id: uuid.UUID, spool: Path, room: WaitingRoom, catalog: Catalog
) -> LeasedJobs:
    """Leases and what is served from them, on the general pool: records of jobs written behind
    commit durably (the request path's pool may commit asynchronously), as they leave the spool."""
    journal = Journal(store, gateway_id, Spool(spool, gateway_id))
    return LeasedJobs(store, gateway_id, LeaseBook(), Escrows(), journal, catalog, room.slot_freed)


def _pipeline(
    settings: Settings,
    store: Store,
    nodes: HttpNodes,
    limiter: RateLimiter,
    metrics: Metrics,
    tunnels: Tunnels,
    room: WaitingRoom,
    gateway_id: uuid.UUID,
    deadline: JobDeadline,
    catalog: Catalog,
    leased: LeasedJobs | None = None,
) -> Pipeline:
    """The request pipeline, on the request path's own pool (see Settings.async_commit)."""
    metering = Metering(Completions(store), limiter, metrics, leased)
    claims = Claims(store, gateway_id, abandon=metering.abandon)
    placement = Placement(
        store, claims, metrics, settings.max_attempts, room, settings.queue_timeout_s, leased
    )
    sender = Sender(
        nodes,
        tunnels,
        placement,
        metrics,
        settings.first_byte_timeout_s,
        settings.platform_key(signing.REQUEST_KEYS),
        settings.max_answer_bytes,
    )
    relay = Relay(sender, placement, metering, metrics, settings.resume_streams, deadline)
    caches = PromptCaches(settings.platform_key(SALTS), settings.shared_cache)
    admission = Admission(catalog, limiter, settings.default_max_tokens, caches)
    return Pipeline(admission, placement, sender, relay, metering, metrics)
