"""The CLI against a hosted Supabase project as a signed-in user (neuralgrid/hosted.py): `login`,
`logout`, `keys`, `nodes ls`, `node earnings`, `node verify` through Supabase Auth and the Data API.

The project is replayed with respx from tests/data/supabase_recorded.json (what its Auth and PostgREST
answer); no database is reachable (DATABASE_URL points nowhere), which proves the hosted path needs
no database password."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from typer.testing import CliRunner, Result

from neuralgrid.cli import app
from neuralgrid.hosted import first_day
from tests.conftest import LLAMA8, free_port
from tests.unit.test_packaging import BLOCKED_RUN, SERVER_ONLY

RECORDED: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "supabase_recorded.json").read_text()
)
PROJECT: str = RECORDED["project"]
KEY: str = RECORDED["publishable_key"]
EMAIL: str = RECORDED["user"]["email"]
NOWHERE = "postgresql://nobody@127.0.0.1:9/nothing"  # the database path would fail loudly
STORAGE_KEY = "supabase.auth.token"  # where supabase-py keeps its session
SUPABASE_PY_BRINGS = ("realtime", "jwt")  # its dependencies, so in the base install too


def exchange(name: str) -> dict[str, Any]:
    found: dict[str, Any] = RECORDED["exchanges"][name]
    return found


def answer(name: str) -> httpx.Response:
    """The recorded answer; a token's expires_at stamped now, as Auth stamps it when it answers."""
    response = exchange(name)["response"]
    body = response["body"]
    if isinstance(body, dict) and "expires_in" in body:
        body = {**body, "expires_at": int(time.time()) + body["expires_in"]}
    content = b"" if body is None else json.dumps(body).encode()
    return httpx.Response(response["status"], headers=response["headers"], content=content)


class Project:
    """The hosted project, replayed: `serve` answers each named exchange's request with its answer."""

    def __init__(self, mock: respx.MockRouter) -> None:
        self.mock = mock

    def serve(self, *names: str) -> dict[str, respx.Route]:
        routes = {}
        for name in names:
            request = exchange(name)["request"]
            route = self.mock.route(
                method=request["method"], path=request["path"], params=request.get("query")
            )
            routes[name] = route.mock(side_effect=lambda _request, name=name: answer(name))
        return routes

    def down(self) -> None:
        """Nothing answers at the project's address."""
        self.mock.route().mock(side_effect=httpx.ConnectError("[Errno 111] Connection refused"))


@pytest.fixture
def project() -> Iterator[Project]:
    with respx.mock(base_url=PROJECT, assert_all_called=False) as mock:
        yield Project(mock)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def neuralgrid(home: Path, *args: str, input: str | None = None) -> Result:
    env = {"NEURALGRID_HOME": str(home), "DATABASE_URL": NOWHERE, "COLUMNS": "200"}
    return CliRunner().invoke(app, list(args), env=env, input=input)


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ")
    return line


def login_with_password(home: Path, password: str) -> Any:
    return neuralgrid(
        home, "login", "--project", PROJECT, "--key", KEY, "--email", EMAIL, "--password-stdin",
        input=f"{password}\n",
    )  # fmt: skip


def login(home: Path, project: Project) -> None:
    project.serve("auth.token.password")
    result = login_with_password(home, "s3cret")
    assert result.exit_code == 0, result.output


