"""After `neuralgrid up`, the other commands find the stack it runs: the state file in NEURALGRID_HOME,
the port it really bound, the database it uses, the local owner of the keys the CLI creates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from neuralgrid.cli.common import stop_unless_serving
from neuralgrid.db.embedded import EmbeddedPostgres
from neuralgrid.server.settings import Settings
from tests.conftest import LLAMA8, free_port, wait_for

CLI = [sys.executable, "-m", "neuralgrid.cli"]
# What would otherwise tell a command where the stack is: these tests give only NEURALGRID_HOME.
WHERE = (
    "DATABASE_URL",
    "NEURALGRID_PORT",
    "NEURALGRID_HOST",
    "NEURALGRID_DB_PORT",
    "NEURALGRID_SUPABASE_URL",
)


def plain_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in WHERE}
    return {**env, "NEURALGRID_HOME": str(home), "COLUMNS": "200"}


def neuralgrid(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=120)


def dead_pid() -> int:
    """The pid of a process that has ended (a stale state file points at one)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def stale_record(pid: int, port: int) -> dict[str, Any]:
    return {
        "pid": pid,
        "process_start": "1",
        "started_at": "2026-01-01T00:00:00+00:00",
        "gateway_url": f"http://127.0.0.1:{port}",
        "host": "127.0.0.1",
        "port": port,
        "database_url": "postgresql://postgres@127.0.0.1:1/postgres",
        "embedded": True,
        "db_port": 1,
    }


