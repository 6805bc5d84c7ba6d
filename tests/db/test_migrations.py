"""The migration runner: CLI-compatible history, idempotence, the compat layer, statement splitting."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psycopg
import pytest

from neuralgrid.db import migrate
from neuralgrid.db.embedded import POSTGRES_BIN_PATH, EmbeddedPostgres
from neuralgrid.db.errors import MigrationError

ROOT = Path(__file__).resolve().parents[2]
SUPABASE_CLI = ROOT / "node_modules" / ".bin" / "supabase"
HISTORY = "select version, name, statements from supabase_migrations.schema_migrations order by version"


def fresh_database(server: EmbeddedPostgres, name: str) -> str:
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("drop database if exists {} with (force)").format(psycopg.sql.Identifier(name))
        )
        conn.execute(psycopg.sql.SQL("create database {}").format(psycopg.sql.Identifier(name)))
    return server.url(name)


def test_split_matches_the_cli_rules() -> None:
    sql = """-- lead; comment
create table t (s text default 'a;b', "we;ird" int); /* x; */ create function f() returns int
language plpgsql as $body$ begin return 1; end; $body$;
select $$;$$, 'it''s;';
  ;
"""
    assert migrate.split_statements(sql) == [
        "-- lead; comment\ncreate table t (s text default 'a;b', \"we;ird\" int)",
        "/* x; */ create function f() returns int\nlanguage plpgsql as $body$ begin return 1; end; $body$",
        "select $$;$$, 'it''s;'",
    ]


def test_runner_applies_everything_once(pg_server: EmbeddedPostgres) -> None:
    url = fresh_database(pg_server, "mig_runner")
    with psycopg.connect(url, autocommit=True) as conn:
        assert migrate.apply_compat_layer(conn) is True
        assert migrate.apply_compat_layer(conn) is False
        applied = migrate.migrate(conn)
        assert [m.name for m in applied] == [
            m.name for m in migrate.discover(migrate.default_migrations_dir())
        ]
        assert migrate.migrate(conn) == []
        rows = conn.execute(HISTORY).fetchall()
        assert [r[0] for r in rows] == [m.version for m in applied]
        # Every table and function of ours carries a comment.
        undocumented = conn.execute(
            """
            select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
            where n.nspname = 'public' and c.relkind in ('r', 'v') and obj_description(c.oid) is null
            union all
            select p.proname from pg_proc p join pg_namespace n on n.oid = p.pronamespace
            where n.nspname = 'public' and obj_description(p.oid) is null
            """
        ).fetchall()
        assert undocumented == []
        # Every table has row level security on.
        assert (
            conn.execute(
                "select relname from pg_class where relnamespace = 'public'::regnamespace"
                " and relkind = 'r' and not relrowsecurity"
            ).fetchall()
            == []
        )


def test_runner_and_supabase_cli_agree(pg_server: EmbeddedPostgres) -> None:
    assert SUPABASE_CLI.exists(), "run the README's setup: the Supabase CLI comes from package.json"
    ours = fresh_database(pg_server, "mig_ours")
    theirs = fresh_database(pg_server, "mig_cli")
    with psycopg.connect(ours, autocommit=True) as conn:
        migrate.apply_compat_layer(conn)
        migrate.migrate(conn)
    with psycopg.connect(theirs, autocommit=True) as conn:
        migrate.apply_compat_layer(conn)
    cli = [str(SUPABASE_CLI), "migration", "up", f"--remote={theirs}", "--yes"]
    result = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(ours) as a, psycopg.connect(theirs) as b:
        assert a.execute(HISTORY).fetchall() == b.execute(HISTORY).fetchall()
    # Each tool sees what the other applied: ours finds nothing to do on the CLI's database...
    with psycopg.connect(theirs, autocommit=True) as conn:
        assert migrate.migrate(conn) == []
    # ...and the CLI finds nothing to do on ours.
    again = subprocess.run(
        [*cli[:3], f"--remote={ours}", "--yes"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and "Applying migration" not in again.stdout + again.stderr


def test_a_failing_migration_rolls_back_and_names_the_file(
    pg_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    url = fresh_database(pg_server, "mig_bad")
    (tmp_path / "20990101000000_good.sql").write_text("create table good (id int);")
    (tmp_path / "20990101000001_bad.sql").write_text(
        "create table half (id int);\nselect nonsense from nowhere;"
    )
    with psycopg.connect(url, autocommit=True) as conn:
        with pytest.raises(MigrationError, match=r"20990101000001_bad\.sql"):
            migrate.migrate(conn, tmp_path)
        assert conn.execute("select to_regclass('good'), to_regclass('half')").fetchone() == (
            "good",
            None,
        )
        assert [r[0] for r in conn.execute(HISTORY).fetchall()] == ["20990101000000"]


def test_badly_named_migrations_are_refused(tmp_path: Path) -> None:
    (tmp_path / "init.sql").write_text("select 1;")
    with pytest.raises(MigrationError, match=r"YYYYMMDDHHMMSS_name\.sql"):
        migrate.discover(tmp_path)


def test_compat_layer_is_skipped_where_supabase_is_present(pg_server: EmbeddedPostgres) -> None:
    url = fresh_database(pg_server, "mig_compat")
    with psycopg.connect(url, autocommit=True) as conn:
        migrate.apply_compat_layer(conn)
        assert migrate.has_supabase_layer(conn)
        # auth.uid() reads request.jwt.claims exactly like Supabase's.
        conn.execute(
            """select set_config('request.jwt.claims', '{"sub": "5f1e0a0e-0000-4000-8000-000000000001", "role": "authenticated"}', false)"""
        )
        row = conn.execute("select auth.uid()::text, auth.role(), auth.jwt() ->> 'role'").fetchone()
        assert row == ("5f1e0a0e-0000-4000-8000-000000000001", "authenticated", "authenticated")
        conn.execute("select realtime.send('{\"a\": 1}', 'ev', 'topic-x', false)")
        assert conn.execute("select topic, event, extension, private from realtime.messages").fetchone() == (
            "topic-x",
            "ev",
            "broadcast",
            False,
        )


def test_db_url_is_accepted_by_psql(pg_server: EmbeddedPostgres) -> None:
    psql = str(POSTGRES_BIN_PATH / "psql")
    result = subprocess.run([psql, pg_server.url(), "-Atc", "select 1"], capture_output=True, text=True)
    assert result.stdout.strip() == "1"


def test_supabase_config_is_valid_for_the_cli() -> None:
    """`supabase status` parses config.toml first; with no Docker here it can only fail after that."""
    result = subprocess.run(
        [str(SUPABASE_CLI), "status"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    output = result.stdout + result.stderr
    assert "config.toml" not in output and "Invalid" not in output and "WARN" not in output, output