def stored(home: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((home / "session.json").read_text())
    return document


def stored_session(home: Path) -> dict[str, Any]:
    session: dict[str, Any] = json.loads(stored(home)["auth"][STORAGE_KEY])
    return session


def private(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) == 0o600


# Signing in and out ---------------------------------------------------------------------------------


def test_login_with_a_password_keeps_a_session_only_its_owner_can_read(home: Path, project: Project) -> None:
    routes = project.serve("auth.token.password")
    result = neuralgrid(
        home, "login", "--project", f"{PROJECT}/", "--key", KEY, "--email", EMAIL, "--password-stdin",
        input="s3cret\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"signed in to {PROJECT} as {EMAIL}"
    sent = routes["auth.token.password"].calls.last.request
    assert json.loads(sent.content)["email"] == EMAIL and json.loads(sent.content)["password"] == "s3cret"
    assert sent.headers["apikey"] == KEY and sent.headers["x-supabase-api-version"] == "2024-01-01"
    assert private(home / "session.json")
    document, recorded = stored(home), exchange("auth.token.password")["response"]["body"]
    assert (document["project"], document["api_key"]) == (PROJECT, KEY)
    assert stored_session(home)["refresh_token"] == recorded["refresh_token"]


def test_a_wrong_password_is_one_line_and_keeps_nothing(home: Path, project: Project) -> None:
    project.serve("auth.token.password.invalid")
    result = login_with_password(home, "nope")
    assert one_line_error(result) == "error: the project's Auth refused: wrong email or password"
    assert not (home / "session.json").exists()


def test_login_with_an_emailed_code(home: Path, project: Project) -> None:
    routes = project.serve("auth.otp", "auth.verify")
    result = neuralgrid(
        home, "login", "--project", PROJECT, "--key", KEY, "--email", EMAIL, "--otp", input="402913\n"
    )
    assert result.exit_code == 0, result.output
    assert f"signed in to {PROJECT} as {EMAIL}" in result.stdout
    asked = json.loads(routes["auth.otp"].calls.last.request.content)
    assert (asked["email"], asked["create_user"]) == (EMAIL, False)  # a login never signs anyone up
    verified = json.loads(routes["auth.verify"].calls.last.request.content)
    assert (verified["email"], verified["token"], verified["type"]) == (EMAIL, "402913", "email")
    assert stored_session(home)["access_token"] == exchange("auth.verify")["response"]["body"]["access_token"]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("auth.otp", "auth.verify.invalid"), "the code has expired or is wrong"),
        (("auth.otp.no_user",), "the project refused to send a code"),
    ],
)
def test_a_refused_code_is_one_line(
    home: Path, project: Project, names: tuple[str, ...], message: str
) -> None:
    project.serve(*names)
    result = neuralgrid(
        home, "login", "--project", PROJECT, "--key", KEY, "--email", EMAIL, "--otp", input="1\n"
    )
    assert result.exit_code == 1
    assert message in result.stderr.splitlines()[-1] and result.stderr.splitlines()[-1].startswith("error: ")
    assert not (home / "session.json").exists()


def test_an_unreachable_project_is_one_line(home: Path, project: Project) -> None:
    project.down()
    result = neuralgrid(
        home, "login", "--project", PROJECT, "--key", KEY, "--email", EMAIL, "--password-stdin", input="s\n"
    )
    assert one_line_error(result).startswith(f"error: cannot reach the project's Auth at {PROJECT}")


def test_logout_ends_the_session_there_and_forgets_it_here(home: Path, project: Project) -> None:
    login(home, project)
    access_token = stored_session(home)["access_token"]
    routes = project.serve("auth.logout")
    result = neuralgrid(home, "logout")
    assert result.exit_code == 0 and result.stdout.strip() == f"signed out of {PROJECT}"
    assert routes["auth.logout"].calls.last.request.headers["authorization"] == f"Bearer {access_token}"
    assert not (home / "session.json").exists()
    again = neuralgrid(home, "logout")
    assert again.exit_code == 0 and "no one is signed in" in again.stdout


def test_logout_forgets_the_session_even_when_the_project_is_unreachable(
    home: Path, project: Project
) -> None:
    login(home, project)
    project.down()
    result = neuralgrid(home, "logout")
    assert result.exit_code == 0 and f"signed out of {PROJECT}" in result.stdout
    assert "the project was not told" in result.stderr
    assert not (home / "session.json").exists()


# Keys, nodes, usage and earnings through the Data API ---------------------------------------------------


def test_keys_ls_reads_my_api_keys_as_the_user(home: Path, project: Project) -> None:
    login(home, project)
    routes = project.serve("rest.my_api_keys")
    result = neuralgrid(home, "keys", "ls")
    assert result.exit_code == 0, result.output
    sent = routes["rest.my_api_keys"].calls.last.request
    assert sent.headers["authorization"] == f"Bearer {stored_session(home)['access_token']}"
    assert sent.headers["apikey"] == KEY
    assert dict(sent.url.params) == {"select": "*", "order": "created_at.asc"}
    lines = result.stdout.splitlines()
    laptop = next(line for line in lines if "laptop" in line)
    assert "ng-3f9a1c2b" in laptop and "600" in laptop and "5.00" in laptop and "0.012345" in laptop
    assert "2026-11-23 09:12" in laptop and "active" in laptop  # a datetime, as the database path prints it
    ci = next(line for line in lines if " ci " in line)
    assert "revoked" in ci
    wide = neuralgrid(home, "keys", "ls", "--wide").stdout
    assert "2026-11-23 09:12:40" in wide and "2026-11-21 17:20:03" in wide  # last used; revoked
    as_json = json.loads(neuralgrid(home, "keys", "ls", "--json").stdout)
    assert [k["name"] for k in as_json] == ["laptop", "ci"] and as_json[1]["active"] is False


