"""`neuralgrid watch` on a quiet fleet prints the fleet first, so a quiet feed never reads as a hang."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import psycopg
from typer.testing import CliRunner

from neuralgrid.cli import app
from tests.conftest import make_node


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
