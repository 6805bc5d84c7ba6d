"""The Data API (supabase/migrations/20261129000100_data_api.sql) on a Supabase-shaped database, read
and called the way PostgREST runs a request: in a transaction, `set local role anon|authenticated`
and `request.jwt.claims` set for it, then `select * from <view>` or the RPC's `select * from fn(…)`.

Each role is shown both what it may do and what it may not: anon reads the map and its totals only;
a signed-in user reads and changes their own keys, usage and nodes, never another user's."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from neuralgrid.db import queries as q
from tests.conftest import LLAMA8, make_key, make_node, make_user

MY_API_KEYS_COLUMNS = [
    "id", "name", "prefix", "rpm_limit", "tpm_limit", "budget_usd", "spent_usd", "reserved_usd",
    "created_at", "last_used_at", "revoked_at", "active",
]  # fmt: skip
RECORDED = Path(__file__).resolve().parents[1] / "data" / "supabase_recorded.json"
MY_USAGE_COLUMNS = [
    "day", "api_key_id", "key_name", "key_prefix", "model_id", "requests", "succeeded", "failed",
    "prompt_tokens", "completion_tokens", "cost_usd",
]  # fmt: skip


@contextmanager
def as_postgrest(conn: psycopg.Connection, role: str, user: uuid.UUID | None = None) -> Iterator[Any]:
    """One request as PostgREST runs it: claims and role local to a transaction, rolled back after
    (so that what a test writes through it is checked inside, and each request starts clean)."""
    claims = {"role": role, **({"sub": str(user)} if user else {})}
    with conn.transaction(force_rollback=True), conn.cursor(row_factory=dict_row) as cur:
        cur.execute("select set_config('request.jwt.claims', %s, true)", (json.dumps(claims),))
        cur.execute(sql.SQL("set local role {}").format(sql.Identifier(role)))
        yield cur


def refused(cur: Any, query: str, params: tuple[object, ...] = ()) -> str:
    """The SQLSTATE a statement is refused with (it must be), inside a savepoint so the request's
    transaction goes on, as PostgREST's next request would."""
    with pytest.raises(psycopg.Error) as caught, cur.connection.transaction():
        cur.execute(query, params)
    return str(caught.value.sqlstate)


@pytest.fixture
def world(conn: psycopg.Connection) -> dict[str, uuid.UUID]:
    """Alice owns a node, two keys and two finished jobs; Bob owns a node, a key and a job; one more
    node belongs to the platform."""
    alice, bob = make_user(conn, "alice@example.test"), make_user(conn, "bob@example.test")
    alice_node = make_node(conn, "alice-node", owner_id=alice, endpoint_url="https://alice.example.test/")
    bob_node = make_node(conn, "bob-node", owner_id=bob, endpoint_url="tunnel:bob")
    make_node(conn, "platform-node")
    alice_key, alice_spare, bob_key = make_key(conn, alice), make_key(conn, alice), make_key(conn, bob)
    for key, completion in ((alice_key, 90), (alice_key, 10), (bob_key, 5)):
        row = conn.execute("select job_id from match_job(%s, %s)", (LLAMA8, key)).fetchone()
        assert row is not None
        conn.execute("select complete_job(%s, 'succeeded', 1000, %s)", (row[0], completion))
    return {
        "alice": alice,
        "bob": bob,
        "alice_node": alice_node,
        "bob_node": bob_node,
        "alice_key": alice_key,
        "alice_spare": alice_spare,
        "bob_key": bob_key,
    }


def columns(cur: Any) -> list[str]:
    return [c.name for c in cur.description]


