"""The rules on a node's and a key's description are checked when those columns are written, and
only then; the rules on what the request path writes stay CHECK constraints.

Postgres prepares each CHECK constraint of a table again for every statement that writes it,
whichever columns the statement sets. Measured before the change (one request's SQL, place_job()
and complete_jobs() committed, on a scratch database): 1.76 ms, of which the 23 rules on `nodes`
and the four WHEN clauses of its triggers took 0.25 ms, paid by every claim and release though
neither writes a node's specs, address or name. Now a trigger checks those rules, on the writes
that set them, and raises what the constraint raised.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from tests.conftest import NODE_DEFAULTS, make_key, make_node

# What claims, releases and budget holds write: the rules on these are CHECK constraints.
REQUEST_PATH_WRITES = {
    "nodes": {"inflight", "status", "successes", "failures", "consecutive_failures", "speed_ratio",
              "cooldown_until", "ewma_latency_ms", "ewma_tokens_per_s"},
    "api_keys": {"reserved_usd", "spent_usd", "last_used_at"},
}  # fmt: skip

NODE_RULES = [
    ("backend", Jsonb({"kind": "x" * 5000}), "backend must be a JSON object of at most 4 kB"),
    ("backend", Jsonb([1, 2]), "backend must be a JSON object of at most 4 kB"),
    ("endpoint_url", "ftp://x", "endpoint_url must be http(s):// or tunnel:"),
    ("free_vram_gb", -1, "free_vram_gb must be a number, not negative"),
    ("free_vram_gb", float("nan"), "free_vram_gb must be a number, not negative"),
    ("gpu_count", 65, "gpu_count must be between 1 and 64"),
    ("gpu_model", "  ", "gpu_model must be 1 to 100 characters"),
    ("gpu_model", "A" * 101, "gpu_model must be 1 to 100 characters"),
    ("gpu_utilization", 1.5, "gpu_utilization must be between 0 and 1"),
    ("hourly_rate", -0.01, "hourly_rate must be between 0 and 10000"),
    # NaN is not below 0 in Postgres: a NaN price outranked every node and made every charge NaN.
    ("hourly_rate", float("nan"), "hourly_rate must be between 0 and 10000"),
    ("hourly_rate", 10_000.01, "hourly_rate must be between 0 and 10000"),
    ("latitude", None, "latitude and longitude go together"),
    ("latitude", 91, "latitude must be between -90 and 90"),
    ("longitude", -181, "longitude must be between -180 and 180"),
    ("max_concurrency", 1025, "max_concurrency must be between 1 and 1024"),
    ("name", "x" * 101, "node name must be 1 to 100 characters"),
    ("queue_depth", -1, "queue_depth must not be negative"),
    ("region", "", "region must be 1 to 64 characters"),
    ("region", "r" * 65, "region must be 1 to 64 characters"),
    ("routes", ["chat/completions", "bogus"], "routes must be known route names, at least one"),
    ("routes", [], "routes must be known route names, at least one"),
    ("secret_hash", b"short", "secret_hash must be a SHA-256 digest"),
    ("tflops", 0, "tflops must be positive and at most 100000"),
    ("vram_gb", 9000, "vram_gb must be positive and at most 8192"),
]

KEY_RULES = [
    ("budget_usd", -1, "budget_usd must not be negative"),
    ("name", " ", "key name must be 1 to 100 characters"),
    ("key_hash", b"short", "key_hash must be a SHA-256 digest"),
    ("rpm_limit", 0, "rpm_limit must be positive"),
    ("tpm_limit", -5, "tpm_limit must be positive"),
]


def _update(conn: psycopg.Connection, table: str, row_id: uuid.UUID, column: str, value: Any) -> None:
    query = sql.SQL("update public.{} set {} = %s where id = %s").format(
        sql.Identifier(table), sql.Identifier(column)
    )
    conn.execute(query, (value, row_id))


def _refused(err: psycopg.errors.CheckViolation, table: str, rule: str) -> None:
    """What Postgres says for a CHECK constraint: the same SQLSTATE, name and message."""
    assert err.sqlstate == "23514"
    assert err.diag.constraint_name == rule
    assert err.diag.table_name == table and err.diag.schema_name == "public"
    assert err.diag.message_primary == f'new row for relation "{table}" violates check constraint "{rule}"'


@pytest.mark.parametrize(
    ("column", "value", "rule"), NODE_RULES, ids=[r[2] + f" ({r[0]})" for r in NODE_RULES]
)
def test_a_node_rule_refuses_a_bad_value_on_update(
    conn: psycopg.Connection, column: str, value: Any, rule: str
) -> None:
    node = make_node(conn)
    with pytest.raises(psycopg.errors.CheckViolation) as refused, conn.transaction():
        _update(conn, "nodes", node, column, value)
    _refused(refused.value, "nodes", rule)


@pytest.mark.parametrize(
    ("column", "value", "rule"), NODE_RULES, ids=[r[2] + f" ({r[0]})" for r in NODE_RULES]
)
def test_a_node_rule_refuses_a_bad_value_on_insert(
    conn: psycopg.Connection, column: str, value: Any, rule: str
) -> None:
    fields = {column: value} if column != "name" else {}
    with pytest.raises(psycopg.errors.CheckViolation) as refused, conn.transaction():
        make_node(conn, value if column == "name" else None, **fields)
    _refused(refused.value, "nodes", rule)


def test_outside_load_written_directly_is_checked(conn: psycopg.Connection) -> None:
    """Derived from queue_depth on every write (never negative then), but a column all the same."""
    node = make_node(conn)
    with pytest.raises(psycopg.errors.CheckViolation) as refused, conn.transaction():
        _update(conn, "nodes", node, "outside_load", -1)
    _refused(refused.value, "nodes", "outside_load must not be negative")


@pytest.mark.parametrize(("column", "value", "rule"), KEY_RULES, ids=[r[2] for r in KEY_RULES])
def test_a_key_rule_refuses_a_bad_value_on_update(
    conn: psycopg.Connection, column: str, value: Any, rule: str
) -> None:
    key = make_key(conn, budget_usd=5)
    with pytest.raises(psycopg.errors.CheckViolation) as refused, conn.transaction():
        _update(conn, "api_keys", key, column, value)
    _refused(refused.value, "api_keys", rule)


@pytest.mark.parametrize(("column", "value", "rule"), KEY_RULES, ids=[r[2] for r in KEY_RULES])
def test_a_key_rule_refuses_a_bad_value_on_insert(
    conn: psycopg.Connection, column: str, value: Any, rule: str
) -> None:
    fields = {"name": "k", "prefix": "ng-rules", "key_hash": bytes(32), "rpm_limit": 60, "tpm_limit": None,
              "budget_usd": 5, column: value}  # fmt: skip
    query = sql.SQL("insert into public.api_keys ({}) values ({})").format(
        sql.SQL(", ").join(map(sql.Identifier, fields)), sql.SQL(", ").join(map(sql.Placeholder, fields))
    )
    with pytest.raises(psycopg.errors.CheckViolation) as refused, conn.transaction():
        conn.execute(query, fields)
    _refused(refused.value, "api_keys", rule)


def test_the_rules_on_the_request_paths_writes_are_still_constraints(conn: psycopg.Connection) -> None:
    node = make_node(conn, max_concurrency=2)
    key = make_key(conn, budget_usd=5)
    for table, row, column, value in (
        ("nodes", node, "inflight", -1),
        ("nodes", node, "status", "asleep"),
        ("nodes", node, "successes", -1),
        ("nodes", node, "speed_ratio", -0.5),
        ("api_keys", key, "reserved_usd", -1),
        ("api_keys", key, "spent_usd", -1),
    ):
        with pytest.raises(psycopg.errors.CheckViolation) as refused, conn.transaction():
            _update(conn, table, row, column, value)
        constraint = conn.execute(
            "select contype from pg_constraint where conrelid = %s::regclass and conname = %s",
            (f"public.{table}", refused.value.diag.constraint_name),
        ).fetchone()
        assert constraint == ("c",), (column, refused.value.diag.constraint_name)


@pytest.mark.parametrize("table", sorted(REQUEST_PATH_WRITES))
def test_every_check_constraint_is_about_what_the_request_path_writes(
    conn: psycopg.Connection, table: str
) -> None:
    """A CHECK constraint on these tables is prepared for every claim and release; a rule about a
    column they do not write belongs in the table's description trigger (*_check_description)."""
    rows = conn.execute(
        """select c.conname, array_agg(a.attname::text)
           from pg_constraint c
           join pg_attribute a on a.attrelid = c.conrelid and a.attnum = any (c.conkey)
           where c.conrelid = %s::regclass and c.contype = 'c'
           group by c.conname""",
        (f"public.{table}",),
    ).fetchall()
    assert rows
    elsewhere = sorted(name for name, columns in rows if not set(columns) & REQUEST_PATH_WRITES[table])
    assert elsewhere == []


def test_a_node_described_well_still_registers(conn: psycopg.Connection) -> None:
    """The trigger passes what the constraints passed: no location at all, no secret."""
    node = make_node(conn, latitude=None, longitude=None, secret_hash=None, routes=["embeddings"])
    row = conn.execute("select vram_gb, routes from nodes where id = %s", (node,)).fetchone()
    assert row == (NODE_DEFAULTS["vram_gb"], ["embeddings"])
