"""A Postgres server of a test module's own, to stop and start (a database restart) without touching
the session's: migrated once into a template, a fresh clone per test."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from neuralgrid.db import migrate
from neuralgrid.db.embedded import EmbeddedPostgres
from tests.conftest import TEMPLATE, clone_database, free_port


@dataclass(frozen=True)
class OwnPostgres:
    server: EmbeddedPostgres

    def fresh_database(self) -> str:
        """A migrated database's URL; the server is started first (a test may have left it stopped)."""
        self.server.start()
        return self.server.url(clone_database(self.server, TEMPLATE))


@contextmanager
def own_postgres() -> Iterator[OwnPostgres]:
    root = Path(tempfile.mkdtemp(prefix="ngpg-own-"))
    server = EmbeddedPostgres(root, port=free_port(), fast_unsafe=True)
    server.start()
    try:
        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute(f"create database {TEMPLATE}")
        with psycopg.connect(server.url(TEMPLATE), autocommit=True) as conn:
            migrate.setup_database(conn)
        yield OwnPostgres(server)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
