"""A node's load in the batches (issue 41): a real GPU's utilization and free VRAM change nearly every
beat, so a beat that changes only them is written by node_heartbeats() into the node's node_liveness
row, not through agent_heartbeat() into its wide row. What shows or uses them (the map and its table,
the row feed, an owner's pages, pre-warm's free VRAM) reads the later of the two rows, as it reads a
node's last heartbeat."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg

from neuralgrid.db import queries as q
from tests.conftest import LLAMA8, make_user
from tests.db.test_heartbeat_batches import beat, functions_run, key, node, row_versions, send

SMALL = "meta-llama/Llama-3.2-3B-Instruct"  # 8 GB in the catalog
# Utilizations and free VRAM exactly as a real (float4) keeps them.
LOADS = [(0.25, 3.5), (0.875, 11.0), (0.5, 20.25), (0.125, 7.75)]
ONE_BEAT = (
    "select * from agent_heartbeat(%s, %s, 'online', 0, %s::real, %s::real, %s::text[], null::jsonb, true,"
    " null::jsonb, null::text[], '{}'::text[], '[]'::jsonb)"
)


def shown(conn: psycopg.Connection, node_id: uuid.UUID, owner: uuid.UUID) -> dict[str, Any]:
    """The node's (utilization, free VRAM) wherever they are read."""
    found: dict[str, Any] = {}
    row = conn.execute(
        "select gpu_utilization, free_vram_gb from node_map where id = %s", (node_id,)
    ).fetchone()
    found["node_map"] = row
    listed = conn.execute("select public.node_list('', 'name', false, 0, 10)").fetchone()
    assert listed is not None
    entry = next(n for n in listed[0]["nodes"] if n["id"] == str(node_id))
    found["node_list"] = (entry["gpu_utilization"], entry["free_vram_gb"])
    by_id = conn.execute(q.MAP_NODES_BY_ID.sql, ([node_id],)).fetchone()
    assert by_id is not None
    found["map by id"] = (by_id[0][0]["gpu_utilization"], by_id[0][0]["free_vram_gb"])
    # The row feeds, the map's and the owner's: a change they broadcast (the node moved a little).
    conn.execute("update nodes set latitude = latitude + 0.001 where id = %s", (node_id,))
    for feed, topic in (("row feed", "node-map"), ("owner's feed", f"owner:{owner}")):
        sent = conn.execute(
            "select payload -> 'node' from realtime.messages where topic = %s order by inserted_at desc, id desc"
            " limit 1",
            (topic,),
        ).fetchone()
        assert sent is not None
        found[feed] = (sent[0]["gpu_utilization"], sent[0]["free_vram_gb"])
    with conn.transaction():
        conn.execute("set local role authenticated")
        claims = json.dumps({"sub": str(owner), "role": "authenticated"})
        conn.execute("select set_config('request.jwt.claims', %s, true)", (claims,))
        mine = conn.execute(
            f"select gpu_utilization, free_vram_gb from ({q.MY_NODES.sql}) m where m.id = %s", (node_id,)
        ).fetchone()
        found["owner's page"] = mine
    return {where: tuple(value) if value is not None else None for where, value in found.items()}


def everywhere(load: tuple[float, float]) -> dict[str, Any]:
    places = ("node_map", "node_list", "map by id", "row feed", "owner's feed", "owner's page")
    return dict.fromkeys(places, load)


def test_a_beat_that_changes_only_its_load_is_written_by_the_batch(conn: psycopg.Connection) -> None:
    owner = make_user(conn)
    busy = node(conn, "busy", owner_id=owner)
    send(conn, beat(busy))  # its first beat, which makes its liveness row
    before = row_versions(conn, busy)
    for utilization, free in LOADS:
        said = beat(busy, gpu_utilization=utilization, free_vram_gb=free)
        calls = functions_run(conn, "select * from node_heartbeats(%s::jsonb)", (json.dumps([said]),))
        # Not agent_heartbeat(): no trigger of the node's row, its models or its scores ran.
        assert set(calls) == {"node_heartbeats"}, calls
        assert row_versions(conn, busy) == before
        assert shown(conn, busy, owner) == everywhere((utilization, free))
        before = row_versions(conn, busy)  # shown() moved the node, for the feeds


def test_the_later_of_the_two_rows_is_read(conn: psycopg.Connection) -> None:
    """A beat written at once (the heartbeat Edge Function's agent_heartbeat()) after the batches'
    is the node's load; the batches' next beat is again."""
    owner = make_user(conn)
    both = node(conn, "both", owner_id=owner)
    send(conn, beat(both))
    send(conn, beat(both, gpu_utilization=0.25, free_vram_gb=3.5))
    conn.execute(ONE_BEAT, (both, bytes.fromhex(key()), 0.75, 9.5, [LLAMA8]))
    assert shown(conn, both, owner) == everywhere((0.75, 9.5))
    send(conn, beat(both, gpu_utilization=0.5, free_vram_gb=1.25))
    assert shown(conn, both, owner) == everywhere((0.5, 1.25))
    # The sweep, setting a silent node offline, copies the batches' last beat into its row: the
    # batches' load is still the one read.
    conn.execute("update platform_settings set heartbeat_interval_s = 0.2")  # stale after 0.6 s
    conn.execute("update node_liveness set last_heartbeat_at = now() - interval '10 minutes'")
    conn.execute("update nodes set last_heartbeat_at = now() - interval '20 minutes'")
    assert [r[0] for r in conn.execute("select node_id from sweep_stale_nodes()").fetchall()] == [both]
    assert shown(conn, both, owner) == everywhere((0.5, 1.25))


def test_pre_warm_reads_the_free_vram_of_the_batches(conn: psycopg.Connection) -> None:
    """A node with too little free VRAM for the model in demand is not asked to load it; the batched
    beat that says it has room now is (its reply asks), without agent_heartbeat()."""
    conn.execute("update platform_settings set prewarm_refresh_s = 0")
    idle = node(conn, models={SMALL: "available"}, status="offline")  # away when the request came
    row = conn.execute(
        "select error from match_job(%s, null, 'balanced', null, 'eu-west')", (SMALL,)
    ).fetchone()
    assert row is not None and row[0] is not None  # refused: demand for SMALL, no warm node
    full = beat(idle, models=[], free_vram_gb=4.0)
    assert send(conn, full)[idle] == ("online", [], None, None)  # its first: 4 GB free, too little
    assert send(conn, full)[idle] == ("online", [], None, None)
    roomy = beat(idle, models=[], free_vram_gb=12.0)
    calls = functions_run(conn, "select * from node_heartbeats(%s::jsonb)", (json.dumps([roomy]),))
    assert "agent_heartbeat" not in calls and calls.get("prewarm_for") == 1, calls
    asked = conn.execute("select model_id from prewarm_requests where node_id = %s", (idle,)).fetchall()
    assert asked == [(SMALL,)]


def test_a_load_out_of_bounds_is_refused_alone(conn: psycopg.Connection) -> None:
    good, bad = node(conn, "good"), node(conn, "bad")
    send(conn, beat(good), beat(bad))
    replies = send(conn, beat(good, gpu_utilization=0.5), beat(bad, gpu_utilization=1.5, free_vram_gb=2.0))
    assert replies[good] == ("online", [], None, None)
    assert replies[bad][3] == "23514" and "gpu_utilization must be between 0 and 1" in replies[bad][2]
    loads: dict[uuid.UUID, float | None] = dict(
        conn.execute("select node_id, gpu_utilization from node_liveness").fetchall()
    )
    assert loads == {good: 0.5, bad: None}
