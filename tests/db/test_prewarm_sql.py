"""Pre-warm in SQL: demand per (model, region) from recent jobs, the idle capable node a heartbeat
asks to load a model, one request per (model, region) per interval and per node at a time, and every
request's outcome recorded where owners (only theirs) can read it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.conftest import LLAMA8, make_node, make_user

SECRET = "ngn-prewarm-secret"
KEY = hashlib.sha256(SECRET.encode()).digest()
SMALL = "meta-llama/Llama-3.2-3B-Instruct"  # 8 GB in the catalog
BEAT = (
    "select status, load from agent_heartbeat(%s, %s, %s, %s, null, %s::real, %s::text[], null, %s, null,"
    " %s::text[], %s::text[], %s::jsonb)"
)
REQUESTS = "select model_id, region, outcome, reason from prewarm_requests where node_id = %s order by id"


@pytest.fixture(autouse=True)
def demand_every_beat(conn: psycopg.Connection) -> None:
    """Demand recomputed at every heartbeat (at most every 10 s by default)."""
    conn.execute("update platform_settings set prewarm_refresh_s = 0")


def node(conn: psycopg.Connection, models: dict[str, str] | None = None, **fields: Any) -> UUID:
    """A node an agent heartbeats for, holding SMALL unloaded (it can load it) unless told otherwise."""
    return make_node(conn, models=models or {SMALL: "available"}, secret_hash=KEY, **fields)


def beat(
    conn: psycopg.Connection,
    node_id: UUID,
    loaded: list[str] | None = None,
    *,
    status: str = "online",
    queue: int = 0,
    free_vram: float | None = None,
    up: bool = True,
    available: list[str] | None = None,
    done: list[str] | None = None,
    refused: Any = None,
) -> tuple[str, list[str]]:
    """One heartbeat as the gateway sends it; (the node's status, the models it should load)."""
    row = conn.execute(
        BEAT,
        (
            node_id,
            KEY,
            status,
            queue,
            free_vram,
            loaded or [],
            up,
            available,
            done,
            None if refused is None else Jsonb(refused),
        ),
    ).fetchone()
    assert row is not None
    return str(row[0]), list(row[1])


def place(conn: psycopg.Connection, model: str = SMALL, region: str | None = "eu-west") -> tuple[Any, ...]:
    """A request through the matcher, answered at once where a node took it: (job, node, error)."""
    row = conn.execute(
        "select job_id, node_id, error from match_job(%s, null, 'balanced', null, %s)", (model, region)
    ).fetchone()
    assert row is not None
    if row[1] is not None:
        conn.execute("select complete_job(%s)", (row[0],))
    return tuple(row)


def requests(conn: psycopg.Connection, node_id: UUID) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(REQUESTS, (node_id,)).fetchall()]


def test_demand_with_no_warm_node_asks_an_idle_capable_node_to_load(conn: psycopg.Connection) -> None:
    capable = node(conn, status="offline")  # away when the requests came
    for _ in range(3):  # refused: no node online holds the model
        assert place(conn)[2] == f"no capable node is online for {SMALL}"
    assert beat(conn, capable) == ("online", [SMALL])
    assert requests(conn, capable) == [(SMALL, "eu-west", "requested", None)]
    # Said again until the agent answers, never recorded twice.
    assert beat(conn, capable) == ("online", [SMALL])
    assert len(requests(conn, capable)) == 1
    # Loaded: reported warm in the next beat; nothing more to do.
    assert beat(conn, capable, [SMALL], done=[SMALL]) == ("online", [])
    assert requests(conn, capable) == [(SMALL, "eu-west", "loaded", None)]
    state = conn.execute("select state from node_models where node_id = %s", (capable,)).fetchone()
    assert state == ("loaded",)


def test_cold_placements_are_recorded_and_count_as_unmet_demand(conn: psycopg.Connection) -> None:
    warm = node(conn, {LLAMA8: "loaded"}, vram_gb=24)
    cold = node(conn, {SMALL: "available"})
    spare = node(conn, {SMALL: "available"}, region="us-east", tflops=50)  # the matcher's second choice
    warm_job, on, _ = place(conn, LLAMA8)
    cold_job, on_cold, _ = place(conn, SMALL, None)  # no region asked: the node's region is the demand's
    refused_job = place(conn, "Qwen/Qwen2.5-14B-Instruct", None)[0]
    assert (on, on_cold) == (warm, cold)
    flags: dict[UUID, bool | None] = dict(conn.execute("select id, cold_start from jobs").fetchall())
    assert flags == {warm_job: False, cold_job: True, refused_job: None}
    assert beat(conn, cold) == ("online", [SMALL])
    # The demand was in eu-west: a node elsewhere is not asked.
    assert beat(conn, spare) == ("online", [])
    demand = conn.execute("select model_id, region, requests, wanted from private.prewarm_demand").fetchall()
    assert {row[0]: row[1:] for row in demand} == {
        "Qwen/Qwen2.5-14B-Instruct": (None, 1, True),  # refused, and asked of no region
        SMALL: ("eu-west", 1, True),
        LLAMA8: ("eu-west", 1, False),  # served warm, with warm slots to spare
    }


