"""The routes a node serves (nodes.routes): stored from what its agent reports, and a hard filter of
the matcher, in the full scan and the fast path alike (20261128000100_node_routes.sql)."""

from __future__ import annotations

import random
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from neuralgrid.db.matching import MatchRequest, score_nodes
from neuralgrid.protocol.routes import DEFAULT_ROUTES, ECHO, MATCHED, ROUTES
from tests.conftest import LLAMA8, make_key, make_node
from tests.db.matching.test_fast_path import full_scan, random_fleet, random_request

RERANKING = ["rerank", "score"]
PLACE_JOB = (
    "select node_id, error, busy, refusal from place_job(%s, %s, 'balanced', null, null, null, null, null,"
    " false, 3, 100, 16, %s, %s)"
)


def routes_of(conn: psycopg.Connection, node: uuid.UUID) -> list[str]:
    row = conn.execute("select routes from nodes where id = %s", (node,)).fetchone()
    assert row is not None
    return list(row[0])


def place(conn: psycopg.Connection, route: str | None, *, wait: bool = False) -> tuple[Any, ...]:
    row = conn.execute(PLACE_JOB, (LLAMA8, make_key(conn), wait, route)).fetchone()
    assert row is not None
    return tuple(row)


def test_a_node_that_never_said_serves_the_routes_every_node_served_before(conn: psycopg.Connection) -> None:
    node = make_node(conn)
    assert routes_of(conn, node) == list(DEFAULT_ROUTES)
    # An agent that reports its server without routes (an earlier version) changes nothing.
    conn.execute("update nodes set backend = %s where id = %s", (Jsonb({"kind": "vllm"}), node))
    assert routes_of(conn, node) == list(DEFAULT_ROUTES)


def test_the_routes_an_agent_reports_are_the_nodes_and_unknown_ones_are_refused(
    conn: psycopg.Connection,
) -> None:
    node = make_node(conn, backend=Jsonb({"kind": "llama.cpp", "routes": ["chat/completions", "responses"]}))
    assert routes_of(conn, node) == ["chat/completions", "responses"]
    conn.execute(
        "update nodes set backend = %s where id = %s", (Jsonb({"kind": "vllm", "routes": RERANKING}), node)
    )
    assert routes_of(conn, node) == RERANKING
    conn.execute(
        "update nodes set backend = %s where id = %s", (Jsonb({"kind": "vllm", "routes": None}), node)
    )
    assert routes_of(conn, node) == RERANKING  # null: not said, kept
    bad: list[Any] = [["rerank", "teleport"], [], ["rerank", None], "rerank", [1]]
    for routes in bad:
        with pytest.raises(psycopg.errors.CheckViolation), conn.transaction():
            conn.execute(
                "update nodes set backend = %s where id = %s",
                (Jsonb({"kind": "vllm", "routes": routes}), node),
            )
    assert routes_of(conn, node) == RERANKING


def test_sql_knows_exactly_the_routes_python_knows(conn: psycopg.Connection) -> None:
    for route in MATCHED:
        # The echo route is a server's that echoes, serving completions (derived, not written).
        echoes = {"routes": ["completions"], "backend": Jsonb({"kind": "vllm", "echoes": True})}
        make_node(conn, **(echoes if route == ECHO else {"routes": [route]}))
        with conn.transaction(force_rollback=True):
            conn.execute("update nodes set status = 'offline'")
            assert place(conn, route)[3] == "none"  # a known route: placed (or refused) as any other
    with pytest.raises(psycopg.errors.CheckViolation):
        make_node(conn, routes=["v1/rerank"])


def test_a_route_goes_only_to_nodes_serving_it_and_the_others_say_why(conn: psycopg.Connection) -> None:
    reranker = make_node(conn, "reranker", routes=RERANKING)
    chat = make_node(conn, "chat")
    both = make_node(conn, "both", routes=[*DEFAULT_ROUTES, "rerank"])
    request = MatchRequest(model=LLAMA8, route="rerank")
    assert {r.node_id for r in score_nodes(conn, request, limit=5)} == {reranker, both}
    explained = {r.name: r.reject_reason for r in score_nodes(conn, request, explain=True)}
    assert explained == {"reranker": None, "both": None, "chat": "does not serve /v1/rerank"}
    # No route: any node, as before routes.
    assert {r.node_id for r in score_nodes(conn, MatchRequest(model=LLAMA8), limit=5)} == {
        reranker,
        chat,
        both,
    }
    assert {r.node_id for r in score_nodes(conn, MatchRequest(model=LLAMA8, route="chat/completions"))} == {
        chat,
        both,
    }
    # The seed policy binds the route too (its other filters are the original's two).
    seed = MatchRequest(model=LLAMA8, policy="seed", route="score")
    assert [r.node_id for r in score_nodes(conn, seed)] == [reranker]


def test_place_job_tells_no_node_serving_the_route_from_none_online_and_busy(
    conn: psycopg.Connection,
) -> None:
    make_node(conn, "chat")
    node, error, busy, refusal = place(conn, "rerank")
    assert (node, busy, refusal) == (None, False, "route")
    assert error == f"no online node serves /v1/rerank for {LLAMA8}"
    failed = conn.execute("select status, error from jobs order by created_at desc limit 1").fetchone()
    assert failed == ("failed", error)
    # Asked to wait, it still says so at once: no slot will make a node serve another route.
    assert place(conn, "rerank", wait=True)[2:] == (False, "route")

    reranker = make_node(conn, "reranker", routes=RERANKING, max_concurrency=1, inflight=1)
    assert place(conn, "rerank", wait=True)[2:] == (True, "busy")  # it serves the route: worth the wait
    conn.execute("update nodes set inflight = 0 where id = %s", (reranker,))
    assert place(conn, "rerank")[0] == reranker
    assert place(conn, "responses")[3] == "route"
    conn.execute("update nodes set status = 'offline'")
    assert place(conn, "rerank")[3] == "none"
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="unknown route"):
        place(conn, "/v1/rerank")


