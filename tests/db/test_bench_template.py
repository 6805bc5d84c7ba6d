"""A bench's scratch databases are copies of a template migrated once per schema (bench/__init__.py):
the same schema as a database set up anew, made once, remade when the migrations change, and never
copied half made."""

from __future__ import annotations

import psycopg
import pytest

import neuralgrid.bench.map  # noqa: F401 - as the CLI leaves the package: `map` in it is this module
from neuralgrid.bench import TEMPLATE_PREFIX, migrated_template, scratch_database
from neuralgrid.db import migrate
from neuralgrid.db.embedded import EmbeddedPostgres

SCHEMA = """
select format('%s.%s(%s)', n.nspname, p.proname, pg_get_function_identity_arguments(p.oid)) from pg_proc p
  join pg_namespace n on n.oid = p.pronamespace where n.nspname in ('public', 'private', 'auth', 'realtime')
union all
select format('%s.%s %s', c.table_schema, c.table_name, c.column_name) from information_schema.columns c
  where c.table_schema in ('public', 'private', 'auth', 'realtime')
union all
select 'migration ' || version from supabase_migrations.schema_migrations
"""


def schema(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {row[0] for row in conn.execute(SCHEMA)}


def templates(admin: str) -> dict[str, int]:
    with psycopg.connect(admin) as conn:
        rows = conn.execute(
            "select datname, oid from pg_database where starts_with(datname, %s)", (TEMPLATE_PREFIX,)
        ).fetchall()
    return {str(name): int(oid) for name, oid in rows}


def test_a_scratch_database_holds_the_schema_a_set_up_one_does(
    pg_server: EmbeddedPostgres, template_db: str
) -> None:
    with scratch_database(pg_server.url(), "bench_scratch_test") as url:
        copied = schema(url)
    assert copied == schema(pg_server.url(template_db)) and len(copied) > 500


def test_the_template_is_made_once_per_schema_and_a_half_made_one_is_never_used(
    pg_server: EmbeddedPostgres, template_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = pg_server.url()
    first = migrated_template(admin)
    made = templates(admin)
    assert migrated_template(admin) == first and templates(admin) == made  # kept, not made again
    # Other migrations: a template of their own, the other schema's dropped.
    monkeypatch.setattr(migrate, "schema_digest", lambda: "f" * 64)
    other = migrated_template(admin)
    assert other != first and set(templates(admin)) == {other}
    # A bench stopped while it built one left it half made, under its building name: made anew.
    monkeypatch.setattr(migrate, "schema_digest", lambda: "e" * 64)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'create database "{TEMPLATE_PREFIX}{"e" * 16}_building"')
    again = migrated_template(admin)
    assert set(templates(admin)) == {again}
    assert schema(pg_server.url(again)) == schema(pg_server.url(template_db))
