"""The architecture's seams, held: SQL only through the store (or Realtime's own), errors mapped once."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from neuralgrid.db import errors as db
from neuralgrid.db import queries
from neuralgrid.gateway import errors
from neuralgrid.realtime import sql as realtime_sql

PACKAGE = Path(__file__).resolve().parents[2] / "neuralgrid"
# The parts that run the platform's statements only through db/store.py. The migration runner, the
# Realtime server's feed and the benchmarks' scratch databases speak to Postgres about Postgres.
THROUGH_THE_STORE = ("gateway", "web", "server", "admin", "dev", "cli", "agent")
# The Realtime server speaks to Postgres only through its own seam (its docstring says why).
REALTIME_SEAM = PACKAGE / "realtime" / "sql.py"
# Running a statement, opening a connection for one, or composing one; and a statement's text.
TALKS_TO_POSTGRES = re.compile(
    r"\.(execute|executemany|cursor|connection)\(|Connection\.connect\(|from psycopg import sql|\bsql\.SQL\("
)
STATEMENT = re.compile(
    r"^\s*(select|insert\s+into|update\s+\S+\s+set|delete\s+from|listen|notify)\s", re.IGNORECASE
)


@pytest.mark.parametrize(("seam", "at_least"), [(queries, 30), (realtime_sql, 10)], ids=["db", "realtime"])
def test_every_named_statement_has_its_own_name(seam: ModuleType, at_least: int) -> None:
    named = {k: v for k, v in vars(seam).items() if isinstance(v, queries.Query)}
    assert len(named) > at_least
    for constant, query in named.items():
        assert query.name == constant.lower(), constant


def test_every_domain_statement_is_read_from_the_package() -> None:
    """Callers read `q.NAME` from db/queries/: a statement left out of its domain module's __all__
    would be there only for whoever imports the module itself."""
    for info in pkgutil.iter_modules(queries.__path__):
        domain = importlib.import_module(f"{queries.__name__}.{info.name}")
        for constant, value in vars(domain).items():
            if isinstance(value, queries.Query):
                assert getattr(queries, constant, None) is value, f"{info.name}.{constant}"


@pytest.mark.parametrize("part", THROUGH_THE_STORE)
def test_no_sql_outside_the_store(part: str) -> None:
    offenders = []
    for path in (PACKAGE / part).rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            # The request pool's session setting is the one statement the assembly runs itself.
            if re.search(r"\.execute\(", line) and "synchronous_commit" not in line:
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}")
    assert offenders == []


def test_realtime_speaks_sql_only_through_its_seam() -> None:
    offenders = []
    for path in sorted((PACKAGE / "realtime").rglob("*.py")):
        if path == REALTIME_SEAM:
            continue
        source = path.read_text()
        where = path.relative_to(PACKAGE)
        for number, line in enumerate(source.splitlines(), 1):
            if TALKS_TO_POSTGRES.search(line):
                offenders.append(f"{where}:{number}: {line.strip()}")
        for number, text in _strings_but_docstrings(ast.parse(source)):
            if STATEMENT.match(text):
                offenders.append(f"{where}:{number}: {text.strip()[:40]!r}")
    assert offenders == []


def _strings_but_docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    """The string literals of a module, docstrings left out (one may well begin "LISTEN until...")."""
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, documented) and node.body and isinstance(node.body[0], ast.Expr)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def _pg_error(sqlstate: str, message: str) -> Exception:
    err = Exception(message)
    err.sqlstate = sqlstate  # type: ignore[attr-defined]
    err.diag = SimpleNamespace(message_primary=message)  # type: ignore[attr-defined]
    return err


@pytest.mark.parametrize(
    ("sqlstate", "domain", "status"),
    [
        ("P0002", db.NotFound, 404),
        ("42501", db.Forbidden, 403),
        ("NG402", db.BudgetExhausted, 429),
        ("22023", db.InvalidRequest, 400),
        ("23505", db.ConflictError, 400),
    ],
)
def test_postgres_errors_are_translated_once_and_mapped_once(
    sqlstate: str, domain: type[db.DatabaseError], status: int
) -> None:
    translated = db.translate(_pg_error(sqlstate, "what happened"), "model")
    assert type(translated) is domain and str(translated) == "what happened"
    assert isinstance(translated, db.DatabaseError)
    answer = errors.from_database(translated)
    assert answer.status == status
    assert answer.param == ("model" if domain is db.NotFound else None)


def test_an_unknown_sqlstate_stays_what_it_was() -> None:
    err = _pg_error("XX000", "internal")
    assert db.translate(err) is err


def test_no_route_hands_work_to_a_thread() -> None:
    """FastAPI runs a plain `def` endpoint or dependency in its thread pool, a handoff per request
    (measured: get_services, sync, sent every API request through a worker thread). Every route of
    the running app, websockets included, and every dependency it takes are coroutines."""
    import inspect

    from fastapi.dependencies.models import Dependant
    from fastapi.routing import APIRoute, APIWebSocketRoute

    from neuralgrid.server.app import create_app
    from neuralgrid.server.settings import Settings

    app = create_app(Settings(), "postgresql://unused@127.0.0.1:1/none", sweep=False)

    def runs_on_the_loop(call: object) -> bool:
        # A function, or an object whose __call__ is one (as FastAPI itself tells them apart).
        return any(
            inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f)
            for f in (call, getattr(call, "__call__", None))  # noqa: B004 - the method, not callable()
        )

    def sync_calls(dependant: Dependant) -> list[str]:
        call = dependant.call
        found = [f"{call.__module__}.{call.__qualname__}"] if call and not runs_on_the_loop(call) else []
        return found + [name for sub in dependant.dependencies for name in sync_calls(sub)]

    def flat(routes: list[Any]) -> list[Any]:
        # An included router stands in the app's routes as one entry holding its own.
        return [
            r
            for route in routes
            for r in (flat(route.original_router.routes) if hasattr(route, "original_router") else [route])
        ]

    routes = [route for route in flat(app.routes) if isinstance(route, APIRoute | APIWebSocketRoute)]
    assert len(routes) > 30
    assert any(isinstance(route, APIWebSocketRoute) for route in routes)
    offenders = {f"{route.path}: {name}" for route in routes for name in sync_calls(route.dependant)}
    assert offenders == set()
