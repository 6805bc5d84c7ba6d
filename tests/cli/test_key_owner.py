"""`neuralgrid keys create` makes keys a user owns: the local owner by default, `--owner` another;
the web page lists them (GET /v1/keys as that user) and nodes registered with them are that user's."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from typer.testing import CliRunner, Result

from neuralgrid.cli import app
from neuralgrid.server.settings import Settings
from neuralgrid.server.stack import user_token
from tests.conftest import LLAMA8, make_user

LOCAL_OWNER = "owner@localhost"


def create_key(db_url: str, home: Path, *args: str, **env: str) -> Result:
    env = {"DATABASE_URL": db_url, "NEURALGRID_HOME": str(home), "COLUMNS": "200", **env}
    return CliRunner().invoke(app, ["keys", "create", "--name", "cli", *args], env=env)


def owner_of(conn: psycopg.Connection, key: str) -> Any:
    row = conn.execute("select owner_id from api_keys where prefix = %s", (key[:11],)).fetchone()
    assert row is not None
    return row[0]


def signed_in(gateway_settings: dict[str, Any], user: uuid.UUID, email: str) -> dict[str, str]:
    """The headers the web page sends once `user` has signed in."""
    token = user_token(Settings(**gateway_settings).jwt_secret, user, email)
    return {"authorization": f"Bearer {token}"}


def test_keys_belong_to_the_local_owner_where_the_page_and_nodes_see_them(
    conn: psycopg.Connection, db_url: str, gateway: str, gateway_settings: dict[str, Any], tmp_path: Path
) -> None:
    owner = make_user(conn, LOCAL_OWNER)  # as `neuralgrid signin` leaves it
    result = create_key(db_url, tmp_path)
    assert result.exit_code == 0, result.output
    assert f"for {LOCAL_OWNER}" in result.stdout and result.stderr == ""
    key = result.stdout.strip().splitlines()[-1]
    assert owner_of(conn, key) == owner

    as_owner = signed_in(gateway_settings, owner, LOCAL_OWNER)
    listed = httpx.get(f"{gateway}/v1/keys", headers=as_owner, timeout=5).json()["data"]
    assert [k["name"] for k in listed] == ["cli"]
    node = {
        "name": "owned",
        "gpu_model": "NVIDIA L4",
        "vram_gb": 24,
        "tflops": 121,
        "hourly_rate": 0.4,
        "region": "eu-west",
        "endpoint_url": "http://127.0.0.1:9/",
        "models": [LLAMA8],
    }
    registered = httpx.post(f"{gateway}/v1/nodes", json=node, headers={"authorization": f"Bearer {key}"})
    assert registered.status_code == 201, registered.text
    row = conn.execute("select owner_id from nodes where name = 'owned'").fetchone()
    assert row == (owner,)


@pytest.mark.parametrize("by", ["email", "id"])
def test_owner_names_another_user(conn: psycopg.Connection, db_url: str, tmp_path: Path, by: str) -> None:
    someone = make_user(conn, "dev@example.test")
    result = create_key(db_url, tmp_path, "--owner", "DEV@example.test" if by == "email" else str(someone))
    assert result.exit_code == 0, result.output
    assert owner_of(conn, result.stdout.strip().splitlines()[-1]) == someone


def test_an_unknown_owner_is_one_line_and_creates_nothing(
    conn: psycopg.Connection, db_url: str, tmp_path: Path
) -> None:
    result = create_key(db_url, tmp_path, "--owner", "nobody@example.test")
    assert result.exit_code == 1
    [line] = result.stderr.splitlines()
    assert "no user with id or email 'nobody@example.test'" in line
    assert conn.execute("select count(*) from api_keys").fetchone() == (0,)


def test_without_a_local_owner_the_key_is_nobodys_and_the_cli_says_so(
    conn: psycopg.Connection, db_url: str, tmp_path: Path
) -> None:
    """DATABASE_URL may be a Supabase project's database: no user is made up there."""
    result = create_key(db_url, tmp_path)
    assert result.exit_code == 0, result.output
    assert owner_of(conn, result.stdout.strip().splitlines()[-1]) is None
    assert "belongs to no user" in result.stderr and "--owner" in result.stderr
    assert "neuralgrid signin" in result.stderr
    assert conn.execute("select count(*) from auth.users").fetchone() == (0,)

    hosted = create_key(
        db_url,
        tmp_path,
        NEURALGRID_SUPABASE_URL="https://project.supabase.co",
        NEURALGRID_SUPABASE_ANON_KEY="anon",
    )
    assert hosted.exit_code == 0, hosted.output
    assert "Supabase Auth" in hosted.stderr
