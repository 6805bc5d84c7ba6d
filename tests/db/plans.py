"""The plans Postgres runs, nested statements of functions included (auto_explain), for tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg


@contextmanager
def logged_plans(conn: psycopg.Connection) -> Iterator[list[str]]:
    """Every plan `conn` runs inside the block, each as auto_explain logs it (its query text first)."""
    conn.execute("load 'auto_explain'")
    conn.execute(
        "set auto_explain.log_min_duration = 0; set auto_explain.log_nested_statements = on;"
        " set auto_explain.log_level = notice"
    )
    plans: list[str] = []
    conn.add_notice_handler(lambda notice: plans.append(notice.message_primary or ""))
    yield plans
    conn.execute("set auto_explain.log_min_duration = -1")
    assert plans, "auto_explain logged no plan"