def test_keys_create_calls_create_api_key_and_shows_the_key_once(home: Path, project: Project) -> None:
    login(home, project)
    routes = project.serve("rest.rpc.create_api_key")
    result = neuralgrid(home, "keys", "create", "--name", "laptop", "--rpm", "600", "--budget-usd", "5")
    assert result.exit_code == 0, result.output
    created = exchange("rest.rpc.create_api_key")["response"]["body"][0]
    assert result.stdout.splitlines()[-1] == created["api_key"]
    assert f"created key {created['prefix']}… ({created['id']}) for {EMAIL}" in result.stdout
    sent = json.loads(routes["rest.rpc.create_api_key"].calls.last.request.content)
    assert sent == {"p_name": "laptop", "p_rpm_limit": 600, "p_tpm_limit": None, "p_budget_usd": 5.0}
    assert "are yours" in one_line_error(
        neuralgrid(home, "keys", "create", "--name", "x", "--owner", "bob@x")
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "rest.rpc.create_api_key.bad_name",
            'violates check constraint "key name must be 1 to 100 characters"',
        ),
        ("rest.rpc.create_api_key.denied", "this is not yours to read or change"),
    ],
)
def test_a_refused_key_is_one_line(home: Path, project: Project, name: str, message: str) -> None:
    login(home, project)
    project.serve(name)
    assert message in one_line_error(neuralgrid(home, "keys", "create", "--name", ""))


def test_keys_revoke_finds_the_key_by_prefix_and_revokes_it_by_id(home: Path, project: Project) -> None:
    login(home, project)
    routes = project.serve("rest.my_api_keys", "rest.rpc.revoke_api_key")
    laptop = exchange("rest.my_api_keys")["response"]["body"][0]
    result = neuralgrid(home, "keys", "revoke", "ng-3f9a1c2b")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"revoked ng-3f9a1c2b… ({laptop['id']})"
    assert json.loads(routes["rest.rpc.revoke_api_key"].calls.last.request.content) == {
        "p_key_id": laptop["id"]
    }
    # The revoked key and a prefix of nothing are refused before anything is sent.
    calls = routes["rest.rpc.revoke_api_key"].call_count
    assert "no active key of yours" in one_line_error(neuralgrid(home, "keys", "revoke", "ng-b71d04e9"))
    assert "no active key of yours" in one_line_error(neuralgrid(home, "keys", "revoke", "ng-00000000"))
    assert routes["rest.rpc.revoke_api_key"].call_count == calls


def test_a_key_revoked_elsewhere_meanwhile_is_one_line(home: Path, project: Project) -> None:
    login(home, project)
    project.serve("rest.my_api_keys", "rest.rpc.revoke_api_key.not_found")
    line = one_line_error(neuralgrid(home, "keys", "revoke", "ng-3f9a1c2b"))
    assert "(PT404): no API key" in line and "among yours" in line


def test_nodes_ls_lists_my_nodes_with_their_endpoints(home: Path, project: Project) -> None:
    login(home, project)
    routes = project.serve("rest.rpc.my_nodes")
    narrow = neuralgrid(home, "nodes", "ls")
    assert narrow.exit_code == 0, narrow.output
    assert "garage-4090" in narrow.stdout and "lab-a100" in narrow.stdout and "1/4" in narrow.stdout
    garage = next(line for line in narrow.stdout.splitlines() if line.startswith("garage-4090"))
    assert re.search(r"\d+ (s|min|h|d) ago", garage) and "99.4%" in garage  # 1482 served, 9 failed
    assert "tunnel:" not in narrow.stdout
    assert (
        narrow.stdout.splitlines()[-1] == "failed verification: lab-a100 (no requests for the failed model)"
    )
    wide = neuralgrid(home, "nodes", "ls", "--wide")
    assert "tunnel:garage-4090" in wide.stdout and "https://gpu.example.net:8001/" in wide.stdout
    assert "endpoint" in wide.stdout.splitlines()[0] and "verification" in wide.stdout.splitlines()[0]
    assert " verified " in next(line for line in wide.stdout.splitlines() if line.startswith("garage-4090"))
    assert " failed " in next(line for line in wide.stdout.splitlines() if line.startswith("lab-a100"))
    assert routes["rest.rpc.my_nodes"].calls.last.request.method == "POST"


