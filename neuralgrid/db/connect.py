"""Where the database is: the embedded server under NEURALGRID_HOME, or DATABASE_URL."""

from __future__ import annotations

import psycopg

from neuralgrid.db import migrate
from neuralgrid.db.embedded import EmbeddedPostgres
from neuralgrid.server.settings import Settings


def embedded_server(settings: Settings) -> EmbeddedPostgres:
    return EmbeddedPostgres(settings.home / "postgres", port=settings.db_port)


def database_url(settings: Settings, *, start: bool = True) -> str:
    """The URL to connect to; with no DATABASE_URL, the embedded server (started if asked)."""
    if settings.database_url:
        return settings.database_url
    server = embedded_server(settings)
    if start:
        server.start()
    return server.url()


def prepare(settings: Settings) -> str:
    """Make the database ready: start the embedded one with its compat layer and migrations.

    With DATABASE_URL nothing is applied; `neuralgrid db migrate` does that when asked.
    """
    url = database_url(settings)
    if settings.embedded:
        with psycopg.connect(url, autocommit=True) as conn:
            migrate.setup_database(conn)
    return url
