"""`neuralgrid users add EMAIL` makes a second user on a stack that signs its users in with links (the
embedded one): the user, and a one-time link that signs in that user, whose keys `keys create --owner`
then makes. On a hosted Supabase project users sign up through Supabase Auth: one line, exit 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest
from typer.testing import CliRunner, Result

from neuralgrid.cli import app

MALLORY = "mallory@example.com"


@pytest.fixture
def home(tmp_path: Path, gateway_settings: dict[str, Any]) -> Path:
    """The CLI's home, the gateway's too: the gateway checks the tokens the CLI issues there."""
    gateway_settings["NEURALGRID_HOME"] = str(tmp_path)
    return tmp_path


def neuralgrid(home: Path, db_url: str, gateway: str, *args: str, **env: str) -> Result:
    where = urlsplit(gateway)
    env = {
        "NEURALGRID_HOME": str(home),
        "DATABASE_URL": db_url,
        "NEURALGRID_HOST": str(where.hostname),
        "NEURALGRID_PORT": str(where.port),
        "COLUMNS": "80",
        **env,
    }
    return CliRunner().invoke(app, list(args), env=env)


def sign_in(gateway: str, link: str) -> httpx.Response:
    token = link.split("#token=")[1]
    return httpx.post(f"{gateway}/api/auth/signin", json={"token": token}, timeout=5)


def test_users_add_makes_a_user_whom_its_link_signs_in(
    home: Path, conn: psycopg.Connection, db_url: str, gateway: str
) -> None:
    added = neuralgrid(home, db_url, gateway, "users", "add", "Mallory@Example.com")
    assert added.exit_code == 0, added.output
    row = conn.execute("select id from auth.users where email = %s", (MALLORY,)).fetchone()
    assert row is not None  # kept lower-case, as Supabase Auth keeps emails
    link = added.stdout.strip().splitlines()[-1]
    assert link.startswith(f"{gateway}/signin#token=") and MALLORY in added.stdout

    session = sign_in(gateway, link)
    assert session.status_code == 200, session.text
    assert session.json()["user"] == {"id": str(row[0]), "email": MALLORY}
    assert sign_in(gateway, link).status_code == 401  # once

    # The README's `--owner EMAIL`: the key is hers, and her session lists it.
    created = neuralgrid(home, db_url, gateway, "keys", "create", "--name", "hers", "--owner", MALLORY)
    assert created.exit_code == 0, created.output
    mine = {"authorization": f"Bearer {session.json()['access_token']}"}
    listed = httpx.get(f"{gateway}/v1/keys", headers=mine, timeout=5).json()["data"]
    assert [k["name"] for k in listed] == ["hers"]

    # Again: the same user, a fresh link (how an operator re-sends one).
    again = neuralgrid(home, db_url, gateway, "users", "add", MALLORY)
    assert again.exit_code == 0, again.output
    assert "already" in again.stdout
    assert conn.execute("select count(*) from auth.users").fetchone() == (1,)
    assert sign_in(gateway, again.stdout.strip().splitlines()[-1]).json()["user"]["email"] == MALLORY

    # The local owner's link still signs in the local owner.
    owner = neuralgrid(home, db_url, gateway, "signin")
    assert sign_in(gateway, owner.stdout.strip()).json()["user"]["email"] == "owner@localhost"

    listing = neuralgrid(home, db_url, gateway, "users", "ls")
    assert listing.exit_code == 0, listing.output
    hers = next(line for line in listing.stdout.splitlines() if line.startswith(MALLORY))
    assert hers.split()[1:3] == ["1", "0"]  # keys, nodes
    assert "owner@localhost" in listing.stdout
    assert max(len(line) for line in listing.stdout.splitlines()) <= 80


def test_a_bad_email_is_one_line(home: Path, conn: psycopg.Connection, db_url: str, gateway: str) -> None:
    for bad in ("mallory", "mallory@", "@example.com", "mal lory@example.com"):
        result = neuralgrid(home, db_url, gateway, "users", "add", bad)
        assert result.exit_code == 1 and result.stdout == ""
        [line] = result.stderr.splitlines()
        assert "email" in line and repr(bad) in line
    assert conn.execute("select count(*) from auth.users").fetchone() == (0,)


def test_on_a_hosted_project_users_sign_up_through_supabase_auth(tmp_path: Path) -> None:
    env = {
        "NEURALGRID_HOME": str(tmp_path),
        "DATABASE_URL": "postgresql://nobody@127.0.0.1:9/none",  # never reached
        "NEURALGRID_SUPABASE_URL": "https://project.supabase.co",
        "NEURALGRID_SUPABASE_ANON_KEY": "anon",
    }
    for args in (["users", "add", MALLORY], ["users", "ls"]):
        result = CliRunner().invoke(app, args, env=env)
        assert result.exit_code == 1 and result.stdout == ""
        [line] = result.stderr.splitlines()
        assert "Supabase Auth" in line