def test_no_demand_no_request(conn: psycopg.Connection) -> None:
    idle = node(conn)
    assert beat(conn, idle) == ("online", [])
    place(conn, SMALL, "ap-south")  # demand elsewhere: refused there, not this node's to answer
    place(conn, LLAMA8)  # a model this node does not hold
    assert beat(conn, idle) == ("online", [])
    assert requests(conn, idle) == []


@pytest.mark.parametrize(
    ("fields", "beat_args"),
    [
        ({"inflight": 1}, {}),  # a request of ours running
        ({}, {"queue": 1}),  # its server busy with someone else's
        ({"vram_gb": 6}, {}),  # too small for the model (8 GB)
        ({}, {"free_vram": 4.0}),  # big enough, but the VRAM is taken
        ({"cooldown_until": "infinity"}, {}),  # cooling down after failures
        ({}, {"status": "draining"}),
        ({}, {"up": False}),  # its server does not answer
    ],
    ids=["inflight", "queued", "small", "no-free-vram", "cooling", "draining", "server-down"],
)
def test_a_busy_small_or_unwell_node_is_never_asked(
    conn: psycopg.Connection, fields: dict[str, Any], beat_args: dict[str, Any]
) -> None:
    place(conn)  # refused: demand for SMALL in eu-west, and no warm node
    unfit = node(conn, **fields)
    assert beat(conn, unfit, **beat_args)[1] == []
    assert requests(conn, unfit) == []
    # The same node idle and well is asked.
    conn.execute("update nodes set inflight = 0, vram_gb = 24, cooldown_until = null where id = %s", (unfit,))
    assert beat(conn, unfit, free_vram=12.0) == ("online", [SMALL])


def test_one_pre_load_per_model_and_region_per_interval_and_one_per_node(conn: psycopg.Connection) -> None:
    other = "Qwen/Qwen2.5-0.5B-Instruct"
    first = node(conn, {SMALL: "available", other: "available"})
    second = node(conn)
    place(conn)
    assert beat(conn, first) == ("online", [SMALL])
    assert beat(conn, second) == ("online", [])  # SMALL in eu-west was asked for this interval
    place(conn, other)
    # One open request per node: the first is asked for nothing else until it answers.
    assert beat(conn, first) == ("online", [SMALL])
    assert [r[0] for r in requests(conn, first)] == [SMALL]
    # An interval later, demand still unmet: the next node is asked.
    place(conn)
    conn.execute("update private.prewarm_demand set last_requested_at = now() - interval '61 seconds'")
    assert beat(conn, second) == ("online", [SMALL])
    assert beat(conn, first, [SMALL], done=[SMALL]) == ("online", [other])


def test_warm_capacity_that_keeps_up_wants_no_more(conn: psycopg.Connection) -> None:
    warm = node(conn, {SMALL: "loaded"}, max_concurrency=1)
    spare = node(conn)
    job, on, _ = place(conn)
    assert on == warm
    assert beat(conn, warm, [SMALL]) == ("online", [])
    assert beat(conn, spare) == ("online", [])  # one warm slot, used a second in five minutes
    # Busy most of the window (Little's law: 250 slot-seconds of 300 on one slot): one more wanted.
    conn.execute("update jobs set latency_ms = 250000 where id = %s", (job,))
    assert beat(conn, spare) == ("online", [SMALL])


def test_demand_is_computed_at_most_every_refresh_interval(conn: psycopg.Connection) -> None:
    conn.execute("update platform_settings set prewarm_refresh_s = 60")
    conn.execute("update private.prewarm_clock set refreshed_at = now()")
    idle = node(conn)
    place(conn)
    assert beat(conn, idle) == ("online", [])  # the demand table is not a minute old: not recomputed
    assert conn.execute("select count(*) from private.prewarm_demand").fetchone() == (0,)
    conn.execute("update private.prewarm_clock set refreshed_at = now() - interval '61 seconds'")
    assert beat(conn, idle) == ("online", [SMALL])


