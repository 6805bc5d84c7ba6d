"""What goes wrong at start, as one line that names the cause and the fix, and a non-zero exit: a
taken gateway port, a taken embedded Postgres port, a database nobody migrated, a relative home."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner, Result

from neuralgrid.cli import app
from neuralgrid.db.embedded import EmbeddedPostgres
from tests.conftest import free_port

CLI = [sys.executable, "-m", "neuralgrid.cli"]
WHERE = ("DATABASE_URL", "NEURALGRID_PORT", "NEURALGRID_HOST", "NEURALGRID_DB_PORT")


def invoke(*args: str, **env: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", **env})


def plain_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in WHERE}, **extra}


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another program listens on."""
    with socket.create_server(("127.0.0.1", 0)) as other:
        yield other.getsockname()[1]


def test_help_describes_the_cli() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    assert "route OpenAI-compatible inference to other people's GPUs" in result.stdout
    assert "assembled here" not in result.stdout  # the module's docstring is for its readers


def test_help_wraps_at_the_terminal_not_at_the_docstrings_line_ends() -> None:
    """Typer kept the docstrings' line breaks: `--help` broke mid-sentence (a new user's trial)."""
    result = invoke("keys", "create", "--help")
    assert result.exit_code == 0
    assert "or you when signed in with `neuralgrid login`): their API keys page lists it" in result.stdout


def test_up_on_a_port_in_use_is_one_line_and_starts_nothing(held_port: int, tmp_path: Path) -> None:
    env = plain_env(NEURALGRID_HOME=str(tmp_path / "home"), NEURALGRID_DB_PORT=str(free_port()))
    started = time.monotonic()
    up = subprocess.run(
        [*CLI, "up", "--port", str(held_port)], env=env, capture_output=True, text=True, timeout=60
    )
    assert up.returncode == 1 and time.monotonic() - started < 30  # it used to hang, SIGTERM or not
    [line] = up.stderr.splitlines()
    assert f"127.0.0.1:{held_port}" in line and "in use" in line and "--port" in line
    assert "another program" in line and "Traceback" not in up.stdout
    assert not (tmp_path / "home" / "postgres").exists()  # the database was never started


def test_watching_a_gateway_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    """It was two: the fleet it could not read, then the feed it could not join (a new user's trial)."""
    env = plain_env(NEURALGRID_HOME=str(tmp_path / "home"), NEURALGRID_PORT=str(free_port()))
    watch = subprocess.run([*CLI, "watch"], env=env, capture_output=True, text=True, timeout=60)
    assert watch.returncode == 1 and watch.stdout == ""
    [line] = watch.stderr.splitlines()
    assert "cannot reach" in line and "neuralgrid up" in line


def test_an_embedded_postgres_port_in_use_is_one_line(held_port: int, tmp_path: Path) -> None:
    result = invoke("nodes", "ls", NEURALGRID_HOME=str(tmp_path), NEURALGRID_DB_PORT=str(held_port))
    assert result.exit_code == 1
    starting, line = result.stderr.splitlines()  # the step it was at, then what went wrong
    assert starting.startswith("starting the embedded Postgres") and line.startswith("error:")
    assert f"127.0.0.1:{held_port}" in line and "in use" in line and "--db-port" in line
    assert result.stdout == ""


def test_a_database_without_migrations_says_to_migrate(pg_server: EmbeddedPostgres, tmp_path: Path) -> None:
    name = f"empty_{os.getpid()}"
    with psycopg.connect(pg_server.url(), autocommit=True) as conn:
        conn.execute(f"create database {name}")
    url = pg_server.url(name)
    try:
        for command in (["keys", "ls"], ["up", "--port", str(free_port())]):
            result = invoke(*command, DATABASE_URL=url, NEURALGRID_HOME=str(tmp_path))
            assert result.exit_code == 1, command
            [line] = result.stderr.splitlines()
            assert "has none of NeuralGrid's" in line and "`neuralgrid db migrate`" in line
            assert url not in line  # never echo a URL: it may carry a password
        assert invoke("db", "migrate", DATABASE_URL=url, NEURALGRID_HOME=str(tmp_path)).exit_code == 0
        listed = invoke("keys", "ls", "--json", DATABASE_URL=url, NEURALGRID_HOME=str(tmp_path))
        assert listed.exit_code == 0 and listed.stdout.strip() == "[]"
        with psycopg.connect(url, autocommit=True) as conn:  # one migration behind
            latest = "select max(version) from supabase_migrations.schema_migrations"
            conn.execute(f"delete from supabase_migrations.schema_migrations where version = ({latest})")
        behind = invoke("keys", "ls", DATABASE_URL=url, NEURALGRID_HOME=str(tmp_path))
        assert behind.exit_code == 1 and "lacks 1 of NeuralGrid's" in behind.stderr
    finally:
        with psycopg.connect(pg_server.url(), autocommit=True) as conn:
            conn.execute(f"drop database {name} with (force)")


def test_a_relative_home_works(tmp_path: Path) -> None:
    """NEURALGRID_HOME=.ng: the embedded Postgres runs in its data directory, where a relative
    socket directory does not exist."""
    port = free_port()
    env = plain_env(NEURALGRID_HOME=".ng", NEURALGRID_DB_PORT=str(port))
    try:
        result = subprocess.run(
            [*CLI, "db", "url"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        assert f"host={tmp_path / '.ng' / 'postgres' / 'run'}" in result.stdout
    finally:
        EmbeddedPostgres(tmp_path / ".ng" / "postgres", port=port).stop()


def test_a_setting_refused_by_a_rule_is_said_in_the_rules_words() -> None:
    result = invoke("keys", "ls", NEURALGRID_SUPABASE_URL="http://127.0.0.1:1")
    assert result.exit_code == 1
    [line] = result.output.splitlines()
    assert line.lower() == "error: set neuralgrid_supabase_url and neuralgrid_supabase_anon_key together"


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"NEURALGRID_PORT": "abc"}, "error: NEURALGRID_PORT: Input should be a valid integer"),
        ({"NEURALGRID_MAX_ATTEMPTS": "-1"}, "error: NEURALGRID_MAX_ATTEMPTS: Input should be greater than"),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_variable(env: dict[str, str], said: str) -> None:
    """Found as a new user: `Input should be a valid integer`, and no word of which setting."""
    result = invoke("keys", "ls", **env)
    assert result.exit_code == 1
    [line] = result.output.splitlines()
    assert line.startswith(said), line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["bogus"], "No such command 'bogus'"),
        (["keys", "create", "--rpm", "abc"], "Invalid value for '--rpm'"),
        (["keys", "create", "--no-such-flag"], "No such option: --no-such-flag"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_help_to_read(args: list[str], said: str) -> None:
    """Typer had drawn a usage error as a box of five or six lines under the usage."""
    done = subprocess.run([*CLI, *args], env=plain_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("error: ") and said in line and "--help" in line