def test_keys_usage_reads_my_usage_over_the_period(home: Path, project: Project) -> None:
    login(home, project)
    routes = project.serve("rest.my_usage")
    result = neuralgrid(home, "keys", "usage", "--days", "7")
    assert result.exit_code == 0, result.output
    params = routes["rest.my_usage"].calls.last.request.url.params
    assert params["select"] == "*" and params["day"] == f"gte.{first_day(7).isoformat()}"
    row = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("2026-11-22"))
    assert "laptop ng-3f9a1c2b" in row and "41" in row and "52310" in row and "0.004417" in row
    assert "(deleted key)" in result.stdout
    assert "--days takes 1 to 3660" in one_line_error(neuralgrid(home, "keys", "usage", "--days", "0"))


def test_node_earnings_without_a_gateway_reads_the_owners_rpcs(home: Path, project: Project) -> None:
    login(home, project)
    routes = project.serve(
        "rest.rpc.my_earnings",
        "rest.rpc.my_earnings_totals",
        "rest.rpc.my_node_stats",
        "rest.platform_settings",
        "rest.rpc.my_model_checks",
    )
    result = neuralgrid(home, "node", "earnings", "--days", "7")
    assert result.exit_code == 0, result.output
    since = json.loads(routes["rest.rpc.my_earnings"].calls.last.request.content)["p_since"]
    assert since == f"{first_day(7).isoformat()}T00:00:00+00:00"
    assert json.loads(routes["rest.rpc.my_node_stats"].calls.last.request.content) == {"p_window": "7 days"}
    lines = result.stdout.splitlines()
    assert lines[0] == f"Earnings of your nodes over the last 7 days (UTC), from {first_day(7).isoformat()}"
    garage = next(line for line in lines if line.startswith("garage-4090"))
    assert garage.split()[1:] == ["150", "0.06", "0.009000", "0.05"]  # below a cent: to the micro-dollar
    total = next(line for line in lines if line.startswith("total"))
    assert total.split()[1:] == ["160", "0.07", "0.01", "0.06"]
    assert "platform fee: 15% of what developers were charged" in lines
    assert "held: $0.01 not settled yet: forfeited if its model fails verification" in lines
    assert "forfeited: $0.004250 by models that failed verification (not in the total)" in lines
    # Each (node, model) under verification, from my_model_checks(): state, passed, failed, since.
    checks = [line.split() for line in lines if line.startswith(f"  {LLAMA8}")][-2:]
    assert [row[1:4] for row in checks] == [["verified", "40", "1"], ["failed", "1", "3"]]
    assert "last failure: the answer ignores the request's temperature" in result.stdout


def test_node_verify_asks_the_rpc_for_a_node_of_mine_by_name_or_id(home: Path, project: Project) -> None:
    login(home, project)
    routes = project.serve("rest.rpc.my_nodes", "rest.rpc.request_verification")
    result = neuralgrid(home, "node", "verify", "lab-a100")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"lab-a100: {LLAMA8} starts over, unverified")
    sent = json.loads(routes["rest.rpc.request_verification"].calls.last.request.content)
    assert sent == {"p_node_id": "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"}
    assert neuralgrid(home, "node", "verify", "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d").exit_code == 0
    line = one_line_error(neuralgrid(home, "node", "verify", "someone-elses"))
    assert line == "error: you have no node named 'someone-elses' (nor with that id)"
    assert routes["rest.rpc.request_verification"].call_count == 2  # never asked for a node not mine


