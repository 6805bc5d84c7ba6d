"""supabase/schemas/ says what the migrations build: one database from each, compared whole."""

from __future__ import annotations

import difflib
from collections.abc import Iterator

import psycopg
import pytest

from neuralgrid.db import migrate, schema_files
from neuralgrid.db.embedded import EmbeddedPostgres


def build(server: EmbeddedPostgres, name: str, from_schema_files: bool) -> str:
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {name} with (force)")
        conn.execute(f"create database {name}")
    with psycopg.connect(server.url(name), autocommit=True) as conn:
        migrate.apply_compat_layer(conn)
        if from_schema_files:
            schema_files.apply(conn, schema_files.schema_files())
        else:
            migrate.migrate(conn)
    return server.url(name)


@pytest.fixture(scope="module")
def databases(pg_server: EmbeddedPostgres) -> Iterator[tuple[str, str]]:
    names = ("schema_by_migrations", "schema_by_files")
    yield build(pg_server, names[0], False), build(pg_server, names[1], True)
    with psycopg.connect(pg_server.url(), autocommit=True) as conn:
        for name in names:
            conn.execute(f"drop database {name} with (force)")


def same(what: str, migrations: str, files: str) -> None:
    """Equal, or a failure that shows the unified diff (the first 200 lines of it)."""
    if migrations == files:
        return
    diff = difflib.unified_diff(
        migrations.splitlines(),
        files.splitlines(),
        "from the migrations",
        "from supabase/schemas",
        lineterm="",
    )
    shown = "\n".join(list(diff)[:200])
    pytest.fail(
        f"{what} differs between the migrations and supabase/schemas/ (edit the schema file with the "
        f"migration, or rewrite them all: python -m neuralgrid.db.schema_files write):\n{shown}",
        pytrace=False,
    )


def test_the_schema_files_build_what_the_migrations_build(databases: tuple[str, str]) -> None:
    by_migrations, by_files = databases
    same("pg_dump --schema-only", schema_files.dump_schema(by_migrations), schema_files.dump_schema(by_files))


def test_and_what_pg_dump_of_public_and_private_leaves_out(databases: tuple[str, str]) -> None:
    """Our roles, the policies on realtime.messages, the publication's tables, the event trigger."""
    outside = []
    for url in databases:
        with psycopg.connect(url) as conn:
            outside.append(
                "\n\n".join(f"-- {k}\n{v}" for k, v in schema_files.outside_the_dump(conn).items())
            )
    same("what lies outside public and private", *outside)
    assert "create policy" in outside[0] and "alter publication" in outside[0]


def test_and_the_catalog_rows(databases: tuple[str, str]) -> None:
    rows = []
    for url in databases:
        with psycopg.connect(url) as conn:
            rows.append(schema_files.catalog_rows(conn))
    same("the catalog's rows", *rows)
    assert "INSERT INTO public.matching_policies" in rows[0]


def test_a_difference_fails_with_the_diff(pg_server: EmbeddedPostgres, databases: tuple[str, str]) -> None:
    """A migration that the schema files do not follow is caught, and the diff names the change."""
    by_migrations, _ = databases
    changed = build(pg_server, "schema_changed", False)
    try:
        with psycopg.connect(changed, autocommit=True) as conn:
            conn.execute("comment on function private.vram_tier(double precision) is 'changed'")
        with pytest.raises(pytest.fail.Exception, match=r"(?s)from supabase/schemas.*\+COMMENT ON FUNCTION"):
            same(
                "pg_dump --schema-only",
                schema_files.dump_schema(by_migrations),
                schema_files.dump_schema(changed),
            )
    finally:
        with psycopg.connect(pg_server.url(), autocommit=True) as conn:
            conn.execute("drop database schema_changed with (force)")


def test_every_file_has_a_domain_and_a_title() -> None:
    names = [path.stem for path in schema_files.schema_files()]
    assert names == list(schema_files.DOMAINS)
    for path in schema_files.schema_files():
        assert path.read_text().startswith(f"-- {schema_files.DOMAINS[path.stem][0]}\n")
