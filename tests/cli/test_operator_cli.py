"""What an operator sees at an 80-column terminal: the version, help, `nodes ls`, `keys ls`, bad
settings."""

from __future__ import annotations

import importlib.metadata
import re

import psycopg
import typer
from typer.core import TyperGroup
from typer.testing import CliRunner, Result

from neuralgrid.cli import app
from neuralgrid.dev.demo import DEMO_FLEET

CUT = "…"  # what rich prints where it cuts a cell


def invoke(*args: str, columns: int = 80, **env: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns), **env})


def test_version_prints_the_package_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"neuralgrid {importlib.metadata.version('neuralgrid')}"


def test_node_run_help_shows_every_env_var_whole_at_80_columns() -> None:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    node_group = group.commands["node"]
    assert isinstance(node_group, TyperGroup)
    names = [p.envvar for p in node_group.commands["run"].params if isinstance(p.envvar, str)]
    assert len(names) > 10

    result = invoke("node", "run", "--help")
    assert result.exit_code == 0
    for name in names:
        assert re.search(rf"\b{name}\b", result.stdout), name


def test_nodes_ls_fits_80_columns_and_wide_shows_every_column(db_url: str) -> None:
    assert invoke("nodes", "import", str(DEMO_FLEET), DATABASE_URL=db_url).exit_code == 0

    narrow = invoke("nodes", "ls", DATABASE_URL=db_url)
    assert narrow.exit_code == 0
    assert CUT not in narrow.stdout
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80
    for cell in ("tokyo-rtx4090", "ap-northeast", "online", "0/12"):
        assert cell in narrow.stdout
    assert "warm models" not in narrow.stdout

    wide = invoke("nodes", "ls", "--wide", DATABASE_URL=db_url, columns=200)
    assert wide.exit_code == 0
    assert CUT not in wide.stdout
    for cell in ("vram", "tflops", "$/h", "ok/fail", "warm models", "BAAI/bge-large-en-v1.5"):
        assert cell in wide.stdout


def test_keys_ls_fits_80_columns_and_wide_shows_every_column(conn: psycopg.Connection, db_url: str) -> None:
    create = "select api_key from create_api_key(%s, %s, %s, %s)"
    conn.execute(create, ("a laptop of mine", 600, 100_000, 5))
    conn.execute(create, ("ci", None, None, None))
    conn.execute(
        "update api_keys set last_used_at = now(), spent_usd = 0.012345 where name = 'a laptop of mine'"
    )
    conn.execute("update api_keys set revoked_at = now() where name = 'ci'")
    prefixes = [row[0] for row in conn.execute("select prefix from api_keys order by created_at")]

    narrow = invoke("keys", "ls", DATABASE_URL=db_url)
    assert narrow.exit_code == 0, narrow.output
    assert CUT not in narrow.stdout
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80
    laptop = next(line for line in narrow.stdout.splitlines() if prefixes[0] in line)
    for cell in ("600/100000", "0.012345/5.00", "active"):
        assert cell in laptop
    ci = next(line for line in narrow.stdout.splitlines() if prefixes[1] in line)
    assert "-/-" in ci and "never" in ci and "revoked" in ci

    wide = invoke("keys", "ls", "--wide", DATABASE_URL=db_url, columns=200)
    assert wide.exit_code == 0 and CUT not in wide.stdout
    ids = [str(row[0]) for row in conn.execute("select id from api_keys")]
    assert all(key_id in wide.stdout for key_id in ids)


def test_a_malformed_database_url_is_one_line_naming_it() -> None:
    result = invoke("nodes", "ls", DATABASE_URL="not-a-url")
    assert result.exit_code == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert "DATABASE_URL" in line and "postgresql://" in line
    assert "not-a-url" not in line  # a URL is never echoed: it may carry a password


def test_match_fits_80_columns_and_wide_shows_every_component(db_url: str) -> None:
    assert invoke("nodes", "import", str(DEMO_FLEET), DATABASE_URL=db_url).exit_code == 0
    model = "meta-llama/Llama-3.1-8B-Instruct"

    narrow = invoke("match", "--model", model, "--explain", DATABASE_URL=db_url)
    assert narrow.exit_code == 0, narrow.output
    assert CUT not in narrow.stdout
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80
    for cell in ("score", "fit", "warm", "price", "rejected because", "tokyo-rtx4090"):
        assert cell in narrow.stdout
    assert "proximity" not in narrow.stdout
    big = invoke(
        "match", "--model", "meta-llama/Llama-3.3-70B-Instruct-AWQ", "--explain", DATABASE_URL=db_url
    )
    assert max(len(line) for line in big.stdout.splitlines()) <= 80 and CUT not in big.stdout
    assert "VRAM" in big.stdout  # the small cards' reason, wrapped within the table
    ranked = invoke("match", "--model", model, DATABASE_URL=db_url)
    assert max(len(line) for line in ranked.stdout.splitlines()) <= 80 and CUT not in ranked.stdout
    assert "reserve" in ranked.stdout and "rejected because" not in ranked.stdout

    wide = invoke("match", "--model", model, "--wide", DATABASE_URL=db_url, columns=200)
    assert wide.exit_code == 0 and CUT not in wide.stdout
    for cell in ("capacity", "reputation", "proximity"):
        assert cell in wide.stdout

    no_rerank = invoke("match", "--model", model, "--route", "rerank", DATABASE_URL=db_url)
    assert no_rerank.exit_code == 0 and "tokyo-rtx4090" not in no_rerank.stdout
    bad = invoke("match", "--model", model, "--route", "teleport", DATABASE_URL=db_url)
    assert bad.exit_code == 1 and "--route" in bad.stderr and len(bad.stderr.splitlines()) == 1
