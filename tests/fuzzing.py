"""Fuzz helpers: what the server logged while an example ran, as one failure class per exception
kind (Hypothesis tells bugs apart by exception type and place)."""

from __future__ import annotations

import logging
import os
from typing import cast

from hypothesis import HealthCheck, Phase, settings

# Examples per test: 40 in the suite (its time is a limit: tests/conftest.py), each run on a seed of
# its own, so CI's runs add up to what no one run covers; a deep run sets more.
EXAMPLES = int(os.environ.get("NEURALGRID_FUZZ_EXAMPLES", "40"))
# For fuzzing a live server (the tunnel, Realtime): every example costs real requests, so no
# explain phase (a failure already says what was sent, with note(), and what the server logged).
LIVE_SERVER = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)


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
