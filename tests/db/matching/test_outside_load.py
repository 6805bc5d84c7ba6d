"""Capacity from the backend: work a node's server runs for others (outside load) counts against the
node's free slots in the matcher, from the queue depth its agent reports."""

from __future__ import annotations

import hashlib
from uuid import UUID

import psycopg

from neuralgrid.db.matching import MatchRequest, complete_job, match_job, score_nodes
from tests.conftest import LLAMA8, make_node

SECRET_HASH = hashlib.sha256(b"ngn-outside-load").digest()
REQUEST = MatchRequest(model=LLAMA8)


def agent_node(conn: psycopg.Connection, name: str) -> UUID:
    return make_node(conn, name, secret_hash=SECRET_HASH, max_concurrency=4)


def beat(conn: psycopg.Connection, node: UUID, queue_depth: int) -> None:
    """The agent's heartbeat, as it sends it: its server running or holding `queue_depth` requests."""
    conn.execute(
        "select agent_heartbeat(%s, %s, 'online', %s, null, null, %s)",
        (node, SECRET_HASH, queue_depth, [LLAMA8]),
    )


def load(conn: psycopg.Connection, node: UUID) -> tuple[int, int, int]:
    row = conn.execute(
        "select inflight, queue_depth, outside_load from nodes where id = %s", (node,)
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def capacity(conn: psycopg.Connection, node: UUID) -> float | None:
    ranked = {r.node_id: r for r in score_nodes(conn, REQUEST, explain=True)}
    return ranked[node].capacity


def test_a_server_busy_with_outside_work_ranks_below_an_idle_twin(conn: psycopg.Connection) -> None:
    busy, idle = agent_node(conn, "a-busy"), agent_node(conn, "b-idle")
    # Twins: the tie goes to the lower id; make sure the busy one would win it.
    busy, idle = sorted((busy, idle))
    first = match_job(conn, REQUEST)
    assert first.node_id == busy
    complete_job(conn, first.job_id, completion_tokens=1)

    beat(conn, busy, 3)  # its owner's own three requests run on its server
    assert load(conn, busy) == (0, 3, 3)
    assert capacity(conn, busy) == 0.25 and capacity(conn, idle) == 1.0
    assert match_job(conn, REQUEST).node_id == idle

    beat(conn, busy, 0)  # the outside work ended
    assert load(conn, busy) == (0, 0, 0)
    assert capacity(conn, busy) == 1.0


def test_the_platforms_own_requests_are_not_counted_twice(conn: psycopg.Connection) -> None:
    node = agent_node(conn, "solo")
    match_job(conn, REQUEST)
    match_job(conn, REQUEST)
    beat(conn, node, 2)  # the agent counts the platform's two requests in its queue depth
    assert load(conn, node) == (2, 2, 0)
    assert capacity(conn, node) == 0.5
    beat(conn, node, 3)  # and one more from elsewhere
    assert load(conn, node) == (2, 3, 1)
    assert capacity(conn, node) == 0.25


def test_outside_load_ranks_but_never_refuses(conn: psycopg.Connection) -> None:
    """The figure is as old as the last heartbeat: a full-looking server still takes work when no
    other node can, and capacity stays in [0, 1] when the server holds more than its slots."""
    node = agent_node(conn, "crowded")
    beat(conn, node, 9)
    assert capacity(conn, node) == 0.0
    assert match_job(conn, REQUEST).node_id == node
    assert load(conn, node) == (1, 9, 9)  # a claim leaves the reported figure as it was


def test_node_scores_follow_heartbeats_that_change_outside_load(conn: psycopg.Connection) -> None:
    node = agent_node(conn, "cached")
    base = "select base_score from node_scores where node_id = %s and policy = 'balanced'"
    before = conn.execute(base, (node,)).fetchone()
    beat(conn, node, 4)
    after = conn.execute(base, (node,)).fetchone()
    assert before is not None and after is not None and after[0] < before[0]
    stale = (
        "select count(*) from node_scores s join node_base_scores v using (policy, model_id, node_id)"
        " where s.base_score is distinct from v.base_score"
    )
    assert conn.execute(stale).fetchone() == (0,)
