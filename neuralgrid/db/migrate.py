"""Apply the Supabase compatibility layer (where missing) and `supabase/migrations`, in order.

History goes to `supabase_migrations.schema_migrations (version, statements, name)` exactly as the
Supabase CLI writes it: the statements split at top-level semicolons, comments kept, whitespace
trimmed, the final semicolon dropped. So `supabase migration up` and `neuralgrid db migrate` each see
what the other applied, and applying twice is a no-op.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

import psycopg

from neuralgrid.db.errors import MigrationError

log = logging.getLogger(__name__)

MIGRATION_NAME = re.compile(r"^(?P<version>\d{14})_(?P<name>[A-Za-z0-9_\-]+)\.sql$")
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_][A-Za-z_0-9]*)?\$")

HISTORY_DDL = """
create schema if not exists supabase_migrations;
create table if not exists supabase_migrations.schema_migrations (
  version text not null primary key,
  statements text[],
  name text
)
"""


class Progress(Protocol):
    """Where a long set-up reports what it does: a line per step, and a count for many small ones."""

    def step(self, text: str) -> None: ...

    def count(self, text: str, done: int, total: int) -> None: ...


class Quiet:
    """Progress nobody watches (tests, the gateway's own start)."""

    def step(self, text: str) -> None:
        pass

    def count(self, text: str, done: int, total: int) -> None:
        pass


@dataclass(frozen=True)
class Migration:
    version: str
    name: str
    path: Path

    @property
    def statements(self) -> list[str]:
        return split_statements(self.path.read_text())


def split_statements(sql: str) -> list[str]:
    """Split SQL at top-level semicolons, respecting quotes, dollar quotes and comments."""
    statements: list[str] = []
    start = i = 0
    n = len(sql)
    while i < n:
        c = sql[i]
        if c == "-" and sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif c == "/" and sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c in "'\"":
            i += 1
            while i < n:
                if sql[i] == c and sql.startswith(c * 2, i):
                    i += 2
                elif sql[i] == c:
                    i += 1
                    break
                else:
                    i += 1
        elif c == "$" and (tag := _DOLLAR_TAG.match(sql, i)) and not _in_identifier(sql, i):
            end = sql.find(tag.group(), tag.end())
            i = n if end < 0 else end + len(tag.group())
        elif c == ";":
            statements.append(sql[start:i])
            start = i = i + 1
        else:
            i += 1
    statements.append(sql[start:])
    return [s.strip() for s in statements if s.strip()]


def _in_identifier(sql: str, i: int) -> bool:
    return i > 0 and (sql[i - 1].isalnum() or sql[i - 1] == "_")


def discover(migrations_dir: Path) -> list[Migration]:
    """The migrations in a directory, in version order; a badly named .sql file is an error."""
    found: list[Migration] = []
    for path in sorted(migrations_dir.glob("*.sql")):
        match = MIGRATION_NAME.match(path.name)
        if match is None:
            raise MigrationError(f"{path.name}: migration files are named YYYYMMDDHHMMSS_name.sql")
        found.append(Migration(match["version"], match["name"], path))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migrations share a version in {migrations_dir}")
    return found


def default_migrations_dir() -> Path:
    """`supabase/migrations` of the source checkout this package runs from."""
    return Path(__file__).resolve().parents[2] / "supabase" / "migrations"


def compat_sql() -> str:
    return resources.files("neuralgrid.db").joinpath("sql/supabase_compat.sql").read_text()


def has_supabase_layer(conn: psycopg.Connection) -> bool:
    """True where Supabase's roles, auth functions and realtime schema already exist."""
    row = conn.execute(
        """
        select to_regprocedure('auth.uid()') is not null
           and to_regclass('realtime.messages') is not null
           and to_regprocedure('realtime.send(jsonb,text,text,boolean)') is not null
           and (select count(*) = 4 from pg_roles
                where rolname in ('anon', 'authenticated', 'service_role', 'authenticator'))
           and exists (select from pg_publication where pubname = 'supabase_realtime')
        """
    ).fetchone()
    return bool(row and row[0])


def apply_compat_layer(conn: psycopg.Connection) -> bool:
    """Create the Supabase compatibility layer if the target lacks it. Returns True if applied."""
    if has_supabase_layer(conn):
        return False
    with conn.transaction():
        for statement in split_statements(compat_sql()):
            conn.execute(statement.encode())
    return True


def feed_sql() -> str:
    return resources.files("neuralgrid.db").joinpath("sql/realtime_feed.sql").read_text()


def apply_realtime_feed(conn: psycopg.Connection) -> bool:
    """Install the embedded Realtime server's feed (NOTIFY triggers) unless Supabase's Realtime runs
    on this database (it reads the WAL itself). Idempotent; returns True if applied."""
    if conn.execute("select to_regclass('realtime.subscription') is not null").fetchone() == (True,):
        return False
    with conn.transaction():
        for statement in split_statements(feed_sql()):
            conn.execute(statement.encode())
    return True


def setup_database(conn: psycopg.Connection, progress: Progress | None = None) -> list[Migration]:
    """Everything the platform needs in one database: the compat layer where missing, the pending
    migrations, and the Realtime feed where Supabase's Realtime does not run."""
    progress = progress or Quiet()
    if not has_supabase_layer(conn):
        progress.step("adding the Supabase compatibility layer")
        apply_compat_layer(conn)
    applied = migrate(conn, progress=progress)
    apply_realtime_feed(conn)
    return applied


def schema_digest(migrations_dir: Path | None = None) -> str:
    """A digest of everything setup_database() applies: two databases set up from the same digest
    hold the same schema (so a copy of one serves where the other would be set up anew)."""
    digest = hashlib.sha256(compat_sql().encode() + feed_sql().encode())
    for migration in discover(migrations_dir or default_migrations_dir()):
        digest.update(migration.path.name.encode() + migration.path.read_bytes())
    return digest.hexdigest()


def schedule_sweep(conn: psycopg.Connection) -> str:
    """Have pg_cron sweep from the database where it is enabled (20261129000300_sweep_schedule.sql);
    says what was done, or why nothing was."""
    try:
        with conn.transaction():
            row = conn.execute("select public.schedule_sweep()").fetchone()
    except psycopg.Error as err:
        return f"pg_cron could not schedule the sweep: {err.diag.message_primary or err}"
    return str(row[0]) if row else "pg_cron did not answer"


def applied_versions(conn: psycopg.Connection) -> set[str]:
    if conn.execute("select to_regclass('supabase_migrations.schema_migrations')").fetchone() == (None,):
        return set()
    return {v for (v,) in conn.execute("select version from supabase_migrations.schema_migrations")}


def pending(conn: psycopg.Connection, migrations_dir: Path | None = None) -> list[Migration]:
    """The migrations of this checkout that the database has not applied, in order."""
    done = applied_versions(conn)
    return [m for m in discover(migrations_dir or default_migrations_dir()) if m.version not in done]


def check_applied(conn: psycopg.Connection, migrations_dir: Path | None = None) -> None:
    """A MigrationError that says what to run when the database lacks any of the migrations (a
    DATABASE_URL nobody has migrated yet, or one behind this checkout)."""
    hidden = (
        "select to_regclass('supabase_migrations.schema_migrations') is null"
        " and to_regclass('public.nodes') is not null"
    )
    if conn.execute(hidden).fetchone() == (True,):
        return  # migrated, with the history out of this role's sight: nothing to tell
    missing = pending(conn, migrations_dir)
    if not missing:
        return
    total = len(discover(migrations_dir or default_migrations_dir()))
    if len(missing) == total:
        what = f"has none of NeuralGrid's {total} migrations (an empty or foreign database)"
    else:
        what = f"lacks {len(missing)} of NeuralGrid's {total} migrations (the first: {missing[0].path.stem})"
    raise MigrationError(
        f"the database at DATABASE_URL {what}: apply them with `neuralgrid db migrate`"
        " (same DATABASE_URL), then try again"
    )


def migrate(
    conn: psycopg.Connection, migrations_dir: Path | None = None, progress: Progress | None = None
) -> list[Migration]:
    """Apply pending migrations, each in its own transaction. Returns those applied."""
    progress = progress or Quiet()
    with conn.transaction():
        for statement in split_statements(HISTORY_DDL):
            conn.execute(statement.encode())
    todo = pending(conn, migrations_dir)
    applied: list[Migration] = []
    current = ""

    def warn(diag: psycopg.errors.Diagnostic) -> None:
        # A migration that skips something it cannot do here says so with RAISE WARNING (as psql and
        # the Supabase CLI show it): so do we, rather than let it pass unseen.
        if diag.severity_nonlocalized == "WARNING":
            log.warning("%s: %s", current, diag.message_primary)

    conn.add_notice_handler(warn)
    if todo:
        progress.count("applying migrations", 0, len(todo))
    try:
        for migration in todo:
            current = migration.path.name
            statements = migration.statements
            try:
                with conn.transaction():
                    for statement in statements:
                        conn.execute(statement.encode())
                    conn.execute(
                        "insert into supabase_migrations.schema_migrations (version, statements, name)"
                        " values (%s, %s, %s)",
                        (migration.version, statements, migration.name),
                    )
            except psycopg.Error as err:
                raise MigrationError(f"{migration.path.name}: {err}") from err
            applied.append(migration)
            progress.count("applying migrations", len(applied), len(todo))
    finally:
        conn.remove_notice_handler(warn)
    return applied
