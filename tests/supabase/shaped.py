"""A Postgres cluster shaped like a Supabase project's database (tests/supabase/shape.sql), for the
tests that prove the hosted path: NeuralGrid's migrations applied as the non-superuser `postgres`,
and the gateway running on it as it would against a project.

Hosted Supabase runs `supautils`, which lets `postgres` create policies on tables Supabase's services
own (realtime.messages among them). That extension is not available here; with `supautils=True` its
effect on our migrations is reproduced by making `postgres` a member of `supabase_realtime_admin`
(which grants the same right, and more). Without it, the database is what a self-hosted Postgres with
Supabase's roles and no supautils gives.
"""

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
from tests.conftest import free_port

SHAPE = Path(__file__).with_name("shape.sql")
ADMIN = "supabase_admin"


@dataclass(frozen=True)
class ShapedCluster:
    server: EmbeddedPostgres

    def database(self, name: str, *, supautils: bool) -> tuple[str, str]:
        """A fresh database of Supabase's shape: (admin URL, postgres URL). Nothing is migrated. The
        supautils setting holds for the whole cluster until the next call."""
        with psycopg.connect(self.server.url(), autocommit=True) as conn:
            conn.execute(f"create database {name} template shaped")
            conn.execute(f"grant all on database {name} to postgres")
            # Role membership is cluster-wide: each database sets it for the tests that use it next.
            change = (
                "grant supabase_realtime_admin to" if supautils else "revoke supabase_realtime_admin from"
            )
            conn.execute(f"{change} postgres")
        return self.server.url(name), self.server.url(name, user="postgres")


@contextmanager
def shaped_cluster() -> Iterator[ShapedCluster]:
    """A cluster bootstrapped as supabase_admin, with a template database `shaped` built from
    shape.sql around NeuralGrid's compatibility layer."""
    root = Path(tempfile.mkdtemp(prefix="ngpg-supabase-"))
    server = EmbeddedPostgres(root, port=free_port(), fast_unsafe=True, superuser=ADMIN)
    server.start()
    try:
        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute("create database shaped")
        before, after = SHAPE.read_text().split("-- @@after-compat")
        with psycopg.connect(server.url("shaped"), autocommit=True) as conn:
            # Roles are cluster-wide: the first part creates them (and may run only once).
            for statement in migrate.split_statements(before):
                conn.execute(statement.encode())
            migrate.apply_compat_layer(conn)
            for statement in migrate.split_statements(after):
                conn.execute(statement.encode())
        yield ShapedCluster(server)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
