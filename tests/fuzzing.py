"""Fuzz helpers: what the server logged while an example ran, as one failure class per exception
kind (Hypothesis tells bugs apart by exception type and place)."""

from __future__ import annotations

import logging
from typing import cast


class ServerError(AssertionError):
    """The server logged an error (an exception in the app, most often) during an example."""


_server_errors: dict[str, type[ServerError]] = {}


def server_error(record: logging.LogRecord) -> ServerError:
    """`Server<ExceptionName>`: one class per kind of server exception, so that Hypothesis, which
    tells bugs apart by exception type and place, reports each kind of crash on its own."""
    name = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else "LoggedError"
    if name not in _server_errors:
        _server_errors[name] = cast(type[ServerError], type(f"Server{name}", (ServerError,), {}))
    cls = _server_errors[name]
    detail = logging.Formatter().format(record)
    return cls(f"the server logged an error:\n{detail[-3000:]}")


class Collect(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
