"""SQL for what an agent finds behind it: status from the server's health and the tunnel, the
request blamed instead of two nodes, and the nodes a chat stream may resume on."""

from __future__ import annotations

import hashlib
from typing import Any
from uuid import UUID

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.conftest import make_key, make_node

SECRET = "ngn-test-secret"
KEY = hashlib.sha256(SECRET.encode()).digest()


def agent_node(conn: psycopg.Connection, **fields: Any) -> UUID:
    return make_node(conn, secret_hash=KEY, **fields)


def beat(conn: psycopg.Connection, node: UUID, up: bool, backend: dict[str, Any] | None = None) -> str:
    row = conn.execute(
        "select agent_heartbeat(%s, %s, 'online', 0, null, null, %s, null, %s, %s)",
        (node, KEY, ["meta-llama/Llama-3.1-8B-Instruct"], up, None if backend is None else Jsonb(backend)),
    ).fetchone()
    assert row is not None
    return str(row[0])


def test_a_dead_server_takes_its_node_offline_and_cold_until_it_answers_again(
    conn: psycopg.Connection,
) -> None:
    node = agent_node(conn)
    assert beat(conn, node, up=False) == "offline"
    models = "select state from node_models where node_id = %s"
    assert conn.execute(models, (node,)).fetchall() == [("available",)]  # nothing is warm on a dead server
    assert beat(conn, node, up=True, backend={"kind": "llama.cpp", "continues": True}) == "online"
    assert conn.execute(models, (node,)).fetchall() == [("loaded",)]
    row = conn.execute("select backend_up, backend ->> 'kind' from nodes where id = %s", (node,)).fetchone()
    assert row == (True, "llama.cpp")


def test_a_node_whose_server_is_down_stays_offline_without_flapping(conn: psycopg.Connection) -> None:
    """Found as an owner: each beat of a node whose server was down set it online then offline (two
    rows of status history, two Realtime events, every 5 s)."""
    node = agent_node(conn)
    for _ in range(3):
        assert beat(conn, node, up=False) == "offline"
    history = "select status from node_status_changes where node_id = %s order by id"
    assert [s for (s,) in conn.execute(history, (node,))][-1:] == ["offline"]
    assert conn.execute(history, (node,)).fetchall().count(("online",)) <= 1  # as registered, at most
    before = len(conn.execute(history, (node,)).fetchall())
    beat(conn, node, up=False)
    assert len(conn.execute(history, (node,)).fetchall()) == before


def test_a_server_restarted_with_another_model_is_not_sent_the_first_ones_requests(
    conn: psycopg.Connection,
) -> None:
    """Found as an owner: a llama-server restarted with another model kept the first one's row as
    'available', and was sent its requests (answered by the other model). An agent in front of a
    server that serves what it started with says it can load nothing else: [] forgets the rest."""
    node = agent_node(conn)
    models = "select model_id, state from node_models where node_id = %s order by model_id"
    call = "select status from agent_heartbeat(%s, %s, 'online', 0, null, null, %s, null, true, null, %s, null, null)"
    conn.execute(call, (node, KEY, ["model-a"], []))
    assert conn.execute(models, (node,)).fetchall() == [("model-a", "loaded")]
    conn.execute(call, (node, KEY, ["model-b"], []))
    assert conn.execute(models, (node,)).fetchall() == [("model-b", "loaded")]


def test_a_nodes_slots_follow_its_server_even_below_what_it_runs(conn: psycopg.Connection) -> None:
    """Found as an owner: a server restarted with another -np kept its node's first slot count.
    The heartbeat's specs carry the new one; lowered below the requests running, those end as they
    would and nothing new is claimed until the node has a free slot under the new count."""
    model = "meta-llama/Llama-3.1-8B-Instruct"
    node = agent_node(conn, max_concurrency=4)
    for _ in range(3):
        claimed = conn.execute("select node_id from match_job(%s, null, 'balanced')", (model,)).fetchone()
        assert claimed == (node,)
    specs = {"gpu_model": "NVIDIA L4", "gpu_count": 1, "vram_gb": 24, "tflops": 121}
    call = "select agent_heartbeat(%s, %s, 'online', 0, null, null, %s, %s, true, null)"
    lowered = conn.execute(call, (node, KEY, [model], Jsonb({**specs, "max_concurrency": 2}))).fetchone()
    assert lowered == ("busy",)
    assert conn.execute("select inflight, max_concurrency from nodes where id = %s", (node,)).fetchone() == (
        3,
        2,
    )
    refused = conn.execute("select node_id, error from match_job(%s, null, 'balanced')", (model,)).fetchone()
    assert refused is not None and refused[0] is None
    raised = conn.execute(call, (node, KEY, [model], Jsonb({**specs, "max_concurrency": 8}))).fetchone()
    assert raised == ("online",)
    claimed = conn.execute("select node_id from match_job(%s, null, 'balanced')", (model,)).fetchone()
    assert claimed == (node,)
    # Specs without a slot count leave it as it is; an impossible one is refused, nothing stored.
    assert conn.execute(call, (node, KEY, [model], Jsonb(specs))).fetchone() == ("online",)
    with pytest.raises(psycopg.errors.CheckViolation), conn.transaction():
        conn.execute(call, (node, KEY, [model], Jsonb({**specs, "max_concurrency": 0})))
    assert conn.execute("select max_concurrency from nodes where id = %s", (node,)).fetchone() == (8,)