def test_gateways_before_routes_keep_their_answers(conn: psycopg.Connection) -> None:
    """place_job() without a route (13 arguments) and match_job() place on any node, as before."""
    reranker = make_node(conn, "reranker", routes=RERANKING)
    key = make_key(conn)
    row = conn.execute(
        "select node_id, busy from place_job(%s, %s, 'balanced', null, null, null, null, null, false, 3,"
        " 100, 16, false)",
        (LLAMA8, key),
    ).fetchone()
    assert row == (reranker, False)
    assert conn.execute("select node_id from match_job(%s)", (LLAMA8,)).fetchone() == (reranker,)


def test_the_fast_path_equals_the_full_scan_with_routes(conn: psycopg.Connection) -> None:
    rng = random.Random(19)
    random_fleet(conn, rng, 150)
    # A third serve the default three, the rest some random mix.
    for (node,) in conn.execute("select id from nodes").fetchall():
        if rng.random() < 0.66:
            routes = rng.sample(ROUTES, rng.randint(1, 4))
            conn.execute("update nodes set routes = %s where id = %s", (routes, node))
    for _ in range(150):
        base, k = random_request(rng), rng.randint(1, 40)
        request = MatchRequest(**{**base.__dict__, "route": rng.choice([None, *MATCHED])})
        fast = score_nodes(conn, request, limit=k)
        slow = full_scan(conn, request, k)
        assert [r.node_id for r in fast] == [r.node_id for r in slow], request
        assert all(r.score == pytest.approx(s.score, abs=1e-12) for r, s in zip(fast, slow, strict=True))


def test_the_fast_path_equals_the_full_scan_with_routes_under_vram_pressure(conn: psycopg.Connection) -> None:
    """The reserve's per-tier walks (top_by_total) filter on the route too."""
    rng = random.Random(23)
    random_fleet(conn, rng, 120)
    for (node,) in conn.execute("select id from nodes").fetchall():
        conn.execute("update nodes set routes = %s where id = %s", (rng.sample(ROUTES, 2), node))
    conn.execute(
        "insert into private.vram_pressure (level_gb, busy, slots, pressure)"
        " select distinct min_vram_gb, 1, 1, 0.8 from models"
    )
    for _ in range(80):
        request = MatchRequest(model=LLAMA8, route=rng.choice(ROUTES))
        k = rng.randint(1, 20)
        assert [r.node_id for r in score_nodes(conn, request, limit=k)] == [
            r.node_id for r in full_scan(conn, request, k)
        ]


def test_a_node_serves_echo_when_its_agent_found_its_server_echoes_and_only_then(
    conn: psycopg.Connection,
) -> None:
    """The echo route is derived from backend.echoes, whoever writes the routes, and needs completions."""
    vllm = {"kind": "vllm", "routes": ["chat/completions", "completions"]}
    node = make_node(conn, backend=Jsonb({**vllm, "echoes": True}))
    assert routes_of(conn, node) == ["chat/completions", "completions", ECHO]
    conn.execute("update nodes set backend = %s where id = %s", (Jsonb({**vllm, "echoes": False}), node))
    assert routes_of(conn, node) == ["chat/completions", "completions"]
    # Listed by an agent, or written alone, it is not served unless the server echoes.
    listed = {**vllm, "routes": ["completions", ECHO]}
    conn.execute("update nodes set backend = %s where id = %s", (Jsonb(listed), node))
    assert routes_of(conn, node) == ["completions"]
    conn.execute("update nodes set routes = %s where id = %s", (["completions", ECHO], node))
    assert routes_of(conn, node) == ["completions"]
    # An agent that no longer says its routes keeps them, and echo still follows what it found.
    conn.execute(
        "update nodes set backend = %s where id = %s", (Jsonb({"kind": "vllm", "echoes": True}), node)
    )
    assert routes_of(conn, node) == ["completions", ECHO]
    # No completions, no echo.
    chat = {"kind": "vllm", "routes": ["chat/completions"], "echoes": True}
    conn.execute("update nodes set backend = %s where id = %s", (Jsonb(chat), node))
    assert routes_of(conn, node) == ["chat/completions"]


def test_echo_requests_go_only_to_nodes_that_echo(conn: psycopg.Connection) -> None:
    make_node(conn, "ignores", backend=Jsonb({"kind": "llama.cpp", "echoes": False}), hourly_rate=0.1)
    echoes = make_node(conn, "echoes", backend=Jsonb({"kind": "vllm", "echoes": True}), hourly_rate=5)
    assert place(conn, "completions")[0] != echoes  # the cheaper one, for a plain completion
    assert place(conn, ECHO)[0] == echoes
    conn.execute("update nodes set status = 'offline' where id = %s", (echoes,))
    node, error, _, refusal = place(conn, ECHO, wait=True)
    assert (node, refusal) == (None, "route") and error == f"no online node serves /v1/{ECHO} for {LLAMA8}"
