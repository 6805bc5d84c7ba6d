"""Where the database is: the embedded server under NEURALGRID_HOME, or DATABASE_URL."""

from __future__ import annotations

import dataclasses

import psycopg

from neuralgrid.db import migrate
from neuralgrid.db.embedded import EmbeddedPostgres
from neuralgrid.db.migrate import Progress, Quiet
from neuralgrid.server.settings import Settings


def embedded_server(settings: Settings) -> EmbeddedPostgres:
    """The embedded server under home; when it already runs, on the port it really listens on (one
    cluster runs once, whatever port a later command names); when it does not, on the port it last
    ran on unless NEURALGRID_DB_PORT names one (a home set up on another port is found again)."""
    server = EmbeddedPostgres(settings.home / "postgres", port=settings.db_port)
    port = server.running_port()
    if port is None and "db_port" not in settings.model_fields_set:
        port = server.last_port()
    return server if port in (None, server.port) else dataclasses.replace(server, port=port)


def database_url(settings: Settings, *, start: bool = True, progress: Progress | None = None) -> str:
    """The URL to connect to; with no DATABASE_URL, the embedded server (started if asked)."""
    if settings.database_url:
        return settings.database_url
    server = embedded_server(settings)
    if start and not server.is_running():
        first = "" if server.initialized else f"; first run: creating its cluster in {server.root}"
        (progress or Quiet()).step(f"starting the embedded Postgres on port {server.port}{first}")
        server.start()
    return server.url()


def prepare(settings: Settings, progress: Progress | None = None) -> str:
    """Make the database ready: start the embedded one with its compat layer and migrations.

    With DATABASE_URL nothing is applied (`neuralgrid db migrate` does that when asked), but a
    database that lacks migrations is refused here, with what to run, before anything queries it.
    """
    url = database_url(settings, progress=progress)
    with psycopg.connect(url, autocommit=True) as conn:
        if settings.embedded:
            migrate.setup_database(conn, progress)
        else:
            migrate.check_applied(conn)
    return url