def test_node_verify_of_a_node_with_nothing_failed_is_one_line(home: Path, project: Project) -> None:
    login(home, project)
    project.serve(
        "rest.rpc.my_nodes", "rest.rpc.request_verification.none_failed", "rest.rpc.my_model_checks"
    )
    line = one_line_error(neuralgrid(home, "node", "verify", "garage-4090"))
    assert line == (
        f"error: none of garage-4090's models can start over now ({LLAMA8} verified): a model is verified"
        " again once it has failed, an hour after at the soonest"
    )


# A session that ends, and what the project refuses ------------------------------------------------------


def expire(home: Path) -> None:
    """Make the stored access token expired, as an hour later; the file stays its owner's only."""
    document = stored(home)
    session = {**stored_session(home), "expires_at": int(time.time()) - 60}
    document["auth"][STORAGE_KEY] = json.dumps(session)
    (home / "session.json").write_text(json.dumps(document))


def test_an_expired_session_is_refreshed_and_the_new_tokens_kept(home: Path, project: Project) -> None:
    login(home, project)
    old_refresh = stored_session(home)["refresh_token"]
    expire(home)
    routes = project.serve("auth.token.refresh", "rest.my_api_keys")
    result = neuralgrid(home, "keys", "ls")
    assert result.exit_code == 0, result.output
    assert json.loads(routes["auth.token.refresh"].calls.last.request.content) == {
        "refresh_token": old_refresh
    }
    renewed = exchange("auth.token.refresh")["response"]["body"]
    sent = routes["rest.my_api_keys"].calls.last.request
    assert sent.headers["authorization"] == f"Bearer {renewed['access_token']}"
    assert stored_session(home)["refresh_token"] == renewed["refresh_token"] != old_refresh
    assert private(home / "session.json")


def test_a_session_that_cannot_be_refreshed_says_sign_in_again(home: Path, project: Project) -> None:
    login(home, project)
    expire(home)
    routes = project.serve("auth.token.refresh.revoked", "rest.my_api_keys")
    line = one_line_error(neuralgrid(home, "keys", "ls"))
    assert line == "error: your session was signed out or has expired: sign in again with `neuralgrid login`"
    assert routes["rest.my_api_keys"].call_count == 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("rest.my_api_keys.jwt_expired", "refused your session (JWT expired): sign in again"),
        ("rest.my_api_keys.missing", "lacks NeuralGrid's Data API"),
    ],
)
def test_what_the_data_api_refuses_is_one_line(home: Path, project: Project, name: str, message: str) -> None:
    login(home, project)
    project.serve(name)
    assert message in one_line_error(neuralgrid(home, "keys", "ls"))


def test_a_data_api_that_cannot_be_reached_is_one_line(home: Path, project: Project) -> None:
    login(home, project)
    project.down()
    line = one_line_error(neuralgrid(home, "nodes", "ls"))
    assert line.startswith(f"error: cannot reach the project's Data API at {PROJECT}")


def test_a_session_file_that_is_not_one_says_sign_in_again(home: Path) -> None:
    home.mkdir()
    (home / "session.json").write_text("{}")
    assert "sign in again with `neuralgrid login`" in one_line_error(neuralgrid(home, "keys", "ls"))


def test_without_a_session_the_commands_use_the_database(home: Path) -> None:
    """No session: the service path as before (here its database is nowhere), and usage, which is a
    user's, asks for a login."""
    assert "cannot reach the database" in one_line_error(neuralgrid(home, "keys", "ls"))
    assert "neuralgrid login" in one_line_error(neuralgrid(home, "keys", "usage"))
    assert "neuralgrid login" in one_line_error(neuralgrid(home, "node", "earnings"))


def test_a_developers_install_needs_no_server_package_for_the_hosted_path(
    home: Path, project: Project
) -> None:
    """The hosted commands import none of the server's packages but realtime and PyJWT, which
    supabase-py brings into the base install itself. The stored session points at a closed port."""
    login(home, project)
    document = {**stored(home), "project": f"http://127.0.0.1:{free_port()}"}
    (home / "session.json").write_text(json.dumps(document))
    blocked = ",".join(p for p in SERVER_ONLY if p not in SUPABASE_PY_BRINGS)
    command = [sys.executable, "-c", BLOCKED_RUN, blocked, "keys", "ls"]
    env = {**os.environ, "NEURALGRID_HOME": str(home), "DATABASE_URL": NOWHERE}
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == 1, result.stderr
    assert "cannot reach the project's Data API" in result.stderr
    assert "not part of the agent's install" not in result.stderr
