"""Matching under scarcity (issue 43): the reserve counts the requests waiting in the gateways' lines
as it counts running jobs, while their gateway lives; and when a big level is under pressure, a node
of that level takes a job a smaller node could serve only once the request can wait no longer."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from neuralgrid.db import queries as q
from neuralgrid.db.queries import MatchRequest, match_params
from neuralgrid.db.store import Store, SyncStore
from neuralgrid.gateway.waiting import WaitingRoom
from neuralgrid.server.liveness import keep_checking_in
from tests.conftest import LLAMA8, make_key, make_node, running_job

LLAMA70 = "meta-llama/Llama-3.3-70B-Instruct-AWQ"  # needs 42 GB


def check_in(
    conn: psycopg.Connection, waiting: dict[str, int], gateway: uuid.UUID | None = None
) -> uuid.UUID:
    gateway = gateway or uuid.uuid4()
    SyncStore(conn).get(q.GATEWAY_ALIVE_WAITING, (gateway, None, json.dumps(waiting)))
    return gateway


def sweep(conn: psycopg.Connection) -> None:
    conn.execute("select * from sweep()")


def pressure(conn: psycopg.Connection, level: float) -> float:
    row = conn.execute("select pressure from private.vram_pressure where level_gb = %s", (level,)).fetchone()
    assert row is not None
    return float(row[0])


def fleet(conn: psycopg.Connection, small_free: bool = True) -> tuple[uuid.UUID, uuid.UUID]:
    """An H100 (16 slots) that holds both models, and a 24 GB card (4 slots) that holds the 8B."""
    big = make_node(
        conn, "h100", vram_gb=80, tflops=989, hourly_rate=2.5, max_concurrency=16,
        models={LLAMA8: "loaded", LLAMA70: "loaded"},
    )  # fmt: skip
    small = make_node(
        conn, "rtx4090", vram_gb=24, tflops=165, hourly_rate=0.35, max_concurrency=4,
        inflight=0 if small_free else 4,
    )  # fmt: skip
    return big, small


def test_waiting_requests_press_on_their_level_while_their_gateway_lives(conn: psycopg.Connection) -> None:
    fleet(conn)
    gateway = check_in(conn, {LLAMA70: 6, "no/such-model": 50})
    check_in(conn, {LLAMA70: 2, LLAMA8: 0})  # a second gateway's line adds up
    running_job(conn, LLAMA70, 42)
    sweep(conn)
    assert pressure(conn, 42) == pytest.approx((6 + 2 + 1) / 16)  # a model not in the catalog counts nothing
    assert pressure(conn, 18) == 0

    # A gateway silent past gateway_timeout_s: its line is no longer demand (a fresh measure, unsmoothed).
    conn.execute("delete from private.vram_pressure")
    conn.execute(
        "update private.gateways set seen_at = now() - interval '1 minute' where id = %s", (gateway,)
    )
    sweep(conn)
    assert pressure(conn, 42) == pytest.approx((2 + 1) / 16)

    # Its next check-in reports a line emptied: nothing waits there any more.
    conn.execute("delete from private.vram_pressure")
    check_in(conn, {}, gateway)
    sweep(conn)
    assert pressure(conn, 42) == pytest.approx(3 / 16)


def test_a_check_in_without_waiting_leaves_none_recorded(conn: psycopg.Connection) -> None:
    gateway = check_in(conn, {LLAMA70: 4})
    SyncStore(conn).get(q.GATEWAY_ALIVE_AT, (gateway, "http://10.0.0.1:8000"))
    row = conn.execute("select waiting from private.gateways where id = %s", (gateway,)).fetchone()
    assert row == ({LLAMA70: 4},)  # the older check-in says nothing of the line: it keeps the last count


def place(conn: psycopg.Connection, model: str, wait: bool, key: uuid.UUID) -> Any:
    params = match_params(MatchRequest(model=model), key, False, 2, prompt_bytes=400, max_out=100, wait=wait)
    return SyncStore(conn).get(q.PLACE_JOB, {**params, "gateway": None, "end_user": None})


def big_demand(conn: psycopg.Connection, jobs: int) -> None:
    for _ in range(jobs):
        running_job(conn, LLAMA70, 42)
    sweep(conn)


def test_under_pressure_a_small_job_waits_for_a_small_node_until_its_deadline(
    conn: psycopg.Connection,
) -> None:
    big, _small = fleet(conn, small_free=False)
    key = make_key(conn)
    big_demand(conn, 4)  # 4 of the 16 slots that can hold a 70B model: 0.25, over the default 0.2
    assert conn.execute("select private.kept_level(18)").fetchone() == (42.0,)

    waiting = place(conn, LLAMA8, True, key)  # the H100 is free, but kept: wait for the 24 GB card
    assert (waiting.node_id, waiting.busy, waiting.refusal) == (None, True, "busy")
    assert conn.execute("select count(*) from jobs where model_id = %s", (LLAMA8,)).fetchone() == (0,)

    last = place(conn, LLAMA8, False, key)  # the gateway's last ask at the deadline
    assert last.node_id == big
    # The 70B request itself is never kept from its own level.
    assert place(conn, LLAMA70, True, key).node_id == big


def test_a_free_small_node_takes_the_small_job_and_the_big_one_stays_a_fallback(
    conn: psycopg.Connection,
) -> None:
    big, small = fleet(conn)
    key = make_key(conn)
    big_demand(conn, 4)
    for wait, fallbacks in ((True, []), (False, [big])):  # kept nodes: left out, else last
        match = place(conn, LLAMA8, wait, key)
        assert (match.node_id, match.fallback_ids) == (small, fallbacks)


@pytest.mark.parametrize(
    ("setting", "kept"),
    [
        ("update platform_settings set reserve_threshold = 0.5", False),  # 0.25 is under it
        ("update matching_policies set reserve = 0 where name = 'balanced'", False),  # no reserve, no rule
        ("select 1", True),
    ],
)
def test_the_rule_holds_only_over_the_threshold_and_under_a_reserving_policy(
    conn: psycopg.Connection, setting: str, kept: bool
) -> None:
    big, _small = fleet(conn, small_free=False)
    key = make_key(conn)
    big_demand(conn, 4)
    conn.execute(setting)
    assert place(conn, LLAMA8, True, key).node_id == (None if kept else big)


def test_nothing_is_kept_from_a_job_that_every_node_is_too_big_for(conn: psycopg.Connection) -> None:
    """When no online node is smaller than the pressed level, no smaller node could take the job."""
    big, small = fleet(conn, small_free=False)
    conn.execute("update nodes set status = 'offline' where id = %s", (small,))
    key = make_key(conn)
    big_demand(conn, 8)
    assert conn.execute("select private.kept_level(18)").fetchone() == (None,)
    assert place(conn, LLAMA8, True, key).node_id == big


def test_place_jobs_keeps_the_rule_for_every_request_of_a_group(conn: psycopg.Connection) -> None:
    big, small = fleet(conn)
    key = make_key(conn)
    big_demand(conn, 4)
    request = {"model": LLAMA8, "key": str(key), "policy": "balanced", "fallbacks": 2, "wait": True,
               "prompt_bytes": 400, "max_out": 100}  # fmt: skip
    rows = conn.execute(
        "select node_id, busy from place_jobs(null, %s::jsonb)", (json.dumps([request] * 6),)
    ).fetchall()
    # The 24 GB card's four slots, then two that wait rather than take the kept H100.
    assert rows == [(small, False)] * 4 + [(None, True)] * 2
    assert conn.execute("select inflight from nodes where id = %s", (big,)).fetchone() == (0,)


def test_the_threshold_must_be_positive(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="reserve_threshold must be positive"):
        conn.execute("update platform_settings set reserve_threshold = 0")


async def test_a_gateway_reports_its_lines_with_each_check_in(conn: psycopg.Connection, db_url: str) -> None:
    """The waiting room's lines, a route's own line counted for its model, reach private.gateways
    through the gateway's check-in (keep_checking_in), and the sweep counts them."""
    fleet(conn)
    room = WaitingRoom(max_waiting=8)
    loop = asyncio.get_running_loop()

    async def never() -> None:
        return None

    waits = [
        asyncio.create_task(room.wait(line, uuid.uuid4(), loop.time() + 5, never, room.announcements))
        for line in (LLAMA70, LLAMA70, f"{LLAMA70} /v1/responses", LLAMA8, LLAMA8)
    ]
    await asyncio.sleep(0.05)
    assert room.waiting() == {LLAMA70: 3, LLAMA8: 2}
    gateway, stop = uuid.uuid4(), asyncio.Event()
    async with AsyncConnectionPool(db_url, min_size=1, max_size=1, kwargs={"autocommit": True}) as pool:
        checking = asyncio.create_task(
            keep_checking_in(Store(pool), gateway, stop, None, None, None, room.waiting)
        )
        await asyncio.sleep(0.3)
        stop.set()
        await checking
    for task in waits:
        task.cancel()
    row = conn.execute("select waiting from private.gateways where id = %s", (gateway,)).fetchone()
    assert row == ({LLAMA70: 3, LLAMA8: 2},)
    sweep(conn)
    assert pressure(conn, 42) == pytest.approx(3 / 16)
