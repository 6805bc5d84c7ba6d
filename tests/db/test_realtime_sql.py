"""Realtime in SQL: the publication, Broadcast from Database, and RLS on private topics."""

from __future__ import annotations

import json
import uuid

import psycopg

from neuralgrid.db.matching import MatchRequest, complete_job, match_job
from tests.conftest import LLAMA8, make_node, make_user


def messages(conn: psycopg.Connection, topic: str) -> list[tuple[str, dict, bool]]:  # type: ignore[type-arg]
    return conn.execute(
        "select event, payload, private from realtime.messages where topic = %s order by inserted_at",
        (topic,),
    ).fetchall()


def test_nodes_are_in_the_realtime_publication(conn: psycopg.Connection) -> None:
    rows = conn.execute(
        "select tablename from pg_publication_tables where pubname = 'supabase_realtime'"
    ).fetchall()
    assert ("nodes",) in rows


def test_status_changes_are_broadcast_on_the_public_map_without_secrets(conn: psycopg.Connection) -> None:
    owner = make_user(conn)
    node = make_node(conn, "box", owner_id=owner)
    conn.execute("update nodes set status = 'offline' where id = %s", (node,))
    events = messages(conn, "node-map")
    assert [e for e, _, _ in events] == ["node_insert", "node_update"]
    _, payload, private = events[-1]
    assert private is False and payload["old_status"] == "online" and payload["node"]["status"] == "offline"
    assert {"endpoint_url", "owner_id", "secret_hash"}.isdisjoint(payload["node"])
    # The owner's private topic carries the whole row, still without the secret.
    (_, owned, is_private) = messages(conn, f"owner:{owner}")[-1]
    assert is_private and owned["node"]["endpoint_url"] and "secret_hash" not in owned["node"]


def test_claims_and_heartbeats_do_not_flood_the_topic(conn: psycopg.Connection) -> None:
    node = make_node(conn)
    before = len(messages(conn, "node-map"))
    for _ in range(5):
        m = match_job(conn, MatchRequest(model=LLAMA8))
        complete_job(conn, m.job_id, completion_tokens=1)
        conn.execute("select node_heartbeat(%s)", (node,))
    assert len(messages(conn, "node-map")) == before


def test_finished_jobs_reach_their_developer_privately(conn: psycopg.Connection) -> None:
    dev = make_user(conn)
    conn.execute(
        "select set_config('request.jwt.claims', %s, false)",
        (json.dumps({"sub": str(dev), "role": "authenticated"}),),
    )
    key = (conn.execute("select id from create_api_key('k')").fetchone() or [None])[0]
    conn.execute("select set_config('request.jwt.claims', '', false)")
    make_node(conn)
    m = match_job(conn, MatchRequest(model=LLAMA8), api_key_id=key)
    complete_job(conn, m.job_id, completion_tokens=7)
    ((event, payload, private),) = messages(conn, f"jobs:{dev}")
    assert event == "job_succeeded" and private and payload["job"]["completion_tokens"] == 7


def test_private_topics_are_authorized_by_rls(conn: psycopg.Connection) -> None:
    alice, bob = make_user(conn), make_user(conn)
    make_node(conn, "alice-box", owner_id=alice)

    def visible(user: uuid.UUID, topic: str) -> int:
        with conn.transaction(force_rollback=True):
            conn.execute(
                "select set_config('request.jwt.claims', %s, true)",
                (json.dumps({"sub": str(user), "role": "authenticated"}),),
            )
            conn.execute("select set_config('realtime.topic', %s, true)", (topic,))
            conn.execute("set local role authenticated")
            row = conn.execute(
                "select count(*) from realtime.messages where topic = realtime.topic()"
            ).fetchone()
            return int(row[0]) if row else 0

    assert visible(alice, f"owner:{alice}") == 1
    assert visible(bob, f"owner:{alice}") == 0
    assert visible(bob, f"owner:{bob}") == 0
