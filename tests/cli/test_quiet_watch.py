"""`neuralgrid watch` on a quiet fleet prints the fleet first, so a quiet feed never reads as a hang."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
from typer.testing import CliRunner

from neuralgrid.bench import served
from neuralgrid.cli import app
from tests.conftest import free_port, make_node


def test_watch_prints_the_fleet_then_the_changes(
    conn: psycopg.Connection, db_url: str, gateway: str, tmp_path: Path
) -> None:
    make_node(conn, "quiet-l4", gpu_model="NVIDIA L4", region="eu-west")
    make_node(conn, "quiet-4090", region="us-east")
    where = urlsplit(gateway)
    env = {
        "NEURALGRID_HOME": str(tmp_path),
        "DATABASE_URL": db_url,
        "NEURALGRID_HOST": str(where.hostname),
        "NEURALGRID_PORT": str(where.port),
        "COLUMNS": "200",
    }
    watch = CliRunner().invoke(app, ["watch", "--timeout", "1"], env=env)
    assert watch.exit_code == 0, watch.output
    lines = watch.stdout.splitlines()
    fleet = [line for line in lines if "quiet-" in line]
    assert len(fleet) == 2, watch.stdout  # no change happened: these are the fleet as it stands
    l4 = next(line for line in fleet if "quiet-l4" in line)
    assert "online" in l4 and "NVIDIA L4" in l4 and "eu-west" in l4
    assert any("watching node-map" in line for line in lines)


def test_watch_outlives_a_restart_of_the_platform(
    conn: psycopg.Connection, db_url: str, tmp_path: Path
) -> None:
    """The gateway stops and comes back on its port after longer than the Realtime client's own
    retries last (five, 15 s): the watch says it lost the feed and goes on once the gateway is back.
    It had stayed silent for good, alive, printing nothing (a new user's trial)."""
    make_node(conn, "restarted-l4", gpu_model="NVIDIA L4")
    port = free_port()
    env = {
        **os.environ,
        "NEURALGRID_HOME": str(tmp_path),
        "DATABASE_URL": db_url,
        "NEURALGRID_HOST": "127.0.0.1",
        "NEURALGRID_PORT": str(port),
        "COLUMNS": "200",
    }
    lines: queue.Queue[str] = queue.Queue()

    def seen(text: str, within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                if text in lines.get(timeout=0.2):
                    return True
        return False

    up = [sys.executable, "-m", "neuralgrid.cli", "up", "--demo", "0"]  # a gateway process of its own
    with served(up, env, f"http://127.0.0.1:{port}/readyz"):
        watching = subprocess.Popen(
            [sys.executable, "-m", "neuralgrid.cli", "watch", "--timeout", "60"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert watching.stdout is not None
        out = watching.stdout

        def read() -> None:
            for line in out:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        try:
            assert seen("watching node-map", 15)
            # the block's end stops the gateway (SIGTERM); the watch waits out the restart
        except BaseException:
            watching.kill()
            raise
    try:
        assert seen("lost the feed", 10)
        time.sleep(17)  # past the client's own retries
        with served(up, env, f"http://127.0.0.1:{port}/readyz"):
            assert seen("watching node-map", 15)
            conn.execute("update nodes set status = 'draining' where name = 'restarted-l4'")
            assert seen("restarted-l4", 10)
    finally:
        watching.kill()
        watching.wait(10)
        out.close()