# What anon may read -------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["anon", "authenticated"])
def test_everyone_reads_the_map_and_its_totals(
    conn: psycopg.Connection, world: dict[str, uuid.UUID], role: str
) -> None:
    user = world["alice"] if role == "authenticated" else None
    conn.execute("select public.sweep()")  # the sweep counts every user's jobs (every 5 s)
    with as_postgrest(conn, role, user) as cur:
        nodes = cur.execute("select * from public.node_map order by name").fetchall()
        assert [n["name"] for n in nodes] == ["alice-node", "bob-node", "platform-node"]
        assert "endpoint_url" not in nodes[0] and "owner_id" not in nodes[0]
        assert nodes[0]["warm_models"] == [LLAMA8]
        (stats,) = cur.execute("select * from public.fleet_stats()").fetchall()
    # Every user's jobs count in the totals, though neither role may read one of them.
    assert stats["online_nodes"] == 3 and stats["jobs_last_minute"] == 3
    assert stats["online_vram_gb"] == 72 and stats["online_tflops"] == 495
    assert stats["cheapest"] == [{"gpu_model": "NVIDIA GeForce RTX 4090", "hourly_rate": 0.35}]


def test_the_map_totals_are_the_gateways_own(conn: psycopg.Connection, world: dict[str, uuid.UUID]) -> None:
    """fleet_stats() answers what /api/stats does (the gateway's FLEET_STATS query, run as the service)."""
    conn.execute("update jobs set latency_ms = 100 * completion_tokens, finished_at = now()")
    conn.execute("select public.sweep()")
    with conn.cursor(row_factory=dict_row) as cur:
        gateway = cur.execute(q.FLEET_STATS.sql).fetchone()
    with as_postgrest(conn, "anon") as cur:
        data_api = cur.execute("select * from public.fleet_stats()").fetchone()
    assert data_api == gateway
    assert data_api is not None and data_api["p50_latency_ms"] == 1000


