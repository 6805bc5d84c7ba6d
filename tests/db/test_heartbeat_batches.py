"""Heartbeats in batches (issue 41), in SQL as a gateway sends them: node_heartbeats() writes a beat
that changes nothing to node_liveness alone, a beat that changes something as agent_heartbeat()
writes it, each refused on its own; and what reads a node's last heartbeat (the matcher, the sweep,
the map, an owner's pages) reads the batches' too. Also the waste the per-beat path lost: no
statement trigger on a warm-model sync that changes nothing, no validation when no column it checks
changed."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from neuralgrid.db import queries as q
from tests.conftest import LLAMA8, make_node, make_user

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
SECRET = "ngn-test-secret"
# What a node's row holds that a heartbeat may write (the rest: who it is, what it earned).
WRITTEN = (
    "status, queue_depth, outside_load, gpu_utilization, free_vram_gb, backend_up, backend, routes,"
    " gpu_model, gpu_count, vram_gb, tflops, max_concurrency, missed_heartbeats"
)


def key(secret: str = SECRET) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def node(conn: psycopg.Connection, name: str | None = None, **fields: Any) -> uuid.UUID:
    """An online node with a secret, LLAMA8 warm, as a fresh agent's beats leave it."""
    return make_node(conn, name, secret_hash=bytes.fromhex(key()), **fields)


def beat(node_id: uuid.UUID, **fields: Any) -> dict[str, Any]:
    """A beat as the gateway sends it: the node's steady state unless `fields` say otherwise."""
    return {
        "node_id": str(node_id),
        "key": key(),
        "age_ms": 0,
        "status": "online",
        "queue_depth": 0,
        "gpu_utilization": None,
        "free_vram_gb": None,
        "models": [LLAMA8],
        "specs": None,
        "backend_up": True,
        "backend": None,
        "available": None,
        "loaded": [],
        "refused": [],
        **fields,
    }


def send(conn: psycopg.Connection, *beats: dict[str, Any]) -> dict[uuid.UUID, tuple[Any, ...]]:
    rows = conn.execute(
        "select node_id, status, load, error, error_code from node_heartbeats(%s::jsonb)",
        (json.dumps(beats),),
    ).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def liveness(conn: psycopg.Connection, node_id: uuid.UUID) -> Any:
    row = conn.execute(
        "select last_heartbeat_at from node_liveness where node_id = %s", (node_id,)
    ).fetchone()
    return None if row is None else row[0]


def row_versions(conn: psycopg.Connection, node_id: uuid.UUID) -> Any:
    """The versions of everything a heartbeat could write for a node, but its liveness."""
    return conn.execute(
        """select (select xmin::text from nodes where id = %(n)s),
                  (select array_agg(xmin::text order by model_id) from node_models where node_id = %(n)s),
                  (select array_agg(xmin::text order by model_id, policy) from node_scores where node_id = %(n)s),
                  (select count(*) from node_status_changes where node_id = %(n)s)""",
        {"n": node_id},
    ).fetchone()


def functions_run(conn: psycopg.Connection, statement: str, params: Any = None) -> dict[str, int]:
    """Which of our functions a statement ran, and how often (triggers included)."""
    with conn.transaction():
        conn.execute("set local track_functions = 'all'")
        conn.execute(statement, params)
        rows = conn.execute("select funcname::text, calls from pg_stat_xact_user_functions").fetchall()
    return {str(name): int(calls) for name, calls in rows}


