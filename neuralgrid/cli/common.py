"""What every command shares: the console, one-line errors, settings, the database, logging.

Server-side imports happen inside functions, so a node owner's install (the agent alone) runs
`neuralgrid node run` without the server's dependencies.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Column as RichColumn
from rich.table import Table
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # typer's click
from typer.core import TyperGroup

if TYPE_CHECKING:
    import psycopg

    from neuralgrid.db.embedded import EmbeddedPostgres
    from neuralgrid.server.settings import Settings

# The JSON a benchmark writes (every `neuralgrid bench` command takes it).
OutFile = Annotated[
    Path, typer.Option("--out", envvar="NEURALGRID_BENCH_OUT", help="Where to write the JSON.")
]

out = Console()
P = ParamSpec("P")
R = TypeVar("R")


def fail(message: str) -> typer.Exit:
    """One line on stderr and a non-zero exit, for every error a person can cause."""
    Console(stderr=True).print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


class OneLineErrors(TyperGroup):
    """The CLI's top group: a usage error (an unknown command or option, a value its option refuses)
    is one line naming the help to read, exit 2, as every other error is one line (fail()).
    Typer draws it as a box of five or six lines under the usage."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False  # errors come here; an exit's code is returned
        _reflow_help(self)
        try:
            code = super().main(*args, **kwargs)
        except NoArgsIsHelpError as err:  # its help is printed already
            sys.exit(err.exit_code)
        except UsageError as err:
            command = err.ctx.command_path if err.ctx is not None else self.name
            fail(f"{err.format_message()} (see `{command} --help`)")
            sys.exit(err.exit_code)
        except ClickException as err:
            fail(err.format_message())
            sys.exit(err.exit_code)
        except typer.Abort:
            fail("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _reflow_help(command: Any) -> None:
    """Each paragraph of a command's docstring as one line for the terminal to wrap: Typer keeps the
    docstring's own line breaks, which cut `--help` mid-sentence. A list's items keep their lines."""
    if command.help:
        command.help = "\n\n".join(_joined(paragraph) for paragraph in command.help.split("\n\n"))
    for sub in getattr(command, "commands", {}).values():
        _reflow_help(sub)


def _joined(paragraph: str) -> str:
    lines = paragraph.strip().splitlines()
    if any(line.lstrip().startswith(("- ", "* ")) for line in lines):
        return paragraph.strip()
    return " ".join(line.strip() for line in lines)


def progress(message: str) -> None:
    Console(stderr=True).print(f"[dim]{message}[/]")


class StartupProgress:
    """A long start's steps on stderr, a line each. A count (migrations) moves in place on a
    terminal; in a log it is one line when it starts, so a log stays short and shows where it hung."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)

    def step(self, text: str) -> None:
        self.console.print(f"[dim]{text}[/]", soft_wrap=True)

    def count(self, text: str, done: int, total: int) -> None:
        if not self.console.is_terminal:
            if done == 0:
                self.step(f"{text}: {total}")
            return
        end = "\n" if done == total else "\r"
        self.console.print(f"[dim]{text} {done}/{total}[/]", end=end, soft_wrap=True)


def friendly_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Database and embedded-server errors as one line each."""

    @wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import psycopg

        from neuralgrid.db.embedded import EmbeddedPostgresError
        from neuralgrid.db.errors import DatabaseError

        try:
            return command(*args, **kwargs)
        except (DatabaseError, EmbeddedPostgresError) as err:
            raise fail(str(err).splitlines()[0]) from err
        except psycopg.OperationalError as err:
            raise fail(f"cannot reach the database: {str(err).strip().splitlines()[0]}") from err

    return wrapper


@dataclass
class Options:
    """The global options; the settings are read only by the commands that need them."""

    overrides: dict[str, Any]
    _settings: Settings | None = field(default=None, repr=False)
    _configured: Settings | None = field(default=None, repr=False)

    @property
    def configured(self) -> Settings:
        """The settings from options, the environment and `.env` alone (what `up` starts with)."""
        if self._configured is None:
            self._configured = self._read(with_running_stack=False)
        return self._configured

    @property
    def settings(self) -> Settings:
        """The settings that talk to the stack `neuralgrid up` runs from this home, where the
        options and environment leave its gateway or database unsaid."""
        if self._settings is None:
            self._settings = self._read(with_running_stack=True)
        return self._settings

    def _read(self, *, with_running_stack: bool) -> Settings:
        from pydantic import ValidationError

        from neuralgrid import validation
        from neuralgrid.server import running
        from neuralgrid.server.settings import Settings
        from neuralgrid.server.stack import with_stack_secret

        try:
            config = Settings(**self.overrides)
        except ValidationError as err:
            error = err.errors()[0]
            said = validation.message(error)
            # The variable's name, not its value: a setting may be a secret.
            named = ".".join(str(part) for part in error["loc"])
            raise fail(f"{named}: {said}" if named else said) from err
        if with_running_stack:  # before the secret: the stack's database decides where it comes from
            config = running.with_running_stack(config, running.find(config))
        config = with_stack_secret(config)
        _check_url("DATABASE_URL", config.database_url)
        _check_url("NEURALGRID_SESSION_DATABASE_URL", config.session_database_url)
        return config


def _check_url(name: str, url: str | None) -> None:
    """A URL libpq cannot parse fails here in one line, before any command's traceback does."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    if not url:
        return
    try:
        conninfo_to_dict(url)
    except ProgrammingError as err:
        detail = str(err).strip().splitlines()[0]
        reason = "" if url in detail else f" ({detail})"  # never echo the URL: it may hold a password
        raise fail(
            f"{name} is not a Postgres URL{reason}: set it to"
            " postgresql://USER:PASSWORD@HOST:PORT/DBNAME, or unset it for the embedded database"
        ) from err


def settings(ctx: typer.Context) -> Settings:
    options: Options = ctx.obj  # set by the main callback, inherited by every group
    return options.settings


def database_url(ctx: typer.Context, keep_running: bool = False) -> str:
    """The database's URL, the embedded one started and migrated when it is the one; a DATABASE_URL
    that lacks migrations is one line saying what to run. An embedded server this command started
    stops when the command ends (as `up` stops its own), unless `keep_running`."""
    from neuralgrid.db import connect

    config = settings(ctx)
    if not keep_running:
        stops_with(ctx, config)
    return connect.prepare(config, StartupProgress())


def stops_with(ctx: typer.Context, config: Settings) -> None:
    """The embedded server, when it is not running yet (this command starts it): stopped when the
    command ends, unless `up` serves on it by then."""
    from neuralgrid.db import connect

    server = None if config.database_url else connect.embedded_server(config)
    if server is not None and not server.is_running():
        ctx.call_on_close(lambda: stop_unless_serving(config, server))


def stop_unless_serving(config: Settings, server: EmbeddedPostgres) -> None:
    """Stop the embedded server a command started, unless `neuralgrid up` began serving on it since
    (it leaves a server it did not start running, and this one would stop under it)."""
    from neuralgrid.server import running

    if running.find(config) is None:
        server.stop()


@contextmanager
def database(ctx: typer.Context) -> Iterator[psycopg.Connection]:
    """The platform's database (the embedded one started and migrated if it is the one)."""
    import psycopg

    with psycopg.connect(database_url(ctx), autocommit=True) as conn:
        yield conn


def integers(text: str, option: str) -> list[int]:
    """A comma-separated list of positive integers, or a one-line error naming the option."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError as err:
        raise fail(f"{option} takes comma-separated integers ({err})") from err
    if min(values) < 1:
        raise fail(f"{option}: every value must be positive")
    return values


def log_to_stderr() -> None:
    """Log lines for the long-running commands (up, node run); a line per HTTP request is noise."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def piped() -> bool:
    """Whether stdout is a pipe or a log, with no COLUMNS to say how wide (Rich then assumes 80)."""
    return not out.is_terminal and "COLUMNS" not in os.environ


def print_table(table: Table, *, narrow: bool = False) -> None:
    """A table on the console, no cell ever cut (Rich cuts cells to fit its width: every number
    `0…`). On a terminal it fits the terminal's width if it can, its long cells wrapped, else it is
    as wide as its cells, a row a line. Piped or in a log (unless COLUMNS says how wide), a narrow
    view fits 80 columns likewise, and any other table is as wide as its cells."""
    width = fit_table(table, 80 if narrow else None) if piped() else fit_table(table, out.width)
    (out if width <= out.width else Console(width=width)).print(table)


def fit_table(table: Table, width: int | None) -> int:
    """Fixes the widths of the table's wrapping columns so that it is at most `width` columns wide
    if it can be without cutting a word, else leaves it as wide as its cells (so does None); returns
    the width it takes. Rich's own squeeze ignores a column's longest word, and cuts no_wrap ones."""
    console = Console(width=_UNLIMITED)
    spans = [_content_span(console, column) for column in table.columns]
    natural = console.measure(table).maximum
    if width is None or natural <= width:
        return natural
    overhead = natural - sum(most for _, most in spans)  # padding and edges

    def taken(cap: int) -> list[int]:
        """Each column's width when no wrapping column is wider than `cap` (but its longest word)."""
        columns = zip(table.columns, spans, strict=True)
        return [most if c.no_wrap else min(most, max(least, cap)) for c, (least, most) in columns]

    if overhead + sum(taken(0)) > width:
        return natural  # too wide whatever wraps: a row a line reads better (and `less -S` scrolls)
    low, high = 0, max(most for _, most in spans)
    while low < high:  # the widest cap that fits
        cap = (low + high + 1) // 2
        low, high = (cap, high) if overhead + sum(taken(cap)) <= width else (low, cap - 1)
    widths = taken(low)
    for column, content in zip(table.columns, widths, strict=True):
        if not column.no_wrap:
            column.width = content
    return overhead + sum(widths)


_UNLIMITED = 100_000


def _content_span(console: Console, column: RichColumn) -> tuple[int, int]:
    """The column's content width at least (its longest word; all of it if it never wraps) and at
    most (its longest cell), header included, padding not."""
    spans = [Measurement.get(console, console.options, cell) for cell in (column.header, *column.cells)]
    high = max(span.maximum for span in spans)
    return (high if column.no_wrap else max(span.minimum for span in spans)), high


def report(table: Table, path: Path, name: str, results: list[dict[str, Any]], **meta: Any) -> None:
    """A benchmark's end: its table on the console (whole headers in a log too) and its JSON."""
    from neuralgrid.bench import write_report

    print_table(table)
    write_report(path, name, results, **meta)
    out.print(f"wrote {path}")
