"""Running supabase/tests/database (pgTAP, as `supabase test db` runs it) against the test suite's
Supabase-shaped cluster.

The embedded PostgreSQL 18 has no pgTAP. Debian's `postgresql-15-pgtap` ships pgTAP's SQL; pgTAP is
plain SQL and PL/pgSQL (no C module), so its control file and install script are copied into a
directory of our own, which PostgreSQL 18's `extension_control_path` adds to where `CREATE EXTENSION`
looks, for the test database only. The test files' own `create extension if not exists pgtap with
schema extensions` then installs it as `postgres`, as it does on a Supabase stack (the control file
says `superuser = false`). pg_prove (Debian's `pgtap` package) runs the files with the embedded
server's own psql, connected as the non-superuser `postgres`, with the search_path Supabase gives
that role (`"$user", public, extensions`) so that pgTAP's functions are found unqualified.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from neuralgrid.db.embedded import POSTGRES_BIN_PATH, EmbeddedPostgres

ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = ROOT / "supabase" / "tests" / "database"
# Where Debian's postgresql-NN-pgtap packages put pgTAP's control file and scripts.
DEBIAN_SHARE = Path("/usr/share/postgresql")
# Supabase's search_path for postgres; PGOPTIONS sets it (and quiets NOTICEs) for each pg_prove file.
PGOPTIONS = '-c search_path="$user",public,extensions -c client_min_messages=warning'


def pg_prove() -> str | None:
    return shutil.which("pg_prove")


def pgtap_files() -> list[Path]:
    """The pgTAP files, in the order pg_prove (and `supabase test db`) runs them: by name."""
    return sorted(TESTS_DIR.glob("*.sql"))


def planned(files: Sequence[Path]) -> int:
    """The number of tests the files plan (`select plan(n)`, one per file)."""
    return sum(int(n) for f in files for n in re.findall(r"select plan\((\d+)\)", f.read_text()))


def pgtap_control() -> Path | None:
    """pgTAP's control file from Debian's newest postgresql-NN-pgtap, if one is installed."""
    found = sorted(DEBIAN_SHARE.glob("*/extension/pgtap.control"), key=lambda p: int(p.parts[-3]))
    return found[-1] if found else None


@contextmanager
def extension_dir(control: Path) -> Iterator[Path]:
    """A directory holding `extension/pgtap.control` and the install script of its default version,
    readable by the server's system user, for extension_control_path."""
    match = re.search(r"^default_version\s*=\s*'([^']+)'", control.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{control} names no default_version")
    script = control.with_name(f"pgtap--{match[1]}.sql")
    root = Path(tempfile.mkdtemp(prefix="ng-pgtap-"))
    try:
        target = root / "extension"
        target.mkdir()
        for source in (control, script):
            shutil.copyfile(source, target / source.name)
            (target / source.name).chmod(0o644)
        for directory in (root, target):
            directory.chmod(0o755)  # the embedded server runs as its own system user
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def offer_pgtap(server: EmbeddedPostgres, database: str, directory: Path) -> None:
    """Lets CREATE EXTENSION find pgTAP in `directory` for new sessions on `database` (a superuser's
    setting, made as the cluster's bootstrap superuser). Also gives postgres the rights on the
    database that it has on a project's (the test helpers create their schema): a database's grants
    are not copied from its template."""
    with psycopg.connect(server.url(database), autocommit=True) as conn:
        name = sql.Identifier(database)
        conn.execute(sql.SQL("grant all on database {} to postgres").format(name))
        conn.execute(
            sql.SQL("alter database {} set extension_control_path = {}").format(
                name, sql.Literal(f"$system:{directory}")
            )
        )


@dataclass(frozen=True)
class Proved:
    returncode: int
    output: str  # pg_prove's stdout and stderr: one line per file, then failures' diagnostics

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and "Result: PASS" in self.output

    @property
    def tests(self) -> int:
        """How many tests ran (pg_prove's summary line: `Files=11, Tests=363, ...`)."""
        match = re.search(r"^Files=\d+, Tests=(\d+)", self.output, re.MULTILINE)
        return int(match[1]) if match else 0


def prove(server: EmbeddedPostgres, database: str, files: Sequence[Path], *, timeout: float = 120) -> Proved:
    """Runs pg_prove over `files` as postgres on `database`."""
    command = [
        pg_prove() or "pg_prove",
        "--psql-bin",
        str(POSTGRES_BIN_PATH / "psql"),
        "--host",
        str(server.socket_dir),
        "--port",
        str(server.port),
        "--username",
        "postgres",
        "--dbname",
        database,
        "--failures",
        *map(str, files),
    ]
    env = {**os.environ, "PGOPTIONS": PGOPTIONS}
    for variable in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGPASSWORD", "PGSERVICE"):
        env.pop(variable, None)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return Proved(result.returncode, result.stdout + result.stderr)