def test_a_beat_that_changes_nothing_writes_its_liveness_and_nothing_else(conn: psycopg.Connection) -> None:
    quiet = node(conn)
    # A node's first beat makes its liveness row (under the node's lock, as a change is written).
    assert send(conn, beat(quiet, age_ms=10_000)) == {quiet: ("online", [], None, None)}
    first = liveness(conn, quiet)
    assert first is not None
    before = row_versions(conn, quiet)
    calls = functions_run(
        conn, "select * from node_heartbeats(%s::jsonb)", (json.dumps([beat(quiet, age_ms=2000)]),)
    )
    assert row_versions(conn, quiet) == before
    # No trigger of nodes or node_models ran, nor agent_heartbeat() or pre-warm.
    assert set(calls) == {"node_heartbeats"}, calls
    heard = conn.execute(
        "select now() - last_heartbeat_at from node_liveness where node_id = %s", (quiet,)
    ).fetchone()
    assert heard is not None and timedelta(seconds=1.9) <= heard[0] <= timedelta(seconds=2.5)
    assert send(conn, beat(quiet)) == {quiet: ("online", [], None, None)}
    assert row_versions(conn, quiet) == before
    # Never back in time: a beat heard earlier than the one written changes nothing.
    written = liveness(conn, quiet)
    send(conn, beat(quiet, age_ms=30_000))
    assert liveness(conn, quiet) == written


CHANGES: dict[str, dict[str, Any]] = {
    "warm models": {"models": [LLAMA8, QWEN]},
    "nothing warm": {"models": []},
    "load": {"queue_depth": 3, "gpu_utilization": 0.5, "free_vram_gb": 12.5},
    "draining": {"status": "draining"},
    "server down": {"backend_up": False},
    "specs": {
        "specs": {
            "gpu_model": "NVIDIA A100 80GB",
            "gpu_count": 2,
            "vram_gb": 160,
            "tflops": 624,
            "max_concurrency": 8,
        }
    },
    "server found again": {
        "backend": {"kind": "vllm", "parallel": 8, "routes": ["chat/completions", "responses"]}
    },
    "models it can load": {"available": [QWEN]},
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_beat_that_changes_something_is_written_as_agent_heartbeat_writes_it(
    conn: psycopg.Connection, change: str
) -> None:
    batched, single = node(conn, "batched"), node(conn, "single")
    conn.execute(
        "insert into node_models (node_id, model_id, state) select id, %s, 'available' from nodes", (QWEN,)
    )
    said = beat(batched, **CHANGES[change])
    reply = send(conn, said)[batched]
    expected = conn.execute(
        "select status, load from agent_heartbeat(%s, %s, %s, %s, %s::real, %s::real, %s::text[], %s::jsonb, %s,"
        " %s::jsonb, %s::text[], %s::text[], %s::jsonb)",
        (
            single,
            bytes.fromhex(key()),
            said["status"],
            said["queue_depth"],
            said["gpu_utilization"],
            said["free_vram_gb"],
            said["models"],
            json.dumps(said["specs"]) if said["specs"] else None,
            said["backend_up"],
            json.dumps(said["backend"]) if said["backend"] else None,
            said["available"],
            said["loaded"],
            json.dumps(said["refused"]),
        ),
    ).fetchone()
    assert expected is not None
    assert reply == (*expected, None, None)
    rows = conn.execute(f"select name, {WRITTEN} from nodes order by name").fetchall()
    assert rows[0][1:] == rows[1][1:], rows
    models = conn.execute(
        "select n.name, array_agg(m.model_id || ':' || m.state order by m.model_id) from node_models m"
        " join nodes n on n.id = m.node_id group by n.name order by n.name"
    ).fetchall()
    assert models[0][1] == models[1][1], models


def test_secrets_and_nodes_are_checked_before_anything_is_written(conn: psycopg.Connection) -> None:
    good, bad = node(conn, "good"), node(conn, "bad")
    nobody = uuid.uuid4()
    before = row_versions(conn, bad)
    replies = send(conn, beat(good), beat(bad, key=key("not the secret"), status="draining"), beat(nobody))
    assert replies[good] == ("online", [], None, None)
    assert replies[bad] == (None, None, f"this secret does not belong to node {bad}", "42501")
    assert replies[nobody] == (None, None, f"no node {nobody}", "P0002")
    assert row_versions(conn, bad) == before and liveness(conn, bad) is None
    assert liveness(conn, good) is not None


def test_a_beat_breaking_a_rule_of_its_node_fails_alone(conn: psycopg.Connection) -> None:
    good, bad = node(conn, "good"), node(conn, "bad")
    too_many = {"gpu_model": "NVIDIA GeForce RTX 4090", "gpu_count": 65, "vram_gb": 24, "tflops": 165}
    replies = send(conn, beat(good, queue_depth=1), beat(bad, specs=too_many))
    assert replies[good][:1] == ("online",) and replies[good][3] is None
    assert replies[bad][3] == "23514" and "gpu_count must be between 1 and 64" in replies[bad][2]
    assert conn.execute("select gpu_count from nodes where id = %s", (bad,)).fetchone() == (1,)
    assert conn.execute("select queue_depth from nodes where id = %s", (good,)).fetchone() == (1,)


def test_a_node_a_claim_holds_is_not_waited_for(conn: psycopg.Connection, db_url: str) -> None:
    """A beat that must write a node another transaction holds (a claim) is put off to the next
    batch: a batch never waits on a claim's lock (nor deadlocks with one). A quiet beat needs no
    lock of the node's at all."""
    held = node(conn, "held")
    send(conn, beat(held))  # its first beat, which makes its liveness row
    locked = threading.Event()
    release = threading.Event()

    def claim() -> None:
        with psycopg.connect(db_url) as other, other.transaction():
            other.execute("select 1 from nodes where id = %s for update", (held,))
            locked.set()
            release.wait(10)

    holder = threading.Thread(target=claim)
    holder.start()
    try:
        assert locked.wait(5)
        started = time.monotonic()
        put_off = send(conn, beat(held, queue_depth=2))[held]
        assert put_off[3] == "55P03", put_off
        assert send(conn, beat(held))[held] == ("online", [], None, None)
        assert time.monotonic() - started < 1
    finally:
        release.set()
        holder.join()
    assert send(conn, beat(held, queue_depth=2))[held][3] is None
    assert conn.execute("select queue_depth from nodes where id = %s", (held,)).fetchone() == (2,)


def test_a_batch_names_each_node_once(conn: psycopg.Connection) -> None:
    twice = node(conn)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="at most once"):
        send(conn, beat(twice), beat(twice, queue_depth=1))
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="JSON array"):
        conn.execute("select * from node_heartbeats('{}')")


