"""Right-sizing when it matters: a small job keeps off big-VRAM nodes in proportion to the current
demand for what only they can serve (private.vram_pressure, refreshed by sweep()), and takes them
freely when that demand is low."""

from __future__ import annotations

from uuid import UUID

import psycopg
import pytest

from neuralgrid.db.matching import MatchRequest, match_job, score_nodes
from tests.conftest import LLAMA8, make_node, running_job

LLAMA70 = "meta-llama/Llama-3.3-70B-Instruct-AWQ"  # needs 42 GB


SMALL = MatchRequest(model=LLAMA8, policy="fast_reserving")
BIG = MatchRequest(model=LLAMA70, policy="fast_reserving")


def fleet(conn: psycopg.Connection) -> tuple[UUID, UUID]:
    """An idle H100 that holds both models and a slower 24 GB card that holds only the 8B, under a
    policy that weighs speed over fit (so that only the reserve keeps small jobs off the H100)."""
    conn.execute(
        "insert into matching_policies (name, description, fit, compute, price, warm, capacity,"
        " reputation, reserve) values ('fast_reserving', 'speed first, reserve', 0.02, 0.4, 0.18, 0.25,"
        " 0.1, 0.05, 0.3)"
    )
    big = make_node(
        conn, "h100", vram_gb=80, tflops=989, hourly_rate=2.5, max_concurrency=16,
        models={LLAMA8: "loaded", LLAMA70: "loaded"},
    )  # fmt: skip
    small = make_node(conn, "rtx4090", vram_gb=24, tflops=165, hourly_rate=0.35, max_concurrency=4)
    return big, small


def run_70b_jobs(conn: psycopg.Connection, count: int) -> None:
    for _ in range(count):
        running_job(conn, LLAMA70, 42)


def sweep(conn: psycopg.Connection) -> None:
    conn.execute("select * from sweep()")


def pressure(conn: psycopg.Connection, level: float) -> float:
    row = conn.execute("select pressure from private.vram_pressure where level_gb = %s", (level,)).fetchone()
    assert row is not None
    return float(row[0])


def test_with_no_demand_for_big_vram_a_small_job_may_take_the_fast_big_node(conn: psycopg.Connection) -> None:
    big, _small = fleet(conn)
    sweep(conn)
    assert pressure(conn, 42) == 0
    ranked = score_nodes(conn, SMALL, explain=True)
    assert ranked[0].node_id == big
    assert {r.reserve for r in ranked} == {1.0}
    assert match_job(conn, SMALL).node_id == big


def test_under_big_vram_demand_a_small_job_keeps_off_the_big_node(conn: psycopg.Connection) -> None:
    big, small = fleet(conn)
    run_70b_jobs(conn, 12)  # 12 of the 16 slots that can hold a 70B model
    sweep(conn)
    assert pressure(conn, 42) == pytest.approx(12 / 16)
    assert pressure(conn, 24) == 0  # no job needs 24 to 32 GB, the only level the 24 GB card reaches
    for explain, limit in ((True, None), (False, 4)):  # full scan and index fast path
        ranked = score_nodes(conn, SMALL, explain=explain, limit=limit)
        assert [r.node_id for r in ranked] == [small, big]
        assert ranked[1].reserve == pytest.approx(1 - 12 / 16)
        assert ranked[0].reserve == 1.0  # nothing needing more than 18 GB fits in 24 GB
    # The 70B request itself pays nothing: no level above its need.
    assert score_nodes(conn, BIG, limit=1)[0].reserve == 1.0
    assert match_job(conn, SMALL).node_id == small


def test_bigger_jobs_take_their_slots_first(conn: psycopg.Connection) -> None:
    """14B jobs (32 GB) can use the H100 too, but only what the 70B jobs leave of it."""
    fleet(conn)
    run_70b_jobs(conn, 12)
    for _ in range(2):
        running_job(conn, "q14", 32)
    sweep(conn)
    assert pressure(conn, 42) == pytest.approx(12 / 16)
    assert pressure(conn, 32) == pytest.approx(2 / (16 - 12))


def test_it_ranks_but_never_refuses(conn: psycopg.Connection) -> None:
    big, small = fleet(conn)
    conn.execute("update nodes set inflight = max_concurrency where id = %s", (small,))
    run_70b_jobs(conn, 16)
    sweep(conn)
    assert pressure(conn, 42) == 1.0
    assert match_job(conn, SMALL).node_id == big


def test_demand_is_smoothed_and_fades(conn: psycopg.Connection) -> None:
    fleet(conn)
    run_70b_jobs(conn, 8)
    sweep(conn)
    assert pressure(conn, 42) == pytest.approx(0.5)
    conn.execute("delete from jobs")
    with conn.transaction():  # as if a window had passed since: the old demand counts exp(-1)
        conn.execute("update private.vram_pressure set updated_at = now() - interval '30 seconds'")
        sweep(conn)
    assert pressure(conn, 42) == pytest.approx(0.5 * 0.36787944, rel=1e-6)


@pytest.mark.parametrize(
    ("statement", "constraint"),
    [
        ("update matching_policies set reserve = -0.1", "reserve weight must not be negative"),
        ("update platform_settings set reserve_window_s = 0", "reserve_window_s must be positive"),
    ],
)
def test_bad_settings_are_refused(conn: psycopg.Connection, statement: str, constraint: str) -> None:
    before = conn.execute("select reserve from matching_policies where name = 'balanced'").fetchone()
    with pytest.raises(psycopg.errors.CheckViolation, match=constraint), conn.transaction():
        conn.execute(statement)
    assert conn.execute("select reserve from matching_policies where name = 'balanced'").fetchone() == before