def test_anon_is_refused_everything_that_belongs_to_a_user(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    with as_postgrest(conn, "anon") as cur:
        for query in (
            "select * from public.my_api_keys",
            "select * from public.my_usage",
            "select * from public.my_nodes()",
            "select * from public.my_earnings(null)",
            "select * from public.create_api_key('mine')",
        ):
            assert refused(cur, query) == "42501", query
        assert refused(cur, "select public.revoke_api_key(%s)", (world["alice_key"],)) == "42501"
    assert conn.execute("select count(*) from api_keys where revoked_at is null").fetchone() == (3,)


@pytest.mark.parametrize("role", ["anon", "authenticated"])
def test_every_view_an_api_role_may_read_answers_select_star(conn: psycopg.Connection, role: str) -> None:
    """The issue's trap: a view granted to a role whose columns are not all readable by it fails on
    `select *` with 42501, and nothing in `supabase gen types` shows it. The tables with private
    columns fail so on purpose; the views are the shapes to read instead."""
    user = make_user(conn)
    views = [
        name
        for (name,) in conn.execute(
            "select c.relname from pg_class c where c.relnamespace = 'public'::regnamespace"
            " and c.relkind = 'v' and has_table_privilege(%s, c.oid, 'select') order by 1",
            (role,),
        ).fetchall()
    ]
    expected = ["node_map"] + (["my_api_keys", "my_usage"] if role == "authenticated" else [])
    assert views == sorted(expected)
    with as_postgrest(conn, role, user if role == "authenticated" else None) as cur:
        for view in views:
            cur.execute(sql.SQL("select * from public.{}").format(sql.Identifier(view)))
        assert refused(cur, "select * from public.nodes") == "42501"
        if role == "authenticated":
            assert refused(cur, "select * from public.api_keys") == "42501"


# What a signed-in user reads: their own rows ----------------------------------------------------------


def test_each_user_reads_their_own_keys_and_never_a_secret(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    with as_postgrest(conn, "authenticated", world["alice"]) as cur:
        keys = cur.execute("select * from public.my_api_keys order by created_at").fetchall()
        assert columns(cur) == MY_API_KEYS_COLUMNS
    assert {k["id"] for k in keys} == {world["alice_key"], world["alice_spare"]}
    assert all(k["active"] and k["prefix"].startswith("ng-") for k in keys)
    with as_postgrest(conn, "authenticated", world["bob"]) as cur:
        assert [k["id"] for k in cur.execute("select * from public.my_api_keys").fetchall()] == [
            world["bob_key"]
        ]
        assert cur.execute(
            "select count(*) as n from public.my_api_keys where id = %s", (world["alice_key"],)
        ).fetchone() == {"n": 0}
    # Signed in without a user (a token with no sub): nothing is anyone's.
    with as_postgrest(conn, "authenticated") as cur:
        assert cur.execute("select * from public.my_api_keys").fetchall() == []


def test_each_user_reads_their_own_usage_per_day_key_and_model(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    with as_postgrest(conn, "authenticated", world["alice"]) as cur:
        usage = cur.execute("select * from public.my_usage where day >= current_date - 1").fetchall()
        assert columns(cur) == MY_USAGE_COLUMNS
    assert len(usage) == 1
    row = usage[0]
    assert (row["api_key_id"], row["model_id"], row["key_name"]) == (world["alice_key"], LLAMA8, "test")
    assert (row["requests"], row["succeeded"], row["failed"]) == (2, 2, 0)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (2000, 100)
    charged = conn.execute("select spent_usd from api_keys where id = %s", (world["alice_key"],)).fetchone()
    assert charged is not None and row["cost_usd"] == charged[0] > Decimal(0)
    with as_postgrest(conn, "authenticated", world["bob"]) as cur:
        assert [(u["api_key_id"], u["requests"]) for u in cur.execute("select * from public.my_usage")] == [
            (world["bob_key"], 1)
        ]


def test_each_owner_reads_their_own_nodes_with_the_endpoint(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    with as_postgrest(conn, "authenticated", world["alice"]) as cur:
        nodes = cur.execute("select * from public.my_nodes()").fetchall()
        # Through the table, the endpoint stays the service's: the function is the owner's one way.
        assert refused(
            cur, "select endpoint_url from public.nodes where id = %s", (world["alice_node"],)
        ) == ("42501")
    assert [(n["id"], n["endpoint_url"], n["status"]) for n in nodes] == [
        (world["alice_node"], "https://alice.example.test/", "online")
    ]
    assert nodes[0]["warm_models"] == [LLAMA8] and nodes[0]["available_models"] == []
    assert nodes[0]["routes"] and nodes[0]["backend_up"] is True and nodes[0]["tunnel_connected"] is False
    with as_postgrest(conn, "authenticated", world["bob"]) as cur:
        assert [n["endpoint_url"] for n in cur.execute("select * from public.my_nodes()")] == ["tunnel:bob"]
    with as_postgrest(conn, "service_role") as cur:  # no user: no one's nodes, not everyone's
        assert cur.execute("select * from public.my_nodes()").fetchall() == []


# What a signed-in user changes: their own keys ---------------------------------------------------------


def test_a_user_creates_a_key_and_sees_it_listed(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    with as_postgrest(conn, "authenticated", world["bob"]) as cur:
        created = cur.execute("select * from public.create_api_key('ci', 60, null, 5)").fetchone()
        assert created is not None and created["api_key"].startswith(created["prefix"])
        listed = cur.execute("select * from public.my_api_keys where id = %s", (created["id"],)).fetchone()
        assert listed is not None
        assert (listed["name"], listed["rpm_limit"], listed["budget_usd"]) == ("ci", 60, Decimal(5))
    # A token that names no user may not create one.
    with as_postgrest(conn, "authenticated") as cur:
        assert refused(cur, "select * from public.create_api_key('nobody''s')") == "42501"


@pytest.mark.parametrize(
    ("args", "sqlstate"),
    [
        (("", None, None, None), "23514"),  # "key name must be 1 to 100 characters"
        (("x" * 101, None, None, None), "23514"),
        (("ok", 0, None, None), "23514"),  # "rpm_limit must be positive"
        (("ok", None, -5, None), "23514"),
        (("ok", None, None, -1), "23514"),  # "budget_usd must not be negative"
        ((None, None, None, None), "23502"),  # no name
    ],
)
def test_bad_key_input_is_a_constraint_error_that_changes_nothing(
    conn: psycopg.Connection, world: dict[str, uuid.UUID], args: tuple[Any, ...], sqlstate: str
) -> None:
    with as_postgrest(conn, "authenticated", world["alice"]) as cur:
        assert refused(cur, "select * from public.create_api_key(%s, %s, %s, %s)", args) == sqlstate
        assert cur.execute("select count(*) as n from public.my_api_keys").fetchone() == {"n": 2}


def test_a_user_revokes_their_own_key_and_no_one_elses(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    conn.execute("listen neuralgrid_api_keys")
    with as_postgrest(conn, "authenticated", world["alice"]) as cur:
        (first,) = cur.execute("select public.revoke_api_key(%s) as at", (world["alice_key"],)).fetchall()
        listed = cur.execute(
            "select active, revoked_at from public.my_api_keys where id = %s", (world["alice_key"],)
        ).fetchone()
        assert listed == {"active": False, "revoked_at": first["at"]}
        # Twice is once: the time of the first revocation stays.
        again = cur.execute("select public.revoke_api_key(%s) as at", (world["alice_key"],)).fetchone()
        assert again == first
        # Bob's key, and a key that does not exist, are alike "not among yours" (HTTP 404).
        assert refused(cur, "select public.revoke_api_key(%s)", (world["bob_key"],)) == "PT404"
        assert refused(cur, "select public.revoke_api_key(%s)", (uuid.uuid4(),)) == "PT404"
        assert refused(cur, "select public.revoke_api_key(%s)", ("not-a-uuid",)) == "22P02"
    # That request was rolled back. Committed, a revocation tells every gateway (the trigger that
    # announces it runs for the user too) and changes that one key alone.
    with conn.transaction():
        conn.execute(
            "select set_config('request.jwt.claims', %s, true)",
            (json.dumps({"role": "authenticated", "sub": str(world["alice"])}),),
        )
        conn.execute("set local role authenticated")
        conn.execute("select public.revoke_api_key(%s)", (world["alice_key"],))
    heard = [n.payload for n in conn.notifies(timeout=2, stop_after=1)]
    assert heard == [str(world["alice_key"])]
    rows = conn.execute("select id, revoked_at is not null from api_keys").fetchall()
    assert dict(rows) == {world["alice_key"]: True, world["alice_spare"]: False, world["bob_key"]: False}


# The CLI's recorded answers (tests/cli/test_hosted.py) are what this database answers ---------------


@pytest.mark.parametrize(
    ("exchange", "query"),
    [
        ("rest.my_api_keys", "select * from public.my_api_keys"),
        ("rest.my_usage", "select * from public.my_usage"),
        ("rest.rpc.my_nodes", "select * from public.my_nodes()"),
        ("rest.rpc.create_api_key", "select * from public.create_api_key('recorded')"),
        ("rest.rpc.my_earnings", "select * from public.my_earnings(null)"),
        ("rest.rpc.my_earnings_totals", "select * from public.my_earnings_totals(null)"),
        ("rest.rpc.my_node_stats", "select * from public.my_node_stats()"),
        ("rest.rpc.my_model_checks", "select * from public.my_model_checks()"),
        ("rest.platform_settings", "select platform_fee_rate from public.platform_settings"),
    ],
)
def test_the_recorded_rows_have_the_columns_the_database_answers(
    conn: psycopg.Connection, exchange: str, query: str
) -> None:
    body = json.loads(RECORDED.read_text())["exchanges"][exchange]["response"]["body"]
    user = make_user(conn)
    with as_postgrest(conn, "authenticated", user) as cur:
        cur.execute(query)
        assert list(body[0]) == columns(cur)
