"""Fixtures for the hosted path: a Supabase-shaped cluster (tests/supabase/shaped.py), with `db_url`
and `conn` overridden so that the suite's gateway and node fixtures run on it, connected as the
non-superuser `postgres` a project's operator has."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from neuralgrid.db import migrate
from tests.supabase.shaped import ShapedCluster, shaped_cluster

HOSTED = "hosted"  # migrated as postgres with supautils' policy grant, as on a hosted project


@pytest.fixture(scope="session")
def shaped() -> Iterator[ShapedCluster]:
    with shaped_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def hosted_template(shaped: ShapedCluster) -> str:
    _, url = shaped.database(HOSTED, supautils=True)
    with psycopg.connect(url, autocommit=True) as conn:
        migrate.setup_database(conn)
    return HOSTED


@pytest.fixture
def db_url(shaped: ShapedCluster, hosted_template: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(shaped.server.url(), autocommit=True) as conn:
        conn.execute(f"create database {name} template {hosted_template}")
    yield shaped.server.url(name, user="postgres")
    with psycopg.connect(shaped.server.url(), autocommit=True) as conn:
        conn.execute(f"drop database {name} with (force)")


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(db_url, autocommit=True) as connection:
        yield connection
