"""pgbouncer in front of the test Postgres, as several gateways would share a database in production:
one database name pooled per transaction (the request path), one per session (LISTEN, the sweeper).

Debian's package (`./dev test` installs it); tests that need it are skipped where it is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import free_port

TRANSACTION, SESSION = "ng_transaction", "ng_session"  # the pooled databases' names


def executable() -> str | None:
    """pgbouncer's path (Debian puts it in /usr/sbin, which a user's PATH may lack)."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")


@dataclass(frozen=True)
class Bouncer:
    port: int

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def show(self, what: str) -> list[dict[str, Any]]:
        """`SHOW <what>` on pgbouncer's admin console (simple query protocol only: a client cursor)."""
        with psycopg.connect(
            self.url("pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor
        ) as conn:
            cur = conn.execute(f"show {what}")
            names = [column.name for column in cur.description or []]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def stat(self, database: str, column: str) -> int:
        return sum(int(row[column]) for row in self.show("stats") if row["database"] == database)


def config(postgres_port: int, database: str, port: int) -> str:
    target = f"host=127.0.0.1 port={postgres_port} dbname={database} user=postgres"
    return f"""\
[databases]
{TRANSACTION} = {target} pool_mode=transaction pool_size=20
{SESSION} = {target} pool_mode=session pool_size=30

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
; Loopback only, in front of a trust-auth test cluster: any user name, the server login is postgres.
auth_type = any
admin_users = postgres
max_client_conn = 500
; server_reset_query runs between session clients only (pgbouncer's default), as in production.
server_reset_query = DISCARD ALL
"""


@contextmanager
def pgbouncer(postgres_port: int, database: str, directory: Path) -> Iterator[Bouncer]:
    """pgbouncer on a free loopback port in front of `database`, its ini and log in `directory`."""
    binary = executable()
    if binary is None:
        pytest.skip("pgbouncer is not installed (./dev test installs Debian's package)")
    port = free_port()
    ini = directory / "pgbouncer.ini"
    ini.write_text(config(postgres_port, database, port))
    # It refuses to run as root; -u drops to an unprivileged user once the ini is read.
    user = ["-u", "nobody"] if os.geteuid() == 0 else []
    with (directory / "pgbouncer.log").open("w") as log:
        proc = subprocess.Popen([binary, *user, str(ini)], stdout=log, stderr=subprocess.STDOUT)
    bouncer = Bouncer(port)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                bouncer.show("version")
                break
            except psycopg.OperationalError as err:
                if proc.poll() is not None or time.monotonic() > deadline:
                    said = (directory / "pgbouncer.log").read_text()
                    raise RuntimeError(f"pgbouncer did not start:\n{said}") from err
                time.sleep(0.05)
        yield bouncer
    finally:
        proc.terminate()
        proc.wait(timeout=10)