def test_a_quiet_beat_hears_its_pre_load_request(conn: psycopg.Connection) -> None:
    """The platform asked the node to pre-load a model: every reply says so until it is answered, the
    quiet beats' too (prewarm_for() runs for them)."""
    asked = node(conn, models={LLAMA8: "loaded", QWEN: "available"})
    conn.execute("insert into prewarm_requests (node_id, model_id) values (%s, %s)", (asked, QWEN))
    assert send(conn, beat(asked, available=[QWEN]))[asked] == ("online", [QWEN], None, None)
    assert send(conn, beat(asked, available=[QWEN], loaded=[QWEN], models=[LLAMA8, QWEN]))[asked][1] == []
    assert conn.execute("select outcome from prewarm_requests").fetchone() == ("loaded",)


def test_what_reads_a_nodes_last_heartbeat_reads_the_batches(conn: psycopg.Connection) -> None:
    """The matcher's freshness filter, the sweep, the map and an owner's pages read the later of the
    node's row and its node_liveness row."""
    beating = node(conn, "beating")
    send(conn, beat(beating))  # its first: written to its row too
    # Its row's last beat an hour ago, its batches' now.
    conn.execute("update nodes set last_heartbeat_at = now() - interval '1 hour'")
    assert send(conn, beat(beating)) == {beating: ("online", [], None, None)}

    def seen() -> dict[str, Any]:
        ranked = conn.execute("select node_id from score_nodes(%s, p_limit => 8)", (LLAMA8,)).fetchall()
        explained = conn.execute(
            "select reject_reason from score_nodes(%s, p_explain => true) where node_id = %s",
            (LLAMA8, beating),
        ).fetchone()
        mapped = conn.execute(
            "select now() - last_heartbeat_at from node_map where id = %s", (beating,)
        ).fetchone()
        return {
            "ranked": [r[0] for r in ranked],
            "why not": explained[0] if explained else None,
            "on the map": mapped is not None and mapped[0] < timedelta(seconds=2),
            "matched": conn.execute("select node_id from match_job(%s)", (LLAMA8,)).fetchone() == (beating,),
        }

    assert seen() == {"ranked": [beating], "why not": None, "on the map": True, "matched": True}
    assert conn.execute("select * from sweep_stale_nodes()").fetchall() == []

    conn.execute("update nodes set inflight = 0, status = 'online'")
    conn.execute("update node_liveness set last_heartbeat_at = now() - interval '10 minutes'")
    # Stale after 0.6 s: the sweep counts silence from the database's start too, which a test's
    # cluster passed well before that (not always the 15 s of the default interval).
    conn.execute("update platform_settings set heartbeat_interval_s = 0.2")
    stale = seen()
    assert stale["ranked"] == [] and not stale["matched"] and not stale["on the map"]
    assert str(stale["why not"]).startswith("heartbeat is stale")
    swept = conn.execute("select node_id, now() - last_heartbeat_at from sweep_stale_nodes()").fetchall()
    assert [r[0] for r in swept] == [beating] and timedelta(minutes=10) <= swept[0][1] < timedelta(minutes=11)
    # The sweep kept the last beat in the row as it set the node offline.
    assert conn.execute(
        "select status, now() - last_heartbeat_at < interval '11 minutes' from nodes"
    ).fetchone() == (
        "offline",
        True,
    )
    # And the next beat brings it back.
    assert send(conn, beat(beating))[beating][0] == "online"