def test_refusals_and_silence_are_recorded(conn: psycopg.Connection) -> None:
    one_model = node(conn)
    silent = node(conn, region="us-east")
    place(conn)
    place(conn, region="us-east")
    assert beat(conn, one_model) == ("online", [SMALL])
    assert beat(conn, silent) == ("online", [SMALL])
    refused = [{"model": SMALL, "reason": "server serves one model"}]
    assert beat(conn, one_model, refused=refused) == ("online", [])
    assert requests(conn, one_model) == [(SMALL, "eu-west", "refused", "server serves one model")]
    # Not asked for that model again soon, however much it is wanted.
    place(conn)
    conn.execute("update private.prewarm_demand set last_requested_at = null")
    assert beat(conn, one_model) == ("online", [])
    # An agent that never answers (one from before pre-warm): its request expires, and it is not
    # asked for that model again for as long as one that refused.
    earlier = "update prewarm_requests set requested_at = requested_at - %s * interval '1 second' where node_id = %s"
    conn.execute(earlier, (301, silent))
    conn.execute("select private.refresh_prewarm_demand()")
    assert requests(conn, silent) == [(SMALL, "us-east", "expired", None)]
    assert beat(conn, silent) == ("online", [])
    conn.execute(earlier, (3600, silent))
    assert beat(conn, silent) == ("online", [SMALL])


def test_bad_answers_are_refused_and_change_nothing(conn: psycopg.Connection) -> None:
    idle = node(conn)
    place(conn)
    assert beat(conn, idle) == ("online", [SMALL])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="JSON array"):
        beat(conn, idle, refused={"model": SMALL})
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="JSON array"):
        beat(conn, idle, refused=[{"model": SMALL, "reason": 7}])
    with pytest.raises(psycopg.errors.CheckViolation, match="a refusal says why"):
        beat(conn, idle, refused=[{"model": SMALL, "reason": "x" * 201}])
    with pytest.raises(psycopg.errors.CheckViolation, match="a refusal says why"):
        beat(conn, idle, refused=[{"model": SMALL, "reason": " "}])
    assert requests(conn, idle) == [(SMALL, "eu-west", "requested", None)]


def test_the_models_a_server_can_load_are_held_as_available(conn: psycopg.Connection) -> None:
    box = node(conn, {LLAMA8: "loaded", "old/gone": "available"})
    models = "select model_id, state from node_models where node_id = %s order by model_id"
    beat(conn, box, [LLAMA8], available=[SMALL, LLAMA8])
    assert dict(conn.execute(models, (box,)).fetchall()) == {SMALL: "available", LLAMA8: "loaded"}
    beat(conn, box, [SMALL], available=[LLAMA8])  # it swapped one for the other
    assert dict(conn.execute(models, (box,)).fetchall()) == {SMALL: "loaded", LLAMA8: "available"}
    beat(conn, box, [SMALL])  # an agent that does not say leaves them be
    assert dict(conn.execute(models, (box,)).fetchall()) == {SMALL: "loaded", LLAMA8: "available"}
    with pytest.raises(psycopg.errors.CheckViolation, match="model_id must not be empty"):
        beat(conn, box, [SMALL], available=[" "])


@pytest.fixture
def owners(conn: psycopg.Connection) -> Iterator[dict[str, UUID]]:
    """Alice's node and Bob's, each asked to pre-load once."""
    alice, bob = make_user(conn, "alice@example.test"), make_user(conn, "bob@example.test")
    alice_node, bob_node = node(conn, owner_id=alice), node(conn, owner_id=bob, region="us-east")
    place(conn)
    place(conn, region="us-east")
    assert beat(conn, alice_node)[1] == beat(conn, bob_node)[1] == [SMALL]
    yield {"alice": alice, "bob": bob, "alice_node": alice_node}


def acting_as(conn: psycopg.Connection, role: str, user: UUID | None = None) -> None:
    claims = {"role": role, **({"sub": str(user)} if user else {})}
    conn.execute("select set_config('request.jwt.claims', %s, true)", (json.dumps(claims),))
    conn.execute(psycopg.sql.SQL("set local role {}").format(psycopg.sql.Identifier(role)))


def test_owners_see_only_their_own_nodes_requests(conn: psycopg.Connection, owners: dict[str, UUID]) -> None:
    with conn.transaction(force_rollback=True):
        acting_as(conn, "authenticated", owners["alice"])
        rows = conn.execute("select node_id, model_id, outcome from prewarm_requests").fetchall()
        assert rows == [(owners["alice_node"], SMALL, "requested")]
    with conn.transaction(force_rollback=True):
        acting_as(conn, "authenticated", owners["bob"])
        assert conn.execute("select count(*) from prewarm_requests").fetchone() == (1,)
        # Owners read; the platform alone writes.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                "insert into prewarm_requests (node_id, model_id) values (%s, %s)",
                (owners["alice_node"], SMALL),
            )
    with conn.transaction(force_rollback=True):
        acting_as(conn, "authenticated", make_user(conn))
        assert conn.execute("select count(*) from prewarm_requests").fetchone() == (0,)
    with conn.transaction(force_rollback=True):
        acting_as(conn, "anon")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("select count(*) from prewarm_requests")
    with conn.transaction(force_rollback=True):
        acting_as(conn, "authenticated", owners["alice"])
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("select count(*) from private.prewarm_demand")
