"""Slot leases (issue 42, docs/scaling.md "Far from the database: leases"): renew_leases() claims
slots as placements claim them, so that nothing overbooks a node; shares a lane's slots fairly among
the gateways that want them; gives back only idle slots; and the sweep frees what a lease that ended,
or a gateway that died, held."""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from neuralgrid.db import queries as q
from neuralgrid.db.store import SyncStore
from tests.conftest import LLAMA8, make_key, make_node

A, B, C, D = (uuid.UUID(f"00000000-0000-4000-8000-00000000000{i}") for i in (1, 2, 3, 4))


def lane(want: int, in_use: dict[uuid.UUID, int] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "model": LLAMA8,
        "policy": "balanced",
        "region": None,
        "want": want,
        "in_use": {str(node): count for node, count in (in_use or {}).items()},
        **extra,
    }


def renew(conn: psycopg.Connection, gateway: uuid.UUID, *lanes: dict[str, Any]) -> list[q.LeaseRow]:
    return SyncStore(conn).all(q.RENEW_LEASES, (gateway, json.dumps(list(lanes))))


def held(leases: list[q.LeaseRow]) -> dict[uuid.UUID, int]:
    """The slots leased per node (not the fallbacks: rows of no slot)."""
    return {lease.node_id: lease.slots for lease in leases if lease.slots}


def leases(conn: psycopg.Connection) -> dict[tuple[uuid.UUID, uuid.UUID], tuple[int, int]]:
    """Every lease row: (gateway, node) -> (slots, in use)."""
    rows = conn.execute("select gateway_id, node_id, slots, in_use from private.slot_leases").fetchall()
    return {(g, n): (s, u) for g, n, s, u in rows}


def inflight(conn: psycopg.Connection) -> dict[uuid.UUID, int]:
    return dict(conn.execute("select id, inflight from nodes").fetchall())


def assert_slots_add_up(conn: psycopg.Connection) -> None:
    """inflight == the slots leased on the node + its running attempts that are not leased, and never
    more than max_concurrency."""
    rows = conn.execute(
        """select n.id, n.inflight, n.max_concurrency,
                  coalesce((select sum(l.slots) from private.slot_leases l where l.node_id = n.id), 0),
                  (select count(*) from job_attempts a where a.node_id = n.id and a.status = 'running'
                   and not a.leased)
           from nodes n"""
    ).fetchall()
    for node, taken, most, leased, placed in rows:
        assert taken == leased + placed, node
        assert taken <= most, node


def test_a_renewal_claims_slots_on_the_best_nodes_and_returns_them_ranked(conn: psycopg.Connection) -> None:
    fast = make_node(conn, "fast", tflops=300, max_concurrency=4)
    slow = make_node(conn, "slow", tflops=50, max_concurrency=4)
    got = renew(conn, A, lane(5))
    assert held(got) == {fast: 4, slow: 1}
    assert [(lease.node_id, lease.rank) for lease in got] == [(fast, 1), (slow, 2)]
    first = got[0]
    assert (first.model_id, first.policy, first.region, first.in_use) == (LLAMA8, "balanced", "", 0)
    assert first.endpoint_url == "http://127.0.0.1:9/" and first.routes
    assert inflight(conn) == {fast: 4, slow: 1}
    # Full of leased slots, it stays online: the gateway holding them sends it requests.
    assert conn.execute("select status from nodes where id = %s", (fast,)).fetchone() == ("online",)
    # The lease ends lease_s from now; the renewal checked the gateway in.
    (ends,) = conn.execute(
        "select extract(epoch from %s - now()) from private.slot_leases limit 1", (first.expires_at,)
    ).fetchone() or (0,)
    assert float(ends) == pytest.approx(5, abs=0.5)
    assert conn.execute("select count(*) from private.gateways where id = %s", (A,)).fetchone() == (1,)
    # Renewed again with the same want, nothing moves.
    assert held(renew(conn, A, lane(5))) == {fast: 4, slow: 1}
    assert_slots_add_up(conn)


def test_after_the_leases_come_the_lanes_best_nodes_it_holds_nothing_on(conn: psycopg.Connection) -> None:
    fast = make_node(conn, "fast", tflops=300, max_concurrency=4)
    slow = make_node(conn, "slow", tflops=50, max_concurrency=4)
    got = renew(conn, A, lane(2))
    # Two slots on the best node; the other ranked after it with none: where a failed job may move.
    assert [(row.node_id, row.slots, row.rank) for row in got] == [(fast, 2, 1), (slow, 0, 2)]
    assert inflight(conn) == {fast: 2, slow: 0}
    # A node with no free slot left is no fallback (a move there could not claim one).
    conn.execute("update nodes set inflight = max_concurrency, status = 'busy' where id = %s", (slow,))
    assert [(row.node_id, row.slots) for row in renew(conn, A, lane(2))] == [(fast, 2)]


def test_three_gateways_share_a_lane_in_proportion_to_what_they_want(conn: psycopg.Connection) -> None:
    """2:1:1 of 8 slots: 4, 2 and 2 after two rounds, whoever came first."""
    nodes = [make_node(conn, max_concurrency=2) for _ in range(4)]
    wants = {A: 8, B: 4, C: 4}
    for _ in range(2):
        got = {
            gateway: sum(held(renew(conn, gateway, lane(want))).values()) for gateway, want in wants.items()
        }
    assert got == {A: 4, B: 2, C: 2}
    assert sum(inflight(conn)[node] for node in nodes) == 8
    assert_slots_add_up(conn)
    # One of them wants less: the others' shares grow (within two rounds again) to what they want.
    wants.update({A: 1, B: 4, C: 3})
    for _ in range(2):
        got = {
            gateway: sum(held(renew(conn, gateway, lane(want))).values()) for gateway, want in wants.items()
        }
    assert got == wants
    assert_slots_add_up(conn)


