"""place_jobs(): the gateway's placements grouped in one call (20261201000500_grouped_claims.sql).
Each request is placed as place_job() places it, in order; one that fails fails alone."""

from __future__ import annotations

import random
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from neuralgrid.db.matching import MatchRequest, score_nodes
from tests.conftest import LLAMA8, make_key, make_node
from tests.db.matching.test_fast_path import random_fleet, random_request

GATEWAY = uuid.UUID("00000000-0000-4000-8000-00000000000a")
PLACE_JOBS = (
    "select ord, job_id, node_id, busy, refusal, failure_state, failure from place_jobs(%s, %s) order by ord"
)


def request(key: uuid.UUID, **fields: Any) -> dict[str, Any]:
    return {
        "model": LLAMA8,
        "key": str(key),
        "policy": "balanced",
        "stream": False,
        "fallbacks": 2,
        "prompt_bytes": 100,
        "max_out": 16,
        "wait": True,
        "route": "chat/completions",
        **fields,
    }


def place_jobs(conn: psycopg.Connection, requests: list[dict[str, Any]]) -> list[Any]:
    return conn.execute(PLACE_JOBS, (str(GATEWAY), Jsonb(requests))).fetchall()


def test_each_request_is_placed_in_order_seeing_the_claims_before_it(conn: psycopg.Connection) -> None:
    first, second = make_node(conn, max_concurrency=1), make_node(conn, max_concurrency=1)
    key = make_key(conn)
    rows = place_jobs(conn, [request(key), request(key), request(key)])
    assert [row[0] for row in rows] == [1, 2, 3]
    placed = {rows[0][2], rows[1][2]}
    assert placed == {first, second}  # one slot each: the second request saw the first's claim
    assert rows[2][1:5] == (None, None, True, "busy")  # the third waits: nothing recorded for it
    jobs = conn.execute("select id, node_id, gateway_id from jobs order by created_at").fetchall()
    assert {(job[0], job[1]) for job in jobs} == {(rows[0][1], rows[0][2]), (rows[1][1], rows[1][2])}
    assert {job[2] for job in jobs} == {GATEWAY}


def test_a_request_that_fails_fails_alone(conn: psycopg.Connection) -> None:
    node = make_node(conn)
    key, broke = make_key(conn), make_key(conn, budget_usd=0)
    rows = place_jobs(conn, [request(key, end_user="alice"), request(broke), request(key, end_user="bob")])
    assert [row[2] for row in rows] == [node, None, node]
    assert rows[1][5] == "NG402" and "budget" in rows[1][6]
    assert rows[0][5] is None and rows[2][5] is None
    # Each placed job carries its own request's end user; the refused one recorded nothing.
    users = conn.execute("select id, end_user, api_key_id from jobs").fetchall()
    assert {(job[0], job[1]) for job in users} == {(rows[0][1], "alice"), (rows[2][1], "bob")}
    assert conn.execute("select inflight from nodes where id = %s", (node,)).fetchone() == (2,)


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ({"model": LLAMA8}, "JSON array"),
        ([{"model": LLAMA8}] * 17, "at most 16"),
    ],
)
def test_a_group_that_is_not_an_array_of_at_most_16_is_refused(
    conn: psycopg.Connection, requests: Any, message: str
) -> None:
    make_node(conn)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
        conn.execute(PLACE_JOBS, (str(GATEWAY), Jsonb(requests)))
    assert conn.execute("select count(*) from jobs").fetchone() == (0,)


def test_the_api_roles_cannot_place_jobs(conn: psycopg.Connection) -> None:
    for role in ("anon", "authenticated"):
        assert conn.execute(
            "select has_function_privilege(%s, 'public.place_jobs(text, jsonb)', 'execute')", (role,)
        ).fetchone() == (False,)
    assert conn.execute(
        "select has_function_privilege('service_role', 'public.place_jobs(text, jsonb)', 'execute')"
    ).fetchone() == (True,)