@dataclass
class Stack:
    home: Path
    env: dict[str, str]
    process: subprocess.Popen[str]
    log: Path
    state: dict[str, Any]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`neuralgrid --db-port P up --port 0 --demo 2` on a home that holds a stale record, and no
    port ever given again."""
    home = tmp_path_factory.mktemp("stack") / "home"
    home.mkdir()
    (home / "stack.json").write_text(json.dumps(stale_record(dead_pid(), 1)))
    env = plain_env(home)
    db_port = free_port()
    log = home.parent / "up.log"
    with log.open("w") as sink:
        up = [*CLI, "--db-port", str(db_port), "up", "--port", "0", "--demo", "2"]
        process = subprocess.Popen(up, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)

    def recorded() -> dict[str, Any] | None:
        state: dict[str, Any] = json.loads((home / "stack.json").read_text())
        return state if state["pid"] == process.pid else None

    try:
        state = wait_for(recorded, timeout=90)
        yield Stack(home, env, process, log, state)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        EmbeddedPostgres(home / "postgres", port=db_port).stop()  # only if the test broke `up`


def test_up_records_the_port_it_really_bound(stack: Stack) -> None:
    state = stack.state
    assert state["port"] > 0 and state["gateway_url"] == f"http://127.0.0.1:{state['port']}"
    assert httpx.get(f"{state['gateway_url']}/readyz", timeout=5).status_code == 200
    assert state["embedded"] and state["database_url"].startswith("postgresql://postgres@localhost:")
    assert (stack.home / "stack.json").stat().st_mode & 0o077 == 0  # a DATABASE_URL may hold a password
    # Start-up said what it was doing, a line per step (this log is no terminal).
    output = stack.log.read_text()
    for step in ("starting the embedded Postgres", "applying migrations: ", "registering 2 demo nodes"):
        assert step in output
    assert f"gateway   {state['gateway_url']}/v1" in output


def test_status_signin_and_watch_talk_to_the_running_stack(stack: Stack) -> None:
    gateway = stack.state["gateway_url"]
    pretty = neuralgrid(stack.env, "status")
    assert pretty.returncode == 0
    assert pretty.stdout.splitlines()[0].startswith(f"running: `neuralgrid up` (pid {stack.process.pid})")
    info = json.loads(neuralgrid(stack.env, "status", "-o", "json").stdout)
    assert info["API_URL"] == f"{gateway}/v1" and info["DB_URL"] == stack.state["database_url"]

    signin = neuralgrid(stack.env, "signin")
    assert signin.returncode == 0 and signin.stderr == ""
    link = signin.stdout.strip()
    assert link.startswith(f"{gateway}/signin#token=")
    reply = httpx.post(f"{gateway}/api/auth/signin", json={"token": link.split("#token=")[1]}, timeout=5)
    assert reply.status_code == 200

    watch = neuralgrid(stack.env, "watch", "--timeout", "1")
    assert watch.returncode == 0, watch.stderr
    fleet, header = watch.stdout.splitlines()[:2], watch.stdout.splitlines()[2]
    assert all(" fleet " in line for line in fleet) and "watching node-map" in header


def test_database_commands_and_simulate_use_the_stack_database(stack: Stack, tmp_path: Path) -> None:
    url = neuralgrid(stack.env, "db", "url")
    assert url.returncode == 0 and url.stdout.strip() == stack.state["database_url"]
    nodes = json.loads(neuralgrid(stack.env, "nodes", "ls", "--json").stdout)
    assert len(nodes) == 2  # the running stack's demo nodes
    sim = neuralgrid(
        stack.env, "simulate", "--out", str(tmp_path), "--nodes", "10", "--rps", "2", "--duration", "10",
        "--policies", "balanced",
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    assert (tmp_path / "report.md").exists()


def test_keys_the_cli_creates_belong_to_the_local_owner(stack: Stack) -> None:
    """The web page's keys list (GET /v1/keys as the signed-in local owner) shows a CLI-made key,
    and a node registered with it is on the owner's nodes list."""
    created = neuralgrid(stack.env, "keys", "create", "--name", "from-the-cli")
    assert created.returncode == 0, created.stderr
    assert "for owner@localhost" in created.stdout
    key = created.stdout.strip().splitlines()[-1]

    gateway = stack.state["gateway_url"]
    token = neuralgrid(stack.env, "signin").stdout.strip().split("#token=")[1]
    session = httpx.post(f"{gateway}/api/auth/signin", json={"token": token}, timeout=5).json()
    signed_in = {"authorization": f"Bearer {session['access_token']}"}
    listed = httpx.get(f"{gateway}/v1/keys", headers=signed_in, timeout=5).json()["data"]
    assert "from-the-cli" in [k["name"] for k in listed]

    node = {
        "name": "cli-key-node",
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
    mine = httpx.get(f"{gateway}/api/my/nodes", headers=signed_in, timeout=5).json()["data"]
    assert [n["name"] for n in mine] == ["cli-key-node"]


def test_up_on_the_running_stack_port_names_it(stack: Stack) -> None:
    port = str(stack.state["port"])
    started = time.monotonic()
    again = neuralgrid({**stack.env, "NEURALGRID_DB_PORT": str(free_port())}, "up", "--port", port)
    assert again.returncode == 1 and time.monotonic() - started < 30
    [line] = again.stderr.splitlines()
    assert f":{port}" in line and f"(pid {stack.process.pid})" in line and "--port" in line
    assert httpx.get(f"{stack.state['gateway_url']}/readyz", timeout=5).status_code == 200


def test_status_says_when_nothing_runs(tmp_path: Path) -> None:
    """Not running is a failure, as `supabase status` has it: one line, no URLs or keys of a stack
    that is not there, and a non-zero exit for scripts."""
    env = plain_env(tmp_path / "home")
    for output in ("pretty", "json", "env"):
        status = neuralgrid(env, "status", "-o", output)
        assert status.returncode == 1 and status.stdout == "", (output, status.stdout)
        [line] = status.stderr.splitlines()
        assert "not running: no `neuralgrid up` runs from" in line and "neuralgrid up" in line
    started = time.monotonic()
    watch = neuralgrid(env, "watch", "--timeout", "30")
    assert watch.returncode == 1 and time.monotonic() - started < 10  # it tried for 15 s
    [line] = watch.stderr.splitlines()
    assert "not running" in line and "neuralgrid up" in line and "NEURALGRID_PORT" in line


def test_a_stale_state_file_is_recognised_and_ignored(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    pid, port = dead_pid(), free_port()
    (home / "stack.json").write_text(json.dumps(stale_record(pid, port)))
    env = plain_env(home)
    status = neuralgrid(env, "status")
    assert status.returncode == 1 and status.stdout == ""
    [line] = status.stderr.splitlines()
    assert f"not running: the stack recorded in {home / 'stack.json'}" in line
    assert f"(pid {pid}) is gone" in line
    assert f":{port}" not in line  # its port is not the one commands use
    signin = neuralgrid(env, "signin")
    assert signin.stdout.startswith("http://127.0.0.1:8080/signin#token=") and "not running" in signin.stderr


def test_a_command_stops_the_database_it_started_and_a_home_keeps_its_port(tmp_path: Path) -> None:
    """With no `up` running, `keys ls` started the embedded Postgres and left it running: a later
    `up` then took it for another's and left it running at its end, and a fresh home on that port
    failed (a new user's trial). A command stops what it started; `db url` keeps it for psql until
    `db stop`; and a home set up on another port is found there again with only NEURALGRID_HOME."""
    home = tmp_path / "home"
    server = EmbeddedPostgres(home / "postgres", port=free_port())
    first = neuralgrid({**plain_env(home), "NEURALGRID_DB_PORT": str(server.port)}, "keys", "ls")
    assert first.returncode == 0, first.stderr
    assert not server.is_running()
    env = plain_env(home)  # the port never given again
    url = neuralgrid(env, "db", "url")
    assert url.returncode == 0 and f":{server.port}/" in url.stdout, url.stdout + url.stderr
    assert server.is_running()
    assert neuralgrid(env, "nodes", "ls").returncode == 0 and server.is_running()  # not its own to stop
    assert neuralgrid(env, "db", "stop").stdout.strip() == "stopped the embedded database"
    assert not server.is_running()
    again = neuralgrid(env, "nodes", "ls")
    assert again.returncode == 0 and f"port {server.port}" in again.stderr, again.stderr
    assert not server.is_running()
    assert neuralgrid(env, "db", "migrate").returncode == 0 and not server.is_running()
    # `up` on that home records the port its server runs on, for the other commands to find.
    with (home.parent / "up.log").open("w") as sink:
        up = subprocess.Popen([*CLI, "up", "--port", "0", "--demo", "0"], env=env, stdout=sink, stderr=sink)
    try:
        recorded = home / "stack.json"
        state = wait_for(lambda: recorded.exists() and json.loads(recorded.read_text()), timeout=90)
        assert state["pid"] == up.pid and state["db_port"] == server.port
        # A command that started the server before `up` took it over leaves it to `up`.
        stop_unless_serving(Settings(NEURALGRID_HOME=home), server)
        assert server.is_running()
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=30)
    assert not server.is_running()  # `up` started it: `up` stopped it