@pytest.mark.parametrize(
    ("capacity", "wants"),
    [(2, (1, 1, 1)), (7, (6, 3, 3)), (16, (5, 9, 13, 19)), (16, (4, 8, 12, 18)), (5, (9, 1))],
)
def test_left_over_slots_rotate_so_that_shares_are_exact_over_a_sweep(
    conn: psycopg.Connection, capacity: int, wants: tuple[int, ...]
) -> None:
    """The floors of the shares C x want / W, then the slots left rotate as the turn sweeps [0, 1):
    at every turn the targets add up to the lane's slots exactly (never above), and over a sweep
    each gateway's is its share (rounded once and for all, the smallest gateway of 4, 8, 12 and 18
    callers got 2 of 16 slots, 31% above its share of 1.52)."""
    gateways = [uuid.UUID(int=i + 1) for i in range(len(wants))]
    make_node(conn, max_concurrency=capacity)
    for g, want in zip(gateways, wants, strict=True):
        renew(conn, g, lane(want))
    turns = [i / 1000 for i in range(1000)]
    targets = {
        g: [
            conn.execute(
                "select private.lane_target(%s, %s, 'balanced', '', %s::int, %s::numeric)",
                (g, LLAMA8, capacity, turn),
            ).fetchone()[0]  # type: ignore[index]
            for turn in turns
        ]
        for g in gateways
    }
    for at in range(len(turns)):
        assert sum(target[at] for target in targets.values()) == capacity
    for g, want in zip(gateways, wants, strict=True):
        share = capacity * want / sum(wants)
        assert set(targets[g]) <= {math.floor(share), math.ceil(share)}
        assert sum(targets[g]) / len(turns) == pytest.approx(share, abs=0.002)
        # One stretch of the sweep each (a slot changes hands once a sweep, not at every renewal).
        changes = sum(a != b for a, b in zip(targets[g], targets[g][1:] + targets[g][:1], strict=True))
        assert changes <= 2
    # Wanting less than the lane holds, everyone gets what it wants, at every turn.
    renew(conn, gateways[0], lane(1))
    assert conn.execute(
        "select private.lane_target(%s, %s, 'balanced', '', 100)", (gateways[0], LLAMA8)
    ).fetchone() == (1,)


def test_a_renewal_gives_back_only_idle_slots_lowest_ranked_first(conn: psycopg.Connection) -> None:
    fast = make_node(conn, "fast", tflops=300, max_concurrency=4)
    slow = make_node(conn, "slow", tflops=50, max_concurrency=4)
    assert held(renew(conn, A, lane(8))) == {fast: 4, slow: 4}
    # Wants 1, but 3 are in use on the fast node and 2 on the slow one: only idle slots go back,
    # the slow node's first. The rest drain: held, but the gateway may use only the 1 it wants.
    assert held(renew(conn, A, lane(1, {fast: 3, slow: 2}))) == {fast: 1}
    assert leases(conn) == {(A, fast): (3, 3), (A, slow): (2, 2)}
    assert inflight(conn) == {fast: 3, slow: 2}
    # One ends on the slow node: its slot goes back, the lease's last one.
    assert held(renew(conn, A, lane(1, {fast: 3, slow: 1}))) == {fast: 1}
    assert leases(conn) == {(A, fast): (3, 3), (A, slow): (1, 1)}
    assert held(renew(conn, A, lane(1, {fast: 1}))) == {fast: 1}
    assert inflight(conn) == {fast: 1, slow: 0}
    assert conn.execute("select status from nodes where id = %s", (fast,)).fetchone() == ("online",)
    assert_slots_add_up(conn)


def test_a_lane_no_longer_reported_is_given_back(conn: psycopg.Connection) -> None:
    node = make_node(conn, max_concurrency=4, models={LLAMA8: "loaded", "acme/other-7b": "loaded"})
    renew(conn, A, lane(2), lane(1, model="acme/other-7b"))
    assert inflight(conn) == {node: 3}
    assert {lease.model_id for lease in renew(conn, A, lane(2))} == {LLAMA8}
    assert inflight(conn) == {node: 2}
    assert conn.execute(
        "select count(*) from private.lane_demand where model_id <> %s", (LLAMA8,)
    ).fetchone() == (0,)
    assert renew(conn, A) == [] and inflight(conn) == {node: 0} and leases(conn) == {}


def test_a_node_cooling_down_is_not_returned_and_its_idle_slots_go_back(conn: psycopg.Connection) -> None:
    bad = make_node(conn, "bad", tflops=300, max_concurrency=4)
    good = make_node(conn, "good", tflops=50, max_concurrency=4)
    assert held(renew(conn, A, lane(6))) == {bad: 4, good: 2}
    conn.execute("update nodes set cooldown_until = now() + interval '1 minute' where id = %s", (bad,))
    # One request still runs on the cooling node: its slot stays held, the node is not returned.
    got = renew(conn, A, lane(6, {bad: 1}))
    assert held(got) == {good: 4}
    assert leases(conn)[(A, bad)] == (1, 1) and inflight(conn) == {bad: 1, good: 4}
    # Nor a node gone stale, nor one that dropped the model; offline too.
    conn.execute("update nodes set last_heartbeat_at = now() - interval '1 hour' where id = %s", (good,))
    assert renew(conn, A, lane(6, {bad: 1})) == []
    assert inflight(conn) == {bad: 1, good: 0}
    assert_slots_add_up(conn)


def test_a_node_full_of_leased_slots_keeps_its_rank(conn: psycopg.Connection) -> None:
    """score_nodes() leaves a full node out; the lease on it ranks by its score when last ranked."""
    best = make_node(conn, "best", tflops=300, max_concurrency=2)
    worse = make_node(conn, "worse", tflops=50, max_concurrency=4)
    got = renew(conn, A, lane(3))
    assert [(lease.node_id, lease.rank, lease.slots) for lease in got] == [(best, 1, 2), (worse, 2, 1)]
    got = renew(conn, A, lane(3))  # the best node is full now: not ranked by score_nodes()
    assert [(lease.node_id, lease.rank) for lease in got] == [(best, 1), (worse, 2)]


