"""GPU proofs in SQL (075_verification.sql): which nodes are probed and when, the states a probe's
outcome moves a node through, the matcher's and the leases' hard filter on a failed GPU, new claims
proven anew, what an owner sees, and bad input."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any
from uuid import UUID

import psycopg
import pytest

from tests.conftest import LLAMA8, make_node, make_user
from tests.db.test_rls import acting_as


def agent_node(conn: psycopg.Connection, name: str, **fields: Any) -> UUID:
    """A node run by an agent (a signing key), online and fresh, holding LLAMA8."""
    return make_node(conn, name, secret_hash=os.urandom(32), models={LLAMA8: "loaded"}, **fields)


def probe(conn: psycopg.Connection, node: UUID, outcome: str, **detail: Any) -> str:
    row = conn.execute(
        "select state from record_gpu_probe(%s, %s, %s::jsonb)", (node, outcome, json.dumps(detail))
    ).fetchone()
    assert row is not None
    return str(row[0])


def proof(conn: psycopg.Connection, node: UUID) -> dict[str, Any]:
    row = conn.execute(
        "select state, probes, gbps, datasheet_gbps, proven_gb, device, reason,"
        " next_probe_at - now() as wait from gpu_proofs where node_id = %s",
        (node,),
    ).fetchone()
    assert row is not None, "no GPU proof"
    keys = ("state", "probes", "gbps", "datasheet_gbps", "proven_gb", "device", "reason", "wait")
    return dict(zip(keys, row, strict=True))


def due(conn: psycopg.Connection, limit: int = 10) -> list[UUID]:
    return [r[0] for r in conn.execute("select node_id from due_gpu_probes(%s)", (limit,))]


def ranked(conn: psycopg.Connection) -> list[UUID]:
    return [r[0] for r in conn.execute("select node_id from score_nodes(%s, p_limit => 10)", (LLAMA8,))]


def test_a_node_with_an_agent_is_due_a_probe_at_once_and_one_without_is_never(
    conn: psycopg.Connection,
) -> None:
    agent = agent_node(conn, "agent")
    bare = make_node(conn, "bare")  # reached unsigned: nothing on it could answer a probe
    assert proof(conn, agent)["state"] == "unproven"
    assert conn.execute("select count(*) from gpu_proofs where node_id = %s", (bare,)).fetchone() == (0,)
    assert due(conn) == [agent]
    assert due(conn) == []  # taken: put off while its gateway probes it
    offline = agent_node(conn, "offline", status="offline")
    assert offline not in due(conn)


def test_a_probe_that_passes_proves_the_gpu_until_the_next_a_day_later(conn: psycopg.Connection) -> None:
    node = agent_node(conn, "node")
    detail = {"bytes": 12 << 30, "gbps": 610.5, "datasheet_gbps": 1008, "device": "NVIDIA GeForce RTX 4090"}
    assert probe(conn, node, "passed", **detail) == "proven"
    got = proof(conn, node)
    assert got["state"] == "proven" and got["probes"] == 1 and got["proven_gb"] == 12
    assert (got["gbps"], got["datasheet_gbps"], got["device"]) == (610.5, 1008, "NVIDIA GeForce RTX 4090")
    assert 86000 < got["wait"].total_seconds() <= 86400
    rows = conn.execute(
        "select outcome, state, detail from gpu_probes where node_id = %s", (node,)
    ).fetchall()
    assert rows == [("passed", "proven", detail)]


def test_slow_twice_in_a_row_fails_a_gpu_and_the_first_makes_it_suspect(conn: psycopg.Connection) -> None:
    node = agent_node(conn, "node")
    assert probe(conn, node, "slow", gbps=2.1, datasheet_gbps=1008, reason="2.1 GB/s is 0.2%") == "suspect"
    assert proof(conn, node)["wait"].total_seconds() <= 600  # probed again soon
    assert node in ranked(conn)  # a busy GPU may be slow once: not filtered yet
    assert probe(conn, node, "slow", gbps=2.2, datasheet_gbps=1008) == "failed"
    assert node not in ranked(conn)
    other = agent_node(conn, "other")
    assert probe(conn, other, "slow") == "suspect"
    assert probe(conn, other, "passed") == "proven"
    assert probe(conn, other, "slow") == "suspect"  # from proven, one slow probe is not a failure


def test_wrong_digests_fail_a_gpu_at_once_and_it_leaves_the_matcher_and_the_leases(
    conn: psycopg.Connection,
) -> None:
    liar = agent_node(conn, "liar", hourly_rate=0.05)
    honest = agent_node(conn, "honest", hourly_rate=0.9)
    assert ranked(conn)[0] == liar
    assert probe(conn, liar, "wrong", reason="4 of 4 blocks checked are not what the fill makes") == "failed"
    assert ranked(conn) == [honest]
    explained: dict[UUID, str | None] = dict(
        conn.execute(
            "select node_id, reject_reason from score_nodes(%s, p_policy => 'seed', p_explain => true)",
            (LLAMA8,),
        ).fetchall()
    )
    assert explained[liar] == "its GPU failed its probe" and explained[honest] is None
    leases = conn.execute(
        "select node_id from renew_leases(%s, %s::jsonb)",
        (uuid.uuid4(), json.dumps([{"model": LLAMA8, "want": 8, "in_use": {}}])),
    ).fetchall()
    assert {r[0] for r in leases} == {honest}
    assert proof(conn, liar)["reason"] == "4 of 4 blocks checked are not what the fill makes"
    # Probed again a day later; a probe that passes puts it back.
    assert 86000 < proof(conn, liar)["wait"].total_seconds() <= 86400
    assert probe(conn, liar, "passed") == "proven"
    assert liar in ranked(conn)


def test_no_gpu_and_refusals_are_recorded_without_a_penalty(conn: psycopg.Connection) -> None:
    node = agent_node(conn, "cpu-box")
    assert probe(conn, node, "refused", reason="HTTP 409: not enough free GPU memory") == "unproven"
    assert proof(conn, node)["wait"].total_seconds() <= 600
    assert probe(conn, node, "no_gpu", reason="no NVIDIA GPU found") == "no_gpu"
    assert node in ranked(conn)
    assert proof(conn, node)["reason"] == "no NVIDIA GPU found"


def test_new_gpu_claims_are_proven_anew_but_a_failed_gpu_stays_failed(conn: psycopg.Connection) -> None:
    node = agent_node(conn, "node")
    probe(conn, node, "passed")
    conn.execute("update nodes set gpu_model = 'NVIDIA H100 80GB HBM3', vram_gb = 80 where id = %s", (node,))
    assert proof(conn, node)["state"] == "unproven" and node in due(conn)
    conn.execute("update nodes set hourly_rate = 0.5 where id = %s", (node,))  # not a claim about the GPU
    assert proof(conn, node)["state"] == "unproven"
    probe(conn, node, "wrong")
    conn.execute("update nodes set gpu_model = 'NVIDIA H200', vram_gb = 141 where id = %s", (node,))
    assert proof(conn, node)["state"] == "failed"  # a new claim does not wipe the failure


def test_an_owner_sees_their_own_nodes_proofs_and_probes_only(conn: psycopg.Connection) -> None:
    alice, bob = make_user(conn, "alice@example.com"), make_user(conn, "bob@example.com")
    mine = agent_node(conn, "mine", owner_id=alice)
    theirs = agent_node(conn, "theirs", owner_id=bob)
    probe(conn, mine, "slow", reason="too slow")
    probe(conn, theirs, "wrong")
    with acting_as(conn, "authenticated", alice):
        assert conn.execute("select node_id, state from gpu_proofs").fetchall() == [(mine, "suspect")]
        assert conn.execute("select node_id, outcome from gpu_probes").fetchall() == [(mine, "slow")]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("select record_gpu_probe(%s, 'passed')", (mine,))


def test_bad_outcomes_are_refused_and_change_nothing(conn: psycopg.Connection) -> None:
    node = agent_node(conn, "node")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="outcome must be"):
        probe(conn, node, "excellent")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="detail must be a JSON object"):
        conn.execute("select record_gpu_probe(%s, 'passed', '[1]')", (node,))
    with pytest.raises(psycopg.errors.ForeignKeyViolation, match="no GPU proof"):
        probe(conn, make_node(conn, "bare"), "passed")
    assert proof(conn, node)["state"] == "unproven" and proof(conn, node)["probes"] == 0
    assert conn.execute("select count(*) from gpu_probes").fetchone() == (0,)
