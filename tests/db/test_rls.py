"""Row-level security, table by table, acting as each role exactly as PostgREST/Realtime do."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from tests.conftest import LLAMA8, make_node, make_user


@contextmanager
def acting_as(
    conn: psycopg.Connection, role: str, user_id: uuid.UUID | None = None
) -> Iterator[psycopg.Connection]:
    """`set local role` plus request.jwt.claims, inside a transaction rolled back afterwards."""
    claims = {"role": role, **({"sub": str(user_id)} if user_id else {})}
    with conn.transaction(force_rollback=True):
        conn.execute("select set_config('request.jwt.claims', %s, true)", (json.dumps(claims),))
        conn.execute(psycopg.sql.SQL("set local role {}").format(psycopg.sql.Identifier(role)))
        yield conn


def denied(conn: psycopg.Connection, query: str, params: tuple[object, ...] = ()) -> bool:
    """True if the statement is refused outright (no privilege, or a policy's WITH CHECK)."""
    try:
        with conn.transaction():
            conn.execute(query, params)
    except psycopg.errors.InsufficientPrivilege:
        return True
    return False


def count(conn: psycopg.Connection, query: str, params: tuple[object, ...] = ()) -> int:
    row = conn.execute(f"select count(*) from ({query}) q", params).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def world(conn: psycopg.Connection) -> dict[str, uuid.UUID]:
    """Alice owns a node, a key and a job; Bob owns a node; plus one platform (owner-less) node."""
    alice, bob = make_user(conn, "alice@example.test"), make_user(conn, "bob@example.test")
    alice_node = make_node(conn, "alice-node", owner_id=alice)
    bob_node = make_node(conn, "bob-node", owner_id=bob)
    make_node(conn, "platform-node")
    conn.execute(
        "select set_config('request.jwt.claims', %s, false)",
        (json.dumps({"role": "authenticated", "sub": str(alice)}),),
    )
    key = conn.execute("select id from create_api_key('alice key')").fetchone()
    conn.execute("select set_config('request.jwt.claims', '', false)")
    assert key is not None
    job = conn.execute("select job_id from match_job(%s, %s)", (LLAMA8, key[0])).fetchone()
    assert job is not None
    return {
        "alice": alice,
        "bob": bob,
        "alice_node": alice_node,
        "bob_node": bob_node,
        "alice_key": key[0],
        "alice_job": job[0],
    }


def test_anon_reads_only_the_public_map(conn: psycopg.Connection, world: dict[str, uuid.UUID]) -> None:
    with acting_as(conn, "anon") as c:
        assert count(c, "select * from node_map") == 3
        assert count(c, "select id, name, status, vram_gb, hourly_rate from nodes") == 3
        assert count(c, "select * from node_models") == 3
        assert count(c, "select * from models") > 0
        assert denied(c, "select endpoint_url from nodes")
        assert denied(c, "select owner_id from nodes")
        assert denied(c, "select * from api_keys")
        assert denied(c, "select * from jobs")
        assert denied(c, "select * from job_attempts")
        assert denied(c, "select * from auth.users")
        assert denied(c, "update nodes set name = 'x'")
        assert denied(c, "delete from nodes")
        assert denied(c, "insert into models (id, min_vram_gb) values ('x', 1)")
        assert denied(c, "select * from create_api_key('anon key')")
        assert denied(c, "select * from match_job(%s)", (LLAMA8,))
        assert denied(c, "select * from score_nodes(%s)", (LLAMA8,))


def test_node_map_exposes_no_secret(conn: psycopg.Connection, world: dict[str, uuid.UUID]) -> None:
    with acting_as(conn, "anon") as c:
        cur = c.execute("select * from node_map limit 1")
        columns = {d.name for d in cur.description or []}
    assert "endpoint_url" not in columns and "owner_id" not in columns
    assert {"name", "gpu_model", "status", "latitude", "warm_models"} <= columns


def test_owners_manage_only_their_own_nodes(conn: psycopg.Connection, world: dict[str, uuid.UUID]) -> None:
    alice = world["alice"]
    with acting_as(conn, "authenticated", alice) as c:
        assert count(c, "select id, name, owner_id from nodes") == 3  # the map: public columns
        assert c.execute("update nodes set hourly_rate = 0.3 where name = 'alice-node'").rowcount == 1
        assert c.execute("update nodes set hourly_rate = 0.01 where name = 'bob-node'").rowcount == 0
        assert c.execute("delete from nodes where name = 'bob-node'").rowcount == 0
        assert denied(c, "update nodes set successes = 1000 where name = 'alice-node'")
        assert denied(c, "update nodes set status = 'online', inflight = 0 where name = 'alice-node'")
        assert denied(c, "select endpoint_url from nodes")
        c.execute(
            "insert into nodes (name, gpu_model, vram_gb, tflops, hourly_rate, region)"
            " values ('alice-2', 'RTX 3090', 24, 71, 0.2, 'eu-west')"
        )
        row = c.execute("select owner_id from nodes where name = 'alice-2'").fetchone()
        assert row == (alice,)  # owner_id defaults to the caller
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute(
                "insert into nodes (owner_id, name, gpu_model, vram_gb, tflops, hourly_rate, region)"
                " values (%s, 'forged', 'g', 24, 71, 0.2, 'r')",
                (world["bob"],),
            )
    with acting_as(conn, "authenticated", alice) as c:
        c.execute("insert into node_models (node_id, model_id) values (%s, 'm1')", (world["alice_node"],))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute(
                "insert into node_models (node_id, model_id) values (%s, 'm1')",
                (world["bob_node"],),
            )
    with acting_as(conn, "authenticated", alice) as c:
        assert c.execute("delete from node_models where node_id = %s", (world["bob_node"],)).rowcount == 0
        assert c.execute("delete from nodes where name = 'alice-node'").rowcount == 1


def test_users_see_and_revoke_only_their_own_keys(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    with acting_as(conn, "authenticated", world["alice"]) as c:
        assert count(c, "select id, name, prefix from api_keys") == 1
        assert denied(c, "select key_hash from api_keys")
        assert denied(c, "update api_keys set spent_usd = 0")
        assert denied(c, "update api_keys set budget_usd = 1000000")
        assert c.execute("update api_keys set revoked_at = now()").rowcount == 1
        created = c.execute("select api_key, prefix from create_api_key('second')").fetchone()
        assert created is not None and created[0].startswith("ng-") and created[0].startswith(created[1])
        assert count(c, "select id from api_keys") == 2
    with acting_as(conn, "authenticated", world["bob"]) as c:
        assert count(c, "select id from api_keys") == 0
        assert c.execute("update api_keys set revoked_at = now()").rowcount == 0
    # A JWT without a user cannot create keys.
    with (
        acting_as(conn, "authenticated") as c,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match="signed-in user"),
    ):
        c.execute("select * from create_api_key('nobody')")


def test_keys_are_stored_only_as_hashes(conn: psycopg.Connection) -> None:
    row = conn.execute("select api_key from create_api_key('service key', 60, 1000, 5)").fetchone()
    assert row is not None
    key = row[0]
    assert len(key) == 3 + 64
    stored = conn.execute("select key_hash, prefix, rpm_limit, budget_usd from api_keys").fetchone()
    assert stored is not None
    assert key not in repr(stored) and bytes(stored[0]) != key.encode()
    by_hash = conn.execute(
        "select count(*) from api_keys where key_hash = sha256(convert_to(%s, 'UTF8'))", (key,)
    ).fetchone()
    assert by_hash == (1,)


def test_a_budget_the_ledger_would_round_makes_no_key(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    """budget_usd is numeric(12,4): 0.00001 became a budget of $0, for any caller of create_api_key()
    (a signed-in user through the Data API too). It is refused, naming the column."""
    before = count(conn, "select id from api_keys")
    for role, user in (("service_role", None), ("authenticated", world["alice"])):
        with (
            acting_as(conn, role, user) as c,
            pytest.raises(psycopg.errors.InvalidParameterValue, match="4 decimals") as refused,
        ):
            c.execute("select * from create_api_key('tiny', null, null, 0.00001)")
        assert refused.value.diag.column_name == "budget_usd"
    assert count(conn, "select id from api_keys") == before
    made = conn.execute("select id from create_api_key('cents', null, null, 12.3456)").fetchone()
    assert made is not None
    budget = conn.execute("select budget_usd from api_keys where id = %s", made).fetchone()
    assert budget is not None and str(budget[0]) == "12.3456"


def test_a_budget_that_is_not_a_number_makes_no_key(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    """A billing review's case: 'NaN' passed `>= 0` and the decimals check, and the key's chats then
    failed with "cannot convert NaN to bigint" while its embeddings ran with no limit."""
    before = count(conn, "select id from api_keys")
    with (
        acting_as(conn, "authenticated", world["alice"]) as c,
        pytest.raises(psycopg.errors.CheckViolation, match="budget_usd must be a number"),
    ):
        c.execute("select * from create_api_key('nan', null, null, 'NaN')")
    assert count(conn, "select id from api_keys") == before


def test_a_revoked_key_stays_revoked(conn: psycopg.Connection, world: dict[str, uuid.UUID]) -> None:
    """A security review's case: the owner, as PostgREST runs a PATCH, set revoked_at back to null,
    and a key the platform had revoked worked again at the gateway."""
    made = conn.execute("select id from create_api_key('leaked')").fetchone()
    assert made is not None
    conn.execute(
        "update api_keys set owner_id = %s, revoked_at = now() where id = %s", (world["alice"], made[0])
    )
    for undo in ("revoked_at = null", "revoked_at = now() + interval '1 day'"):
        with (
            acting_as(conn, "authenticated", world["alice"]) as c,
            pytest.raises(psycopg.errors.CheckViolation, match="cannot be undone"),
        ):
            c.execute(f"update api_keys set {undo} where id = %s", made)
    with pytest.raises(psycopg.errors.CheckViolation):  # nor the service: a revocation is final
        conn.execute("update api_keys set revoked_at = null where id = %s", made)
    (revoked,) = conn.execute(
        "select revoked_at is not null from api_keys where id = %s", made
    ).fetchone() or (None,)
    assert revoked


def test_users_read_only_their_own_jobs(conn: psycopg.Connection, world: dict[str, uuid.UUID]) -> None:
    with acting_as(conn, "authenticated", world["alice"]) as c:
        assert count(c, "select * from jobs") == 1
        assert count(c, "select * from job_attempts") == 1
        assert denied(c, "update jobs set cost_usd = 0")
        assert denied(c, "delete from jobs")
        assert denied(c, "insert into job_attempts (job_id, attempt) values (%s, 9)", (world["alice_job"],))
        assert denied(c, "select * from match_job(%s)", (LLAMA8,))
        assert denied(c, "select * from complete_job(%s)", (world["alice_job"],))
        # Signed-in users rank through the Edge Function match, which acts as neuralgrid_matcher.
        assert denied(c, "select * from score_nodes(%s)", (LLAMA8,))
    with acting_as(conn, "neuralgrid_matcher", world["alice"]) as c:  # the role match ranks as
        assert count(c, "select * from score_nodes(%s)", (LLAMA8,)) == 3
        assert denied(c, "select id from nodes")
    with acting_as(conn, "authenticated", world["bob"]) as c:
        assert count(c, "select * from jobs") == 0
        assert count(c, "select * from job_attempts") == 0


def test_service_role_does_everything(conn: psycopg.Connection, world: dict[str, uuid.UUID]) -> None:
    with acting_as(conn, "service_role") as c:
        assert count(c, "select endpoint_url, owner_id from nodes") == 3
        assert count(c, "select key_hash from api_keys") == 1
        assert count(c, "select * from jobs") == 1
        assert count(c, "select * from job_attempts") == 1
        assert count(c, "select * from auth.users") == 2
        c.execute("update platform_settings set heartbeat_interval_s = 2")
        c.execute("update matching_policies set warm = 0.5 where name = 'balanced'")
        c.execute("insert into models (id, min_vram_gb) values ('new/model', 4)")
        match = c.execute("select node_id from match_job(%s)", (LLAMA8,)).fetchone()
        assert match is not None and match[0] is not None
        c.execute("select * from complete_job(%s)", (world["alice_job"],))
        c.execute("select * from sweep_stale_nodes()")
        c.execute("delete from nodes")


def test_catalog_and_settings_are_read_only_for_users(
    conn: psycopg.Connection, world: dict[str, uuid.UUID]
) -> None:
    with acting_as(conn, "authenticated", world["alice"]) as c:
        assert count(c, "select * from matching_policies") == 1
        assert count(c, "select * from platform_settings") == 1
        assert denied(c, "update matching_policies set price = 10")
        assert denied(c, "update platform_settings set heartbeat_interval_s = 1000")
        assert denied(c, "delete from models")


def test_derived_scores_are_the_services_alone(conn: psycopg.Connection, world: dict[str, uuid.UUID]) -> None:
    for role, user in (("anon", None), ("authenticated", world["alice"])):
        with acting_as(conn, role, user) as c:
            assert denied(c, "select * from node_scores")
            assert denied(c, "select * from node_base_scores")
            assert denied(c, "update node_scores set base_score = 1")
            assert denied(c, "select private.refresh_node_scores()")
    with acting_as(conn, "service_role") as c:
        assert count(c, "select * from node_scores") == 3
        assert count(c, "select * from node_base_scores") == 3