def test_more_in_use_than_a_lease_holds_is_taken_back_where_free(conn: psycopg.Connection) -> None:
    """The sweep took idle slots of a lease that ended unrenewed while the gateway still used them:
    the next renewal says so, and is not refused for it."""
    node = make_node(conn, max_concurrency=4)
    renew(conn, A, lane(1))
    assert leases(conn) == {(A, node): (1, 0)}
    assert held(renew(conn, A, lane(3, {node: 3}))) == {node: 3}
    assert leases(conn) == {(A, node): (3, 3)} and inflight(conn) == {node: 3}
    # Where the node has no room left, the count is cut to what the lease holds.
    conn.execute("update nodes set inflight = 4 where id = %s", (node,))  # a placement took the last
    assert held(renew(conn, A, lane(3, {node: 5}))) == {node: 3}
    assert leases(conn) == {(A, node): (3, 3)} and inflight(conn) == {node: 4}


BAD_LANES: list[tuple[Any, str]] = [
    ({"model": LLAMA8}, "JSON array of lanes"),
    ([1], "lane 1: a lane is a JSON object"),
    ([{"policy": "balanced", "want": 1}], 'lane 1: "model" must be a string'),
    ([{"model": LLAMA8, "region": 3, "want": 1}], '"region" must be a string or null'),
    ([{"model": LLAMA8}], '"want" must be a number'),
    ([{"model": LLAMA8, "want": -1}], '"want" must be a whole number'),
    ([{"model": LLAMA8, "want": 1.5}], '"want" must be a whole number'),
    ([{"model": LLAMA8, "want": 1, "need": "1"}], '"need" must be a number'),
    ([{"model": LLAMA8, "want": 1, "need": 2}], '"need" must be a whole number of slots from 0 to "want"'),
    ([{"model": LLAMA8, "want": 1, "need": -1}], '"need" must be a whole number of slots from 0 to "want"'),
    ([{"model": LLAMA8, "want": 1, "in_use": [1]}], '"in_use" must be an object'),
    ([{"model": LLAMA8, "want": 1, "in_use": {"node-1": 1}}], 'names "node-1", which is not a node id'),
    ([{"model": LLAMA8, "want": 1, "in_use": {str(uuid.uuid4()): -1}}], "must be a whole number from 0"),
    ([{"model": LLAMA8, "want": 1, "in_use": {str(uuid.uuid4()): "2"}}], "must be a whole number from 0"),
    ([{"model": LLAMA8, "want": 1}, {"model": LLAMA8, "region": None, "want": 2}], "lane 2: the lane"),
    ([{"model": LLAMA8, "want": 1, "placed": "x"}], '"placed" must be an array of at most 10000 job ids'),
    ([{"model": LLAMA8, "want": 1, "placed": [1]}], '"placed" must be an array'),
    ([{"model": LLAMA8, "want": 1, "placed": ["job-1"]}], '"placed" must be an array'),
    ([{"model": LLAMA8, "want": 1, "placed": [str(uuid.uuid4())] * 10001}], '"placed" must be an array'),
]


def test_a_lane_of_a_model_or_policy_that_does_not_exist_gets_nothing_and_stops_no_renewal(
    conn: psycopg.Connection,
) -> None:
    """A gateway wants such a lane a while after a request for it (refused). Its renewals had been
    refused whole meanwhile, every lease of the gateway lapsing; the lane is renewed as one it no
    longer names instead."""
    node = make_node(conn, max_concurrency=4)
    got = renew(
        conn,
        A,
        lane(2),
        {"model": "acme/nobody-holds-this", "want": 3},
        lane(1, policy="fastest-ever"),
    )
    assert held(got) == {node: 2} and {row.model_id for row in got} == {LLAMA8}
    demand = conn.execute("select model_id, policy from private.lane_demand").fetchall()
    assert demand == [(LLAMA8, "balanced")]
    assert inflight(conn) == {node: 2}


def test_a_lane_whose_model_is_gone_gives_back_its_idle_slots_and_stops_no_renewal(
    conn: psycopg.Connection,
) -> None:
    """A model no catalog row names, held by one node, which drops it: the gateway still wants the
    lane (its requests are refused now), and holds a slot of it in use. Ranking it had refused every
    renewal of the gateway from then on, its other lanes' leases lapsing."""
    own = "acme/homebrew-7b"
    node = make_node(conn, max_concurrency=4, models={own: "loaded", LLAMA8: "loaded"})

    def by_lane() -> dict[str, tuple[int, int]]:
        rows = conn.execute("select model_id, slots, in_use from private.slot_leases").fetchall()
        return {model: (slots, in_use) for model, slots, in_use in rows}

    renew(conn, A, lane(2), lane(2, model=own))
    renew(conn, A, lane(2), lane(2, {node: 1}, model=own))
    assert by_lane() == {LLAMA8: (2, 0), own: (2, 1)}
    conn.execute("delete from node_models where model_id = %s", (own,))
    got = renew(conn, A, lane(2), lane(2, {node: 1}, model=own))
    assert held(got) == {node: 2} and {row.model_id for row in got} == {LLAMA8}
    # Of the gone lane, its slot in use stays until its job ends; its idle one went back.
    assert by_lane() == {LLAMA8: (2, 0), own: (1, 1)}
    assert inflight(conn) == {node: 3}
    assert_slots_add_up(conn)


@pytest.mark.parametrize(("lanes", "message"), BAD_LANES)
def test_bad_lanes_are_refused_and_change_nothing(conn: psycopg.Connection, lanes: Any, message: str) -> None:
    node = make_node(conn, max_concurrency=4)
    renew(conn, A, lane(2))
    conn.execute("update private.gateways set seen_at = now() - interval '1 minute'")
    before = (leases(conn), inflight(conn), conn.execute("select seen_at from private.gateways").fetchall())
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
        conn.execute("select * from renew_leases(%s, %s::jsonb)", (A, json.dumps(lanes)))
    assert (
        leases(conn),
        inflight(conn),
        conn.execute("select seen_at from private.gateways").fetchall(),
    ) == before
    assert inflight(conn) == {node: 2}


