"""The running stack's state file: what `neuralgrid up` really started, for the other commands.

`up` writes `NEURALGRID_HOME/stack.json` once its gateway listens (the address and port it bound,
the database, its pid) and removes it when it exits cleanly. `status`, `signin`, `watch` and the
database commands read it, so that `up --port 9090` needs no port repeated. A file whose process is
gone (killed, or the machine restarted) is stale: it is ignored and replaced. Options and
environment variables given to a command still win over the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from neuralgrid.server.settings import Settings
from neuralgrid.server.stack import public_base_url

STATE_FILE = "stack.json"


@dataclass(frozen=True)
class RunningStack:
    """One `neuralgrid up` process, as it recorded itself."""

    pid: int
    # The process's start time (from /proc): tells a pid the system handed out again from ours.
    process_start: str | None
    started_at: str  # ISO 8601, UTC
    gateway_url: str
    host: str
    port: int
    database_url: str
    embedded: bool
    db_port: int | None  # the embedded server's port; None with DATABASE_URL

    @property
    def alive(self) -> bool:
        return process_start(self.pid) == self.process_start if _has_proc() else _exists(self.pid)


def state_file(settings: Settings) -> Path:
    return settings.home / STATE_FILE


def this_process(settings: Settings, url: str, host: str, port: int) -> RunningStack:
    """The record of the calling process, serving the gateway on host:port and the database at url."""
    return RunningStack(
        pid=os.getpid(),
        process_start=process_start(os.getpid()),
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        gateway_url=public_base_url(settings.model_copy(update={"host": host, "port": port})),
        host=host,
        port=port,
        database_url=url,
        embedded=settings.embedded,
        db_port=settings.db_port if settings.embedded else None,
    )


def read(settings: Settings) -> RunningStack | None:
    """The recorded stack, alive or stale; None when there is none (or the file is unreadable)."""
    try:
        return RunningStack(**json.loads(state_file(settings).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def find(settings: Settings) -> RunningStack | None:
    """The recorded stack if its process still runs."""
    stack = read(settings)
    return stack if stack is not None and stack.alive else None


def record(settings: Settings, stack: RunningStack) -> RunningStack | None:
    """Record `stack` unless another live one is recorded already (several gateways may share a
    home: the first keeps the file). Returns the other one when it does."""
    with _locked(settings):
        other = find(settings)
        if other is not None and other.pid != stack.pid:
            return other
        path = state_file(settings)
        scratch = path.with_suffix(".tmp")
        # 0600: DATABASE_URL may carry a password.
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(stack), f, indent=2)
        os.replace(scratch, path)
    return None


def forget(settings: Settings, pid: int) -> None:
    """Remove the file if it is this pid's record (never another stack's)."""
    with _locked(settings):
        stack = read(settings)
        if stack is not None and stack.pid == pid:
            state_file(settings).unlink(missing_ok=True)


def with_running_stack(settings: Settings, stack: RunningStack | None) -> Settings:
    """Settings that talk to the running stack: its gateway unless NEURALGRID_HOST or
    NEURALGRID_PORT was given, its database unless DATABASE_URL or NEURALGRID_DB_PORT was."""
    if stack is None:
        return settings
    given = settings.model_fields_set
    update: dict[str, object] = {}
    if not {"host", "port"} & given:
        update |= {"host": stack.host, "port": stack.port}
    if not {"database_url", "db_port"} & given:
        if stack.embedded and stack.db_port is not None:
            update |= {"database_url": None, "db_port": stack.db_port}
        else:
            update |= {"database_url": stack.database_url}
    return settings.model_copy(update=update)


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), if any."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its closing one.
    return stat[stat.rindex(")") + 2 :].split()[19]


def _has_proc() -> bool:
    return Path("/proc/self/stat").exists()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


@contextlib.contextmanager
def _locked(settings: Settings) -> Iterator[None]:
    """One writer at a time (two `up`s starting together must not both take the file)."""
    settings.home.mkdir(parents=True, exist_ok=True)
    lock = os.open(state_file(settings).with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)
