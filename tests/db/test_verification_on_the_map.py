"""A node's verification where the map, the fleet list and the owner read it (migration
20261209000200): nodes.verification is the worst state of the node's models under verification,
kept by a trigger on model_checks; anon reads it in node_map, map_view(), node_list() and the rows by
id; a change is broadcast on node-map and the owner's topic; my_nodes() and the operator's fleet
list carry it."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg

from neuralgrid.admin import fleet
from neuralgrid.db import queries as q
from tests.conftest import LLAMA8, make_node, make_user
from tests.db.test_rls import acting_as

QWEN = "Qwen/Qwen2.5-32B-Instruct-AWQ"
REASON = "token 3 is 9.5 logits below the best"


def pin_model(conn: psycopg.Connection, model: str = LLAMA8, sha: str = "b" * 64) -> None:
    conn.execute(
        "insert into model_artifacts (model_id, format, sha256) values (%s, 'gguf', %s)", (model, sha)
    )


def challenged(
    conn: psycopg.Connection, node: uuid.UUID, model: str, *passed: bool, reason: str = REASON
) -> None:
    """Challenge outcomes as a gateway's verifier records them, one call each."""
    for ok in passed:
        result: dict[str, Any] = {"node": str(node), "model": model, "job": None, "passed": ok}
        result |= {"distance": 0 if ok else 9.5, "detail": {} if ok else {"reason": reason}}
        conn.execute("select * from record_challenges(%s::jsonb)", (json.dumps([result]),))


def fail_model(conn: psycopg.Connection, node: uuid.UUID, model: str = LLAMA8, reason: str = REASON) -> None:
    """Failed two hours ago (two failures in a row fail a fresh model, three one that passed before; a
    failure after it failed is ignored): its owner may ask again."""
    challenged(conn, node, model, False, False, False, reason=reason)
    conn.execute(
        "update model_checks set state_since = now() - interval '2 hours' where node_id = %s and model_id = %s",
        (node, model),
    )


def verification(conn: psycopg.Connection, node: uuid.UUID) -> str | None:
    row = conn.execute("select verification from nodes where id = %s", (node,)).fetchone()
    assert row is not None
    return None if row[0] is None else str(row[0])


def node_map_messages(conn: psycopg.Connection, topic: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        "select payload from realtime.messages where topic = %s order by inserted_at, id", (topic,)
    ).fetchall()
    return [row[0] for row in rows]


def test_a_nodes_verification_is_the_worst_state_of_its_models(conn: psycopg.Connection) -> None:
    node = make_node(conn, "box", models={LLAMA8: "loaded", QWEN: "available"})
    plain = make_node(conn, "plain", models={QWEN: "loaded"})
    assert verification(conn, node) is None  # no pinned model: nothing to say

    pin_model(conn)
    assert (verification(conn, node), verification(conn, plain)) == ("unverified", None)
    pin_model(conn, QWEN, "c" * 64)
    assert verification(conn, plain) == "unverified"

    challenged(conn, node, QWEN, *[True] * 7)  # Qwen verified; LLAMA8 still unverified: the worse
    assert verification(conn, node) == "unverified"
    challenged(conn, node, LLAMA8, *[True] * 7)
    assert verification(conn, node) == "verified"
    challenged(conn, node, LLAMA8, False)
    assert verification(conn, node) == "suspect"
    challenged(conn, node, LLAMA8, False, False)  # from the floor, three failures fail it
    assert verification(conn, node) == "failed"
    challenged(conn, node, QWEN, False)  # another model's suspicion is less bad than a failure
    assert verification(conn, node) == "failed"

    # Asked again (an hour on), the failed model starts over: the worst is now Qwen's suspect.
    conn.execute(
        "update model_checks set state_since = now() - interval '2 hours' where node_id = %s", (node,)
    )
    conn.execute("select * from request_verification(%s)", (node,))
    assert verification(conn, node) == "suspect"

    # A check that goes (its artifact unpinned, a cleanup) leaves the others to decide.
    conn.execute("delete from model_checks where node_id = %s and model_id = %s", (node, QWEN))
    assert verification(conn, node) == "unverified"
    conn.execute("delete from model_checks where node_id = %s", (node,))
    assert verification(conn, node) is None

    # Deleting a node under verification deletes its checks with it, and nothing refuses.
    conn.execute("delete from nodes where id = %s", (plain,))
    assert conn.execute("select count(*) from model_checks where node_id = %s", (plain,)).fetchone() == (0,)