def test_a_later_request_does_not_wait_for_a_row_lock_behind_the_groups_own(
    conn: psycopg.Connection, db_url: str
) -> None:
    """Waiting for a node a completion holds while the group holds another could deadlock with that
    completion (which locks in id order): the request fails at once with 55P03, to be asked again."""
    first, second = make_node(conn, max_concurrency=1), make_node(conn, max_concurrency=1)
    key = make_key(conn)
    with psycopg.connect(db_url) as completion:  # holds one node's row, as complete_jobs() does
        locked = completion.execute("select id from nodes order by id limit 1 for no key update").fetchone()
        assert locked is not None
        rows = place_jobs(conn, [request(key), request(key)])
    free = ({first, second} - {locked[0]}).pop()
    assert rows[0][2] == free  # the first passed the locked node by
    assert rows[1][1:3] == (None, None) and rows[1][5] == "55P03"  # the second did not wait for it
    assert conn.execute("select count(*) from jobs").fetchone() == (1,)


PLACE_JOB = (
    "select node_id, fallback_ids, busy from place_job(%(model)s, %(key)s::uuid, %(policy)s,"
    " %(min_vram)s::real, %(region)s::text, %(lat)s::float8, %(lon)s::float8, %(max_rate)s::numeric,"
    " %(stream)s, %(fallbacks)s, %(prompt_bytes)s, %(max_out)s, %(wait)s, %(route)s::text)"
)


def ranked(key: uuid.UUID, asked: MatchRequest, fallbacks: int) -> dict[str, Any]:
    return request(
        key,
        model=asked.model,
        region=asked.region,
        lat=asked.latitude,
        lon=asked.longitude,
        max_rate=asked.max_hourly_rate,
        min_vram=None,
        fallbacks=fallbacks,
        route=None,
    )


@pytest.mark.parametrize("seed", range(8))
def test_a_group_places_as_the_same_requests_one_call_each_would(conn: psycopg.Connection, seed: int) -> None:
    """A request ranked like the one before it starts from that ranking, moved on by its claim: the
    nodes claimed and the fallbacks named are those of separate place_job() calls, on fleets below
    and above the ranking's limit of 32 (random loads, slots, outside load, cooldowns)."""
    rng = random.Random(seed)
    random_fleet(conn, rng, rng.choice([15, 90]))
    key = make_key(conn)
    first, second, fallbacks = random_request(rng), random_request(rng), rng.choice([0, 2, 3])
    while not score_nodes(conn, first, limit=1):  # one the fleet has room for
        first = random_request(rng)
    asked = (
        [ranked(key, first, fallbacks)] * 10
        + [ranked(key, second, 1)] * 2
        + [ranked(key, first, fallbacks)] * 4
    )
    with conn.transaction(force_rollback=True):  # both from the same fleet
        grouped = conn.execute(
            "select node_id, fallback_ids, busy from place_jobs(%s, %s) order by ord",
            (str(GATEWAY), Jsonb(asked)),
        ).fetchall()
    with conn.transaction(force_rollback=True):
        one_by_one = [conn.execute(PLACE_JOB, params).fetchone() for params in asked]
    assert grouped == one_by_one
    assert any(row is not None and row[0] for row in one_by_one)  # the fleet had room for some


def test_like_requests_in_a_group_rank_the_fleet_once(conn: psycopg.Connection) -> None:
    for _ in range(4):
        make_node(conn, max_concurrency=8)
    key = make_key(conn)
    conn.execute("set track_functions = 'pl'")
    with conn.transaction(force_rollback=True):
        rows = place_jobs(conn, [request(key)] * 8 + [request(key, fallbacks=1)] * 2)
        assert all(row[2] is not None for row in rows)
        calls = conn.execute(
            "select calls from pg_stat_xact_user_functions where funcname = 'score_nodes'"
        ).fetchone()
    assert calls == (2,)  # once for the eight, once for the two asking another number of fallbacks