def test_a_warm_model_sync_that_changes_nothing_fires_no_trigger(conn: psycopg.Connection) -> None:
    """The per-beat path (agent_heartbeat(), the Edge Function's) in steady state: its warm-model
    sync changed no row yet fired three statement-level triggers that each rescored the node, a
    call planned afresh each time; and the node's description was validated though none of it had
    changed."""
    steady = node(conn)
    beat_once = (
        "select * from agent_heartbeat(%s, %s, 'online', 0, null::real, null::real, %s::text[], null::jsonb, true,"
        " null::jsonb, null::text[], '{}'::text[], '[]'::jsonb)"
    )
    params = (steady, bytes.fromhex(key()), [LLAMA8])
    conn.execute(beat_once, params)
    calls = functions_run(conn, beat_once, params)
    wasted = {"node_scores_after_node_models_change", "refresh_node_scores", "nodes_check_description"}
    assert {name: calls[name] for name in wasted if name in calls} == {}
    # A change still runs them: a new warm model is rescored, a new load validated.
    calls = functions_run(
        conn, beat_once.replace("'online', 0", "'online', 2"), (steady, bytes.fromhex(key()), [LLAMA8, QWEN])
    )
    assert calls.get("refresh_node_scores") and calls.get("nodes_check_description") == 1


def test_an_owner_sees_the_last_beat_of_the_batches(conn: psycopg.Connection) -> None:
    """The owner's pages (`Your nodes`, the operator's list) and the Data API's my_nodes() and
    my_node_stats(), read as the owner, show the batches' last beat, not the row's hour-old one."""
    owner = make_user(conn)
    mine = node(conn, "mine", owner_id=owner)
    send(conn, beat(mine))
    conn.execute("update nodes set last_heartbeat_at = now() - interval '1 hour'")
    send(conn, beat(mine))
    with conn.transaction():
        conn.execute("set local role authenticated")
        claims = json.dumps({"sub": str(owner), "role": "authenticated"})
        conn.execute("select set_config('request.jwt.claims', %s, true)", (claims,))
        ages = [
            conn.execute(f"select now() - last_heartbeat_at from ({query}) q").fetchone()
            for query in (
                q.MY_NODES.sql,
                "select last_heartbeat_at from my_nodes()",
                "select last_heartbeat_at from my_node_stats('1 day')",
            )
        ]
    assert all(age is not None and age[0] < timedelta(seconds=5) for age in ages), ages