def test_a_key_that_registers_a_node_is_in_use(conn: psycopg.Connection) -> None:
    """Found by an owner's trial: `keys ls` showed the key their nodes registered with as never used."""
    key = make_key(conn)
    conn.execute(
        "select register_node(null, 'box', 'NVIDIA L4', 1, 24, 121, 0.3, 'eu-west', null, null,"
        " 'http://127.0.0.1:9', 4, %s, null, %s, null)",
        (["meta-llama/Llama-3.1-8B-Instruct"], key),
    )
    used = conn.execute(
        "select last_used_at > now() - interval '1 minute' from api_keys where id = %s", (key,)
    )
    assert used.fetchone() == (True,)


def test_a_tunnel_node_is_online_only_while_its_tunnel_is_up_and_its_server_answers(
    conn: psycopg.Connection,
) -> None:
    node = agent_node(conn, endpoint_url="tunnel:box", status="offline")
    assert beat(conn, node, up=True) == "offline"  # no tunnel yet
    assert conn.execute("select set_tunnel(%s, true)", (node,)).fetchone() == ("online",)
    assert beat(conn, node, up=False) == "offline"  # the server died behind the tunnel
    assert beat(conn, node, up=True) == "online"  # back, and the tunnel is still up
    conn.execute("update nodes set status = 'offline' where id = %s", (node,))  # swept: beats came late
    assert beat(conn, node, up=True) == "online"
    assert conn.execute("select set_tunnel(%s, false)", (node,)).fetchone() == ("offline",)
    assert beat(conn, node, up=True) == "offline"
    with pytest.raises(psycopg.errors.NoDataFound, match="no tunnel node"):
        conn.execute("select set_tunnel(%s, true)", (agent_node(conn),))


def test_agents_of_the_earlier_version_still_beat(conn: psycopg.Connection) -> None:
    node = agent_node(conn)
    row = conn.execute(
        "select agent_heartbeat(%s, %s, 'online', 1, null, null, %s)", (node, KEY, ["m"])
    ).fetchone()
    assert row == ("online",)


def test_backend_must_be_a_small_json_object(conn: psycopg.Connection) -> None:
    node = agent_node(conn)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="JSON object"):
        beat(conn, node, up=True, backend=["not", "an", "object"])  # type: ignore[arg-type]
    with pytest.raises(psycopg.errors.CheckViolation, match="at most 4 kB"):
        beat(conn, node, up=True, backend={"kind": "x" * 5000})
    assert conn.execute("select backend from nodes where id = %s", (node,)).fetchone() == ({},)


def test_only_nodes_verified_to_continue_may_take_a_dropped_chat_stream(conn: psycopg.Connection) -> None:
    yes = make_node(conn, backend=Jsonb({"continues": True}))
    no = make_node(conn, backend=Jsonb({"continues": False}))
    unknown = make_node(conn)
    also = make_node(conn, backend=Jsonb({"continues": True}))
    row = conn.execute("select continuing_nodes(%s::uuid[])", ([unknown, also, no, yes],)).fetchone()
    assert row == ([also, yes],)


def test_reject_job_forgives_the_nodes_that_failed_the_request_the_same_way(conn: psycopg.Connection) -> None:
    first, second = make_node(conn, hourly_rate=0.1), make_node(conn, hourly_rate=0.2)
    key = conn.execute("select id from create_api_key('k')").fetchone()
    assert key is not None
    match = conn.execute(
        "select job_id, node_id, fallback_ids from match_job('meta-llama/Llama-3.1-8B-Instruct', %s)",
        (key[0],),
    ).fetchone()
    assert match is not None and match[1] == first
    error = "HTTP 500: {'error': 'temperature must be a number'}"
    moved = conn.execute("select node_id from failover_job(%s, %s, 500, %s)", (match[0], error, match[2]))
    assert moved.fetchone() == (second,)
    cooling = conn.execute("select failures, cooldown_until is not null from nodes where id = %s", (first,))
    assert cooling.fetchone() == (1, True)

    conn.execute("select reject_job(%s, %s, 500)", (match[0], error))
    rows = conn.execute(
        "select failures, consecutive_failures, cooldown_until, inflight from nodes where id = any(%s) order by hourly_rate",
        ([first, second],),
    ).fetchall()
    assert rows == [(0, 0, None, 0), (0, 0, None, 0)]
    job = conn.execute("select status, error, cost_usd from jobs where id = %s", (match[0],)).fetchone()
    assert job == ("cancelled", error, 0)
    attempts = conn.execute("select status from job_attempts where job_id = %s order by attempt", (match[0],))
    assert attempts.fetchall() == [("cancelled",), ("cancelled",)]