def test_renewals_and_placements_together_never_overbook(db_url: str) -> None:
    """Three gateways renewing (wants and counts in use changing every round) while requests are
    placed and ended on the same small fleet: no node's inflight ever passes its slots, nothing
    deadlocks, and at the end inflight is the leased slots plus the placed requests still running."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        nodes = [make_node(conn, max_concurrency=3) for _ in range(4)]
    errors: list[BaseException] = []
    over: list[int] = []
    done = threading.Event()

    def gateway(me: uuid.UUID, seed: int) -> None:
        with psycopg.connect(db_url, autocommit=True) as conn:
            mine: dict[uuid.UUID, int] = {}
            for i in range(25):
                want = (seed * 7 + i * 5) % 9
                in_use = {node: (slots + i) % (slots + 1) for node, slots in mine.items()}
                mine = held(renew(conn, me, lane(want, in_use)))

    def placer() -> None:
        request = {"model": LLAMA8, "policy": "balanced", "fallbacks": 0, "prompt_bytes": 10, "max_out": 10}
        with psycopg.connect(db_url, autocommit=True) as conn:
            running: list[uuid.UUID] = []
            for i in range(60):
                rows = conn.execute(
                    "select job_id, node_id from place_jobs(%s, %s::jsonb)",
                    (str(C), json.dumps([request] * 2)),
                ).fetchall()
                running += [job for job, node in rows if node is not None]
                if running and i % 2:
                    conn.execute("select complete_job(%s)", (running.pop(0),))

    def watch() -> None:
        with psycopg.connect(db_url, autocommit=True) as conn:
            while not done.is_set():
                (count,) = conn.execute(
                    "select count(*) from nodes where inflight > max_concurrency"
                ).fetchone() or (0,)
                over.append(count)

    def run(target: Any, *args: Any) -> None:
        try:
            target(*args)
        except BaseException as err:  # reported by the test
            errors.append(err)

    threads = [threading.Thread(target=run, args=(gateway, g, n)) for n, g in enumerate((A, B, uuid.uuid4()))]
    threads += [threading.Thread(target=run, args=(placer,)), threading.Thread(target=run, args=(watch,))]
    for thread in threads:
        thread.start()
    for thread in threads[:-1]:
        thread.join(timeout=120)
    done.set()
    threads[-1].join()
    assert errors == []
    assert over and set(over) == {0}
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert_slots_add_up(conn)
        assert sum(inflight(conn)[node] for node in nodes) > 0


def test_a_claim_takes_only_free_slots_and_never_waits_for_a_node(
    conn: psycopg.Connection, db_url: str
) -> None:
    """What a renewal planned from one snapshot is moved on the locked rows as they are: a claim
    takes only the slots still free, and a node another transaction holds is skipped."""
    node, other = make_node(conn, max_concurrency=4), make_node(conn, max_concurrency=4)
    conn.execute("update nodes set inflight = 3 where id = %s", (node,))  # placed meanwhile
    move = "select private.move_lease_slots(%s, %s, 'balanced', '', %s::uuid[], %s::int[], now())"
    assert conn.execute(move, (A, LLAMA8, [node], [4])).fetchone() == (1,)
    assert leases(conn) == {(A, node): (1, 0)}
    assert conn.execute("select inflight, status from nodes where id = %s", (node,)).fetchone() == (
        4,
        "online",
    )
    with psycopg.connect(db_url) as holder:
        holder.execute("select 1 from nodes where id = %s for no key update", (other,))
        conn.execute("set lock_timeout = '2s'")
        started = time.monotonic()
        assert conn.execute(move, (A, LLAMA8, [other], [2])).fetchone() == (0,)
        assert time.monotonic() - started < 1
    assert conn.execute(move, (A, LLAMA8, [other, node], [2, -5])).fetchone() == (1,)
    assert leases(conn) == {(A, other): (2, 0), (A, node): (0, 0)}
    assert inflight(conn) == {node: 3, other: 2}


def test_a_lease_past_its_end_gives_back_its_idle_slots(conn: psycopg.Connection) -> None:
    node = make_node(conn, max_concurrency=4)
    renew(conn, A, lane(4))
    renew(conn, A, lane(4, {node: 1}))
    store = SyncStore(conn)
    assert store.all(q.SWEEP) == [] and inflight(conn) == {node: 4}  # not yet ended: nothing moves
    # Just past its end: requests dispatched since the last renewal may still run on the idle slots.
    conn.execute("update private.slot_leases set expires_at = now() - interval '1 second'")
    assert store.all(q.SWEEP) == [] and inflight(conn) == {node: 4}
    # Past its end by gateway_timeout_s: the idle ones go back.
    conn.execute("update private.slot_leases set expires_at = now() - interval '16 seconds'")
    assert store.all(q.SWEEP) == []
    # The slot in use at the last renewal stays held while the gateway lives.
    assert leases(conn) == {(A, node): (1, 1)} and inflight(conn) == {node: 1}
    assert conn.execute("select status from nodes").fetchone() == ("online",)
    renew(conn, A, lane(4))  # renewed: it may take them again
    assert inflight(conn) == {node: 4}
    assert_slots_add_up(conn)


def test_a_dead_gateways_leases_escrows_and_demand_are_freed(conn: psycopg.Connection) -> None:
    node = make_node(conn, max_concurrency=4)
    other = make_node(conn, max_concurrency=4, models={"acme/other-7b": "loaded"})
    key = make_key(conn, budget_usd=10.0)
    renew(conn, A, lane(3), lane(2, model="acme/other-7b"))
    renew(conn, B, lane(1))
    SyncStore(conn).all(q.RENEW_ESCROWS, (A, json.dumps([{"key": str(key), "want_usd": "0.5"}])))
    SyncStore(conn).all(q.RENEW_ESCROWS, (B, json.dumps([{"key": str(key), "want_usd": "0.25"}])))
    # A job A dispatched on its lease, running when A died.
    job = uuid.uuid4()
    started: dict[str, Any] = {
        "id": str(job),
        "key": str(key),
        "model": LLAMA8,
        "policy": "balanced",
        "region": None,
    }
    started |= {
        "stream": False,
        "node": str(node),
        "started_at": "2026-12-05T10:00:00+00:00",
        "hold_usd": "0.1",
    }
    SyncStore(conn).all(q.RECORD_JOBS, (A, json.dumps([{**started, "end_user": None, "end": None}])))
    renew(conn, A, lane(3, {node: 1}), lane(2, model="acme/other-7b"))
    assert inflight(conn) == {node: 4, other: 2}
    assert conn.execute("select reserved_usd from api_keys").fetchone() == (Decimal("0.75"),)

    conn.execute("update private.gateways set seen_at = now() - interval '1 minute' where id = %s", (A,))
    conn.execute("update platform_settings set gateway_timeout_s = 0.5")  # the database started long ago
    conn.execute("update private.gateways set seen_at = now() where id = %s", (B,))
    swept = SyncStore(conn).all(q.SWEEP)
    assert [(s.kind, s.id) for s in swept] == [("job_orphaned", job)]
    # All A held is free, the slot of its running job once; B's lease, escrow and demand stay.
    assert leases(conn) == {(B, node): (1, 0)}
    assert inflight(conn) == {node: 1, other: 0}
    assert conn.execute("select reserved_usd from api_keys").fetchone() == (Decimal("0.25"),)
    assert conn.execute("select gateway_id from private.key_escrows").fetchall() == [(B,)]
    assert conn.execute("select gateway_id from private.lane_demand").fetchall() == [(B,)]
    assert_slots_add_up(conn)
    assert SyncStore(conn).all(q.SWEEP) == [] and inflight(conn) == {node: 1, other: 0}  # nothing twice


def test_a_lane_holding_nothing_gets_the_idle_slots_other_lanes_lease_on_its_nodes(
    conn: psycopg.Connection,
) -> None:
    other = "acme/other-7b"
    node = make_node(conn, max_concurrency=4, models={LLAMA8: "loaded", other: "loaded"})
    renew(conn, A, lane(4, {}))
    renew(conn, A, lane(4, {node: 1}))
    assert inflight(conn) == {node: 4}  # all four leased for one model, three of them idle
    starved = {**lane(2), "model": other}
    assert held(renew(conn, B, starved)) == {}  # nothing free: the new lane holds nothing yet
    # A's next renewal gives back its idle slots there, and claims none; the one in use stays.
    assert held(renew(conn, A, lane(4, {node: 1}))) == {node: 1}
    assert held(renew(conn, B, starved)) == {node: 2}
    assert_slots_add_up(conn)
    # Fed, the other lane no longer presses: A takes the slot left free again.
    assert held(renew(conn, A, lane(4, {node: 1}))) == {node: 2}
    assert inflight(conn) == {node: 4}
    assert_slots_add_up(conn)


def test_a_renewal_ranks_no_idle_lane_that_could_claim_nothing(conn: psycopg.Connection) -> None:
    """A gateway renews every model asked for within 10 s, twice a second. An idle lane (needing no
    slot, holding none) where no node could take a spare for it was ranked twice at each (for its
    claims, for its fallbacks): 1.3 ms of Postgres a lane on 18 nodes (`bench sql --paths renew`). It is
    ranked no more; one holding a spare still is."""
    models = [f"acme/idle-{i}-7b" for i in range(3)]
    node = make_node(conn, max_concurrency=2, models=dict.fromkeys([LLAMA8, *models], "loaded"))
    idle = [{**lane(1, need=0), "model": model} for model in models]
    assert held(renew(conn, A, *idle)) == {node: 1}  # one spare: the gateway's one idle slot there
    with conn.transaction():
        conn.execute("set local track_functions = 'pl'")
        got = renew(conn, A, *idle)
        row = conn.execute(
            "select coalesce(sum(calls), 0) from pg_stat_xact_user_functions where funcname = 'score_nodes'"
        ).fetchone()
    assert {lease.model_id for lease in got} == {models[0]} and held(got) == {node: 1}
    assert row == (2,)  # the lane holding the spare, for its claims and its fallbacks; none for the others
    assert_slots_add_up(conn)


def test_spare_slots_never_take_a_nodes_last_free_slot(conn: psycopg.Connection) -> None:
    """Four gateways each wanting one spare slot (needing none) of a node of four leave one free: a
    request SQL places (a lane's first, a failed job's next node) finds it. A need takes it."""
    node = make_node(conn, max_concurrency=4)
    for _ in range(2):
        spares = {
            gateway: sum(held(renew(conn, gateway, lane(1, need=0))).values()) for gateway in (A, B, C, D)
        }
    assert spares == {A: 1, B: 1, C: 1, D: 0}
    assert inflight(conn) == {node: 3}
    assert held(renew(conn, D, lane(1, need=1))) == {node: 1}
    assert inflight(conn) == {node: 4}
    assert_slots_add_up(conn)


def test_a_gateway_keeps_one_idle_spare_a_node(conn: psycopg.Connection) -> None:
    """What a lane wants beyond its need is spares: one idle slot a node, held or claimed, and none
    where the gateway holds an idle slot already in another lane (a request SQL places lends it)."""
    other = "acme/other-7b"
    node = make_node(conn, max_concurrency=8, models={LLAMA8: "loaded", other: "loaded"})
    idle_other = {**lane(1, need=0), "model": other}

    def leased(*lanes: dict[str, Any]) -> dict[str, int]:
        return {row.model_id: row.slots for row in renew(conn, A, *lanes) if row.slots}

    assert leased(lane(4)) == {LLAMA8: 4}  # a gateway that says no need needs all it wants
    assert leased(lane(4, need=0), idle_other) == {LLAMA8: 1}  # idle after a burst: one spare kept
    # In use now: the spare is claimed beside it, by the lane renewed first (the one needing least).
    assert leased(lane(4, {node: 1}, need=1), idle_other) == {LLAMA8: 1, other: 1}
    # Busier: the need takes a slot, and the gateway still holds one spare there, not two.
    assert leased(lane(4, {node: 2}, need=2), idle_other) == {LLAMA8: 2, other: 1}
    assert inflight(conn) == {node: 3}
    assert_slots_add_up(conn)


def test_an_idle_spare_never_keeps_a_nodes_last_free_slot(conn: psycopg.Connection) -> None:
    """A spare is kept, as it is claimed, only where the node has a slot free besides: once the
    lane's need fills the rest, the spare goes back at the next renewal, and a request SQL places
    (another gateway's first for a model) finds the node's last slot free. CI at 7216741: a lane
    that had needed both slots of a node of two kept one idle as its spare, and another gateway's
    first request waited in line for the renewal after it asked."""
    node = make_node(conn, max_concurrency=2)
    assert held(renew(conn, A, lane(3, {node: 2}, need=2))) == {node: 2}  # a burst: the node full
    assert held(renew(conn, A, lane(2, {node: 1}, need=1))) == {node: 1}  # one in use: no idle spare
    assert inflight(conn) == {node: 1}
    assert held(renew(conn, A, lane(2, {node: 1}, need=1))) == {node: 1}  # nor claimed again
    assert_slots_add_up(conn)


def test_an_idle_spare_gives_way_to_another_gateways_share(conn: psycopg.Connection) -> None:
    """A full node, and a lane's slots above its target that would leave a slot free beside a spare:
    another gateway's lane there holds less than its share, so no spare is kept, and that share is
    claimed at once (a review, 2026-12-05: kept, it left the other gateway a slot short for as long
    as the first asked)."""
    node = make_node(conn, max_concurrency=4)
    assert held(renew(conn, A, lane(4, {node: 3}, need=3))) == {node: 3}  # no spare: one slot is free
    assert held(renew(conn, B, lane(1, {node: 1}, need=1))) == {node: 1}  # full
    assert held(renew(conn, C, lane(2, need=2))) == {}  # nothing free: below its share
    assert held(renew(conn, A, lane(3, {node: 1}, need=1))) == {node: 1}  # both idle slots go back
    assert held(renew(conn, C, lane(2, need=2))) == {node: 2}
    assert_slots_add_up(conn)


def test_after_a_burst_one_spare_stays_where_the_slots_given_back_leave_room(
    conn: psycopg.Connection,
) -> None:
    """The idle slots above the target go back but for a spare, kept where the node has a slot free
    once the others have gone: at once, not given back with them and claimed again at the next
    renewal (a review, 2026-12-05)."""
    node = make_node(conn, max_concurrency=4)
    assert held(renew(conn, A, lane(5, {node: 4}, need=4))) == {node: 4}
    assert held(renew(conn, A, lane(3, {node: 2}, need=2))) == {node: 3}
    assert inflight(conn) == {node: 3}
    assert_slots_add_up(conn)


def test_a_lane_holding_nothing_takes_no_idle_slot_its_gateway_could_lend(conn: psycopg.Connection) -> None:
    """A gateway's new lane, where it holds a slot of another lane on a full node, lends that one to
    its first request: the other gateways keep the idle slots they would lend to theirs."""
    other = "acme/other-7b"
    node = make_node(conn, max_concurrency=2, models={LLAMA8: "loaded", other: "loaded"})
    renew(conn, A, lane(1, need=1))
    renew(conn, B, lane(1, need=1))
    assert inflight(conn) == {node: 2}
    got = renew(conn, B, lane(1, need=1), {**lane(1), "model": other})
    assert {row.model_id: row.slots for row in got if row.slots} == {
        LLAMA8: 1
    }  # full: the new lane holds none
    assert held(renew(conn, A, lane(1, need=1))) == {node: 1}  # A's idle slot stays
    assert_slots_add_up(conn)


def test_a_gateways_jobs_sql_placed_join_its_lease_at_the_next_renewal(conn: psycopg.Connection) -> None:
    """A gateway whose leased slots were all in use had the next request placed in SQL. The next
    renewal moves that job's slot into its lease, in use, and names the job: the node's inflight is
    unchanged, the job's end frees nothing in SQL, and the lease holds the slot, idle once the
    gateway reports it so. Another gateway's job, and a job on a node cooling down, stay as placed."""
    node = make_node(conn, max_concurrency=4)
    cooling = make_node(conn, "cooling", tflops=10, max_concurrency=4)
    assert held(renew(conn, A, lane(2, {}))) == {node: 2}
    request = {"model": LLAMA8, "policy": "balanced", "fallbacks": 0, "prompt_bytes": 10, "max_out": 10}
    place = "select job_id, node_id from place_jobs(%s, %s::jsonb)"
    (mine, on), (theirs, _) = [
        conn.execute(place, (str(gateway), json.dumps([request]))).fetchone() or (None, None)
        for gateway in (A, B)
    ]
    assert on == node
    conn.execute("update nodes set inflight = inflight + 1 where id = %s", (cooling,))  # a job of A's there
    stuck = uuid.uuid4()
    conn.execute(
        "insert into jobs (id, model_id, policy, status, node_id, gateway_id, min_vram_gb)"
        " values (%s, %s, 'balanced', 'running', %s, %s, 16)",
        (stuck, LLAMA8, cooling, A),
    )
    conn.execute("insert into job_attempts (job_id, attempt, node_id) values (%s, 1, %s)", (stuck, cooling))
    conn.execute("update nodes set cooldown_until = now() + interval '1 minute' where id = %s", (cooling,))
    assert inflight(conn) == {node: 4, cooling: 1}  # A's 2 leased, A's and B's placed; the stuck one

    got = renew(conn, A, lane(3, {node: 2}, placed=[str(job) for job in (mine, theirs, stuck)]))
    assert [(row.node_id, row.slots, row.in_use, row.absorbed) for row in got if row.slots] == [
        (node, 3, 3, [mine])
    ]
    assert inflight(conn) == {node: 4, cooling: 1}
    leased: dict[uuid.UUID, bool] = dict(conn.execute("select job_id, leased from job_attempts").fetchall())
    assert leased == {mine: True, theirs: False, stuck: False}
    assert_slots_add_up(conn)
    assert not [row for row in renew(conn, A, lane(3, {node: 3})) if row.absorbed]  # named once

    # Its end frees no slot in SQL: the lease holds it, idle once the gateway reports it so.
    conn.execute("select complete_job(%s)", (mine,))
    assert inflight(conn) == {node: 4, cooling: 1}
    renew(conn, A, lane(3, {node: 2}))
    assert leases(conn)[(A, node)] == (3, 2)
    assert_slots_add_up(conn)


def test_a_renewal_moves_only_the_jobs_sql_placed_that_its_gateway_names(conn: psycopg.Connection) -> None:
    """A review (2026-12-07): a renewal moved every running job SQL had placed for its gateway,
    one whose placement's answer had not reached the gateway yet included. The gateway lends a
    lease's idle slots naming its jobs SQL placed, which SQL counts in use there: not that one. Had
    the renewal also given back the idle slot the gateway lent, SQL lent the slot that job ran on,
    one request past the node's slots. A job the renewal does not name stays SQL's until one does."""
    node = make_node(conn, max_concurrency=2)
    other = "acme/other-7b"
    make_node(conn, "other", max_concurrency=1, models={other: "loaded"})
    key = str(make_key(conn))
    base = {"key": key, "policy": "balanced", "fallbacks": 0, "prompt_bytes": 10, "max_out": 4, "wait": True}
    known, unknown = (place(conn, A, {**base, "model": LLAMA8}).job_id for _ in range(2))
    assert inflight(conn)[node] == 2

    got = renew(conn, A, lane(2, {}, placed=[str(known)]))
    assert [(row.node_id, row.slots, row.in_use, row.absorbed) for row in got if row.slots] == [
        (node, 1, 1, [known])
    ]
    leased: dict[uuid.UUID, bool] = dict(conn.execute("select job_id, leased from job_attempts").fetchall())
    assert leased == {known: True, unknown: False}
    assert_slots_add_up(conn)
    # The gateway lends its lease, naming what it knows: the known job's slot is in use, and the
    # unknown one's is no lease's to lend.
    offer = {"node": str(node), "model": LLAMA8, "policy": "balanced", "busy": 0, "placed": [str(known)]}
    assert place(conn, A, {**base, "model": other, "lend": [offer]}).node_id != node
    assert_slots_add_up(conn)
    # Named at the next renewal, it moves then.
    got = renew(conn, A, lane(2, {node: 1}, placed=[str(unknown)]))
    assert [(row.node_id, row.slots, row.in_use, row.absorbed) for row in got if row.slots] == [
        (node, 2, 2, [unknown])
    ]
    assert_slots_add_up(conn)


def test_a_job_whose_move_into_a_lease_went_unheard_is_named_again_and_counted_in_use(
    conn: psycopg.Connection,
) -> None:
    """A renewal moved a job SQL placed into the lease and its answer was lost: the gateway still
    thinks the job SQL's, and reports the lease idle. It names the job (placed): the lease counts
    it in use, not idle, and the job is named among the absorbed again, as long as it is named and
    runs. Another gateway's job is not."""
    node = make_node(conn, max_concurrency=3)
    request = {"model": LLAMA8, "policy": "balanced", "fallbacks": 0, "prompt_bytes": 10, "max_out": 10}
    place = "select job_id from place_jobs(%s, %s::jsonb)"
    mine, theirs, still_sqls = [
        (conn.execute(place, (str(gateway), json.dumps([request]))).fetchone() or (None,))[0]
        for gateway in (A, B, A)
    ]
    running = conn.execute(
        "select count(*) from jobs where status = 'running' and id = any(%s)", ([still_sqls],)
    )
    assert running.fetchone() == (1,)
    conn.execute("update job_attempts set leased = true where job_id = any(%s)", ([mine, theirs],))
    conn.execute(
        "insert into private.slot_leases (gateway_id, node_id, model_id, policy, region, slots, in_use,"
        " expires_at) values (%s, %s, %s, 'balanced', '', 1, 1, now() + interval '1 minute')",
        (A, node, LLAMA8),
    )  # what the renewal whose answer was lost did with A's first job (and B's: another gateway's)
    placed = [str(job) for job in (mine, theirs, still_sqls)]
    got = [row for row in renew(conn, A, lane(2, {}, need=2, placed=placed)) if row.slots]
    assert [(row.node_id, row.slots, row.in_use, set(row.absorbed or ())) for row in got] == [
        (node, 2, 2, {mine, still_sqls})  # the one still SQL's is moved in now, as any is
    ]
    got = [row for row in renew(conn, A, lane(2, {}, need=2)) if row.slots]
    assert [(row.in_use, row.absorbed) for row in got] == [(0, [])]  # not named: idle, as it says
    assert leases(conn)[(A, node)] == (2, 0)


def test_a_job_sql_moved_to_another_node_stays_sqls_to_its_end(conn: psycopg.Connection) -> None:
    """Found when cold requests were first placed in SQL: a renewal moved a job that SQL had failed
    over into the lease, and the gateway, which does not know the nodes the job had tried, moved it
    back to the one that had failed it (its failures counted twice). A job past its first attempt
    is not moved into a lease: SQL moves it on and ends it, as any job SQL placed."""
    first = make_node(conn, "first", max_concurrency=4)
    second = make_node(conn, "second", tflops=10, max_concurrency=4)
    request = {"model": LLAMA8, "policy": "balanced", "fallbacks": 1, "prompt_bytes": 10, "max_out": 10}
    row = conn.execute(
        "select job_id, node_id from place_jobs(%s, %s::jsonb)", (str(A), json.dumps([request]))
    )
    job, on = row.fetchone() or (None, None)
    assert on == first
    moved = conn.execute("select node_id from failover_job(%s, 'boom', 503, %s)", (job, [second])).fetchone()
    assert moved == (second,)
    assert not [row for row in renew(conn, A, lane(2, {}, placed=[str(job)])) if row.absorbed]
    leased = conn.execute(
        "select attempt, leased from job_attempts where job_id = %s order by attempt", (job,)
    )
    assert leased.fetchall() == [(1, False), (2, False)]
    assert_slots_add_up(conn)


def test_slots_in_use_above_a_gateways_share_drain_to_the_gateway_that_wants_them(
    conn: psycopg.Connection,
) -> None:
    """A gateway whose callers keep every slot it leases busy has none idle at a renewal: it gave
    back nothing, and a gateway that came later got nothing. Now its slots above its share drain:
    counted still, but not returned for use; once their requests end they are idle, go back, and
    the other gateway claims them."""
    top = make_node(conn, "top", tflops=300, max_concurrency=2)
    low = make_node(conn, "low", tflops=50, max_concurrency=2)
    assert held(renew(conn, A, lane(5))) == {top: 2, low: 2}
    busy = {top: 2, low: 2}
    assert held(renew(conn, B, lane(4))) == {}  # nothing free
    got = held(renew(conn, A, lane(4, busy)))  # its share now: 4 x 4/8
    assert got == {top: 2}  # the lowest ranked lease's slots drain first
    assert leases(conn)[(A, low)] == (2, 2)  # still held, in use: counted in inflight
    assert inflight(conn) == {top: 2, low: 2}
    assert_slots_add_up(conn)
    # Their requests end: idle at A's next renewal, given back; B claims them at its own.
    renew(conn, A, lane(4, {top: 2}))
    assert (A, low) not in leases(conn) or leases(conn)[(A, low)][0] == 0
    assert held(renew(conn, B, lane(4))) == {low: 2}
    assert_slots_add_up(conn)


def place(conn: psycopg.Connection, gateway: uuid.UUID, request: dict[str, Any]) -> q.GroupedMatch:
    (row,) = SyncStore(conn).all(q.PLACE_JOBS, (str(gateway), json.dumps([request])))
    assert row.failure_state is None, row.failure
    return row


def test_a_request_every_node_is_full_for_takes_an_idle_slot_its_gateway_lends_from_a_lease(
    conn: psycopg.Connection,
) -> None:
    """Measured (bench world, 2026-12-05): a request new to its gateway waited in line 27 ms to 5.3 s
    next to the database, every slot of its node leased, idle, to the gateways' other lanes. Its
    gateway now lends idle slots of its leases with it; SQL takes the best that could serve it."""
    other = "acme/other-7b"
    node = make_node(conn, max_concurrency=2, models={LLAMA8: "loaded", other: "loaded"})
    elsewhere = make_node(conn, max_concurrency=2, models={LLAMA8: "loaded"})  # not serving `other`
    renew(conn, A, lane(4))
    conn.execute("delete from private.lane_demand")  # nothing presses for slots back
    assert leases(conn) == {(A, node): (2, 0), (A, elsewhere): (2, 0)}
    request = {
        "model": other,
        "key": str(make_key(conn)),
        "policy": "balanced",
        "stream": False,
        "fallbacks": 1,
        "prompt_bytes": 10,
        "max_out": 4,
        "wait": True,
    }

    def lending(*nodes: uuid.UUID, busy: int = 0) -> dict[str, Any]:
        lend = [{"node": str(n), "model": LLAMA8, "policy": "balanced", "busy": busy} for n in nodes]
        return {**request, "lend": lend}

    assert place(conn, A, request).busy  # nothing lent: it waits
    assert place(conn, A, lending(elsewhere)).busy  # lent where the model is not served
    assert place(conn, B, lending(node)).busy  # a slot another gateway leases is not B's to lend
    # The gateway has both in use (a renewal under way gave a third back, say): none is idle.
    assert place(conn, A, lending(node, busy=2)).busy
    assert leases(conn) == {(A, node): (2, 0), (A, elsewhere): (2, 0)}
    assert inflight(conn) == {node: 2, elsewhere: 2}

    got = place(conn, A, lending(elsewhere, node))
    assert (got.busy, got.lent, got.node_id) == (False, True, node)
    assert leases(conn) == {(A, node): (1, 0), (A, elsewhere): (2, 0)}  # the lease one smaller
    assert inflight(conn) == {node: 2, elsewhere: 2}  # the job's slot now: counted once
    assert_slots_add_up(conn)
    # A free slot needs no lending: claimed as any is, the leases untouched.
    conn.execute("select complete_job(%s, 'succeeded', 1, 1, 1, 1)", (got.job_id,))
    again = place(conn, A, lending(node))
    assert (again.node_id, again.lent) == (node, False)
    assert leases(conn) == {(A, node): (1, 0), (A, elsewhere): (2, 0)}
    assert_slots_add_up(conn)


def test_a_lent_lease_counts_in_use_the_jobs_sql_placed_that_a_renewal_moved_into_it(
    conn: psycopg.Connection,
) -> None:
    """A renewal moves the slot of each of its gateway's running jobs SQL placed into the lane's
    lease, unknown to the gateway until its answer: a placement lending that lease as idle got the
    slot such a job ran on (a review). The gateway names its jobs SQL placed with the lent slot, and
    SQL counts those it moved as in use."""
    other = "acme/other-7b"
    node = make_node(conn, max_concurrency=1, models={LLAMA8: "loaded", other: "loaded"})
    key = str(make_key(conn))
    base = {"key": key, "policy": "balanced", "fallbacks": 0, "prompt_bytes": 10, "max_out": 4, "wait": True}
    job = place(conn, A, {**base, "model": LLAMA8}).job_id
    renew(conn, A, lane(1, placed=[str(job)]))
    conn.execute("delete from private.lane_demand")
    assert conn.execute("select leased from job_attempts where job_id = %s", (job,)).fetchone() == (True,)
    assert inflight(conn) == {node: 1}

    def lending(placed: list[str]) -> dict[str, Any]:
        offer = {"node": str(node), "model": LLAMA8, "policy": "balanced", "busy": 0, "placed": placed}
        return {**base, "model": other, "lend": [offer]}

    assert place(conn, A, lending([str(job)])).busy  # its one slot is the moved job's
    assert_slots_add_up(conn)
    got = place(conn, A, lending([]))  # unnamed, the job's slot looks idle: what was lent before
    assert (got.lent, got.node_id) == (True, node)