def test_anyone_reads_it_on_the_map_and_nothing_else_of_the_checks(conn: psycopg.Connection) -> None:
    pin_model(conn)
    cheat = make_node(conn, "cheat", latitude=48.85, longitude=2.35)
    make_node(conn, "honest", latitude=48.86, longitude=2.36)
    plain = make_node(conn, "plain", latitude=48.87, longitude=2.37, models={QWEN: "loaded"})
    fail_model(conn, cheat)
    expected = {"cheat": "failed", "honest": "unverified", "plain": None}
    with acting_as(conn, "anon") as anon:
        rows = anon.execute("select name, verification from node_map").fetchall()
        assert dict(rows) == expected
        view = anon.execute("select public.map_view(0, 40, 10, 50, 1, 300)").fetchone()
        assert view is not None
        assert {n["name"]: n["verification"] for n in view[0]["nodes"]} == expected
        page = anon.execute(
            q.NODE_LIST.sql, {"search": "", "sort": "name", "descending": False, "offset": 0, "limit": 50}
        ).fetchone()
        assert page is not None
        assert [(n["name"], n["verification"]) for n in page[0]["nodes"]] == list(expected.items())
        by_id = anon.execute(q.MAP_NODES_BY_ID.sql, ([cheat, plain],)).fetchone()
        assert by_id is not None
        assert [(n["name"], n["verification"]) for n in by_id[0]] == [("cheat", "failed"), ("plain", None)]
        # The evidence and the reasons stay the owner's: anon reads no check.
        assert anon.execute(
            "select has_table_privilege('anon', 'public.model_checks', 'select')"
        ).fetchone() == (False,)


def test_a_change_of_verification_is_broadcast_on_the_map_and_to_the_owner(conn: psycopg.Connection) -> None:
    owner = make_user(conn)
    node = make_node(conn, "box", owner_id=owner)
    before = len(node_map_messages(conn, "node-map"))
    pin_model(conn)
    challenged(conn, node, LLAMA8, True, True)  # passes that change no state: no message
    sent = node_map_messages(conn, "node-map")[before:]
    assert [m["node"]["verification"] for m in sent] == ["unverified"]
    fail_model(conn, node)
    sent = node_map_messages(conn, "node-map")[before:]
    # Suspect after the first failure, failed after the third: a message each change, none between.
    assert [m["node"]["verification"] for m in sent] == ["unverified", "suspect", "failed"]
    assert sent[-1]["node"]["status"] == "online" and sent[-1]["operation"] == "UPDATE"
    assert node_map_messages(conn, f"owner:{owner}")[-1]["node"]["verification"] == "failed"


def test_the_owner_and_the_operator_read_it_with_their_nodes(conn: psycopg.Connection) -> None:
    owner = make_user(conn)
    mine = make_node(conn, "mine", owner_id=owner)
    make_node(conn, "theirs", owner_id=make_user(conn, "other@example.test"))
    pin_model(conn)
    fail_model(conn, mine)
    with acting_as(conn, "authenticated", owner) as me:
        rows = me.execute("select name, verification from public.my_nodes()").fetchall()
        assert rows == [("mine", "failed")]
        assert me.execute(q.MY_NODES.sql).fetchall()[0][-1] == "failed"
    listed = {n["name"]: n["verification"] for n in fleet.list_nodes(conn)}
    assert listed == {"mine": "failed", "theirs": "unverified"}
