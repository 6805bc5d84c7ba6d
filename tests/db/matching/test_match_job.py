"""match_job(), failover_job(), complete_job(): claims, fallbacks, usage, reputation, concurrency."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from neuralgrid.db.errors import BudgetExhausted, ConflictError, InvalidRequest
from neuralgrid.db.matching import MatchRequest, complete_job, failover_job, match_job, score_nodes
from tests.conftest import LLAMA8, make_key, make_node, make_user, wait_for

REQUEST = MatchRequest(model=LLAMA8)


def node_state(conn: psycopg.Connection, node_id: uuid.UUID) -> dict[str, object]:
    row = conn.execute(
        "select status, inflight, successes, failures, consecutive_failures, cooldown_until,"
        " ewma_latency_ms, ewma_tokens_per_s from nodes where id = %s",
        (node_id,),
    ).fetchone()
    assert row is not None
    keys = (
        "status",
        "inflight",
        "successes",
        "failures",
        "consecutive",
        "cooldown",
        "latency",
        "tps",
    )
    return dict(zip(keys, row, strict=True))


def test_match_claims_the_best_node_and_returns_ordered_fallbacks(conn: psycopg.Connection) -> None:
    best = make_node(conn, "best", vram_gb=24, hourly_rate=0.2)
    second = make_node(conn, "second", vram_gb=48, hourly_rate=0.4)
    third = make_node(conn, "third", vram_gb=80, hourly_rate=2.0)
    match = match_job(conn, REQUEST, fallbacks=2)
    assert (match.node_id, match.attempt, match.error) == (best, 1, None)
    assert match.fallback_ids == [second, third]
    assert match.endpoint_url == "http://127.0.0.1:9/"
    assert node_state(conn, best)["inflight"] == 1
    job = conn.execute("select status, node_id, attempts, model_id, min_vram_gb from jobs").fetchone()
    assert job == ("running", best, 1, LLAMA8, 18.0)


def test_no_capable_node_records_a_failed_job(conn: psycopg.Connection) -> None:
    match = match_job(conn, REQUEST)
    assert match.node_id is None and match.fallback_ids == []
    assert match.error == f"no capable node is online for {LLAMA8}"
    assert conn.execute("select status, error is not null, finished_at is not null from jobs").fetchone() == (
        "failed",
        True,
        True,
    )


def test_a_full_node_turns_busy_and_back(conn: psycopg.Connection) -> None:
    node = make_node(conn, max_concurrency=2)
    first = match_job(conn, REQUEST)
    assert node_state(conn, node)["status"] == "online"
    match_job(conn, REQUEST)
    assert (node_state(conn, node)["status"], node_state(conn, node)["inflight"]) == ("busy", 2)
    third = match_job(conn, REQUEST)
    assert third.node_id is None and third.error is not None
    complete_job(conn, first.job_id, prompt_tokens=1, completion_tokens=1)
    assert (node_state(conn, node)["status"], node_state(conn, node)["inflight"]) == ("online", 1)


def test_complete_job_meters_usage_cost_and_reputation(conn: psycopg.Connection) -> None:
    owner = make_user(conn)
    key = make_key(conn, owner)
    node = make_node(conn)
    match = match_job(conn, REQUEST, api_key_id=key, stream=True)
    cost = complete_job(
        conn, match.job_id, prompt_tokens=1000, completion_tokens=500, ttft_ms=100, latency_ms=1100
    )
    # Catalog price for Llama 3.1 8B: $0.05 / $0.10 per million tokens.
    assert cost == pytest.approx((1000 * 0.05 + 500 * 0.10) / 1e6)
    job = conn.execute(
        "select status, owner_id, prompt_tokens, completion_tokens, latency_ms, ttft_ms from jobs"
    ).fetchone()
    assert job == ("succeeded", owner, 1000, 500, 1100.0, 100.0)
    state = node_state(conn, node)
    assert (state["inflight"], state["successes"], state["latency"]) == (0, 1, 1100.0)
    assert state["tps"] == pytest.approx(500.0)  # 500 tokens streamed in the 1.0 s after the first byte
    spent = conn.execute("select spent_usd from api_keys where id = %s", (key,)).fetchone()
    assert spent is not None and float(spent[0]) == pytest.approx(cost)
    attempt = conn.execute("select status, ended_at is not null from job_attempts").fetchone()
    assert attempt == ("succeeded", True)
    with pytest.raises(ConflictError, match="is not running"):
        complete_job(conn, match.job_id)


def test_a_whole_answer_measures_no_speed(conn: psycopg.Connection) -> None:
    """A whole answer's first byte comes with its last token: 500 tokens 10 ms after it is no speed."""
    node = make_node(conn)
    match = match_job(conn, REQUEST)
    complete_job(conn, match.job_id, completion_tokens=500, ttft_ms=1090, latency_ms=1100)
    state = node_state(conn, node)
    assert (state["successes"], state["latency"], state["tps"]) == (1, 1100.0, None)


def test_time_priced_model_costs_a_slot_of_node_time(conn: psycopg.Connection) -> None:
    make_node(conn, hourly_rate=3.6, max_concurrency=4, models={"custom:7b": "loaded"})
    match = match_job(conn, MatchRequest(model="custom:7b"))
    cost = complete_job(conn, match.job_id, latency_ms=1000)
    assert cost == pytest.approx(3.6 / 3600 / 4)


def test_a_price_raised_while_a_job_runs_is_not_its_price(conn: psycopg.Connection) -> None:
    """Found by a security review: a job priced by node time was charged the node's price as it was
    when the job ended, which its owner may change through the Data API; raised a million-fold (and
    its slots cut to one) mid-job, a one-minute job cost its key $16,666 and earned the owner 85% of
    it. A job is never charged more than the node's price when it was placed: it pays the lower of
    the price now and the lowest the node had in the job deadline (15 minutes) before; a cut applies
    at once."""
    node = make_node(conn, hourly_rate=3.6, max_concurrency=4, models={"custom:7b": "loaded"})
    running = match_job(conn, MatchRequest(model="custom:7b"))
    conn.execute("update nodes set hourly_rate = 9999, max_concurrency = 1 where id = %s", (node,))
    assert complete_job(conn, running.job_id, latency_ms=1000) == pytest.approx(3.6 / 3600 / 4)
    # Placed after the rise and ended within the deadline: the lower price it rose from.
    after = match_job(conn, MatchRequest(model="custom:7b"))
    assert complete_job(conn, after.job_id, latency_ms=1000) == pytest.approx(3.6 / 3600 / 4)
    # Placed after the rise and ended after it: the price it was placed at, never more (a review
    # read "a rise applies to jobs placed a deadline later" in the docs; no job was charged more
    # than its placement's price, but the docs promised more than that).
    later_end = match_job(conn, MatchRequest(model="custom:7b"))
    conn.execute("update nodes set price_floor_until = now() - interval '1 second' where id = %s", (node,))
    assert complete_job(conn, later_end.job_id, latency_ms=1000) == pytest.approx(9999 / 3600)
    # A cut applies at once.
    conn.execute("update nodes set hourly_rate = 0.36, max_concurrency = 4 where id = %s", (node,))
    cut = match_job(conn, MatchRequest(model="custom:7b"))
    assert complete_job(conn, cut.job_id, latency_ms=1000) == pytest.approx(0.36 / 3600 / 4)
    # Once a job deadline has passed since the rise, the new price is the price.
    conn.execute("update nodes set hourly_rate = 36 where id = %s", (node,))
    conn.execute("update nodes set price_floor_until = now() - interval '1 second' where id = %s", (node,))
    later = match_job(conn, MatchRequest(model="custom:7b"))
    assert complete_job(conn, later.job_id, latency_ms=1000) == pytest.approx(36 / 3600 / 4)


def test_failover_moves_to_the_next_fallback_and_cools_the_node(conn: psycopg.Connection) -> None:
    first = make_node(conn, "first", vram_gb=24)
    second = make_node(conn, "second", vram_gb=48)
    match = match_job(conn, REQUEST)
    assert match.node_id == first
    nxt = failover_job(conn, match.job_id, "connection refused", candidates=match.fallback_ids)
    assert nxt is not None and (nxt.node_id, nxt.attempt) == (second, 2)
    state = node_state(conn, first)
    assert (state["inflight"], state["failures"], state["consecutive"]) == (0, 1, 1)
    assert state["cooldown"] is not None
    # The cooled node is skipped by the next request.
    assert match_job(conn, REQUEST).node_id == second
    complete_job(conn, match.job_id, completion_tokens=3)
    attempts = conn.execute(
        "select attempt, node_id, status, error from job_attempts where job_id = %s order by attempt",
        (match.job_id,),
    ).fetchall()
    assert attempts == [(1, first, "failed", "connection refused"), (2, second, "succeeded", None)]
    assert conn.execute("select attempts, node_id from jobs where id = %s", (match.job_id,)).fetchone() == (
        2,
        second,
    )


def test_failover_with_no_candidate_left_fails_the_job(conn: psycopg.Connection) -> None:
    make_node(conn)
    match = match_job(conn, REQUEST)
    assert failover_job(conn, match.job_id, "HTTP 500", http_status=500, candidates=[]) is None
    job = conn.execute("select status, error from jobs where id = %s", (match.job_id,)).fetchone()
    assert job == ("failed", "HTTP 500")


def test_a_failover_waits_a_moment_for_a_free_node_a_heartbeat_holds(db_url: str) -> None:
    """The only other free node is held for a moment by another transaction (a heartbeat, a lease
    renewal): the failover waits for it rather than failing the job. A clean clone's CI run failed
    a request this way (a 502 with a free node online)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = make_node(conn, "first", hourly_rate=0.1)
        second = make_node(conn, "second", hourly_rate=2.0)
        match = match_job(conn, REQUEST)
        assert match.node_id == first and match.fallback_ids == [second]
    with (
        psycopg.connect(db_url) as beat,
        psycopg.connect(db_url, autocommit=True) as watch,
        ThreadPoolExecutor(1) as pool,
    ):
        beat.execute("select from nodes where id = %s for update", (second,))
        holder = beat.info.backend_pid

        def failover() -> uuid.UUID | None:
            with psycopg.connect(db_url, autocommit=True) as gateway:
                moved = failover_job(gateway, match.job_id, "HTTP 500", http_status=500, candidates=[second])
                return None if moved is None else moved.node_id

        moving = pool.submit(failover)
        # The beat ends as soon as the failover is seen waiting for it (its wait is 250 ms).
        deadline = time.monotonic() + 10
        while not moving.done() and time.monotonic() < deadline:
            blocked = "select 1 from pg_stat_activity where %s = any (pg_blocking_pids(pid))"
            if watch.execute(blocked, (holder,)).fetchone():
                break
        seen_waiting = not moving.done()
        beat.commit()
        assert seen_waiting, f"the failover did not wait for the held node: {moving.result()}"
        assert moving.result(timeout=10) == second


def test_a_failover_gives_up_on_a_node_held_past_its_wait(db_url: str) -> None:
    """Held past the failover's short wait (which ends any cycle of waits through the running node's
    row well before deadlock_timeout), the node is passed over: the job fails, cleanly, soon, and
    nothing after the wait is held to it."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = make_node(conn, "first", hourly_rate=0.1)
        second = make_node(conn, "second", hourly_rate=2.0)
        match = match_job(conn, REQUEST)
        assert match.node_id == first
        with psycopg.connect(db_url) as holder, conn.transaction():
            holder.execute("select from nodes where id = %s for update", (second,))
            conn.execute("set local lock_timeout = '7s'")
            started = time.monotonic()
            assert failover_job(conn, match.job_id, "HTTP 500", http_status=500, candidates=[second]) is None
            assert time.monotonic() - started < 3  # its own wait, not the caller's 7 s
            # The short wait was that lock's alone: what comes after it waits as the caller said.
            assert conn.execute("show lock_timeout").fetchone() == ("7s",)
        assert conn.execute("select status from jobs where id = %s", (match.job_id,)).fetchone() == (
            "failed",
        )
        assert node_state(conn, first)["inflight"] == 0 and node_state(conn, second)["inflight"] == 0


HANDOFF = "select node_id, attempt from handoff_job(%s, 'the node dropped the stream', %s::uuid[])"


def test_handoff_moves_a_job_as_failover_does(conn: psycopg.Connection) -> None:
    first, second = make_node(conn, "first", vram_gb=24), make_node(conn, "second", vram_gb=48)
    match = match_job(conn, REQUEST)
    assert conn.execute(HANDOFF, (match.job_id, match.fallback_ids)).fetchall() == [(second, 2)]
    assert node_state(conn, first)["failures"] == 1 and node_state(conn, first)["cooldown"] is not None


def test_a_handoff_for_a_tunnel_no_gateway_reaches_is_neutral_for_the_node(conn: psycopg.Connection) -> None:
    """421: the gateway holding the node's tunnel broke off mid-stream. The platform's failure: the
    attempt ends cancelled, the node keeps its record and cools down not at all."""
    first, second = make_node(conn, "first", vram_gb=24), make_node(conn, "second", vram_gb=48)
    match = match_job(conn, REQUEST)
    moved = conn.execute(
        "select node_id, attempt from handoff_job(%s, 'the holder broke off', 421, %s::uuid[])",
        (match.job_id, match.fallback_ids),
    ).fetchall()
    assert moved == [(second, 2)]
    state = node_state(conn, first)
    assert (state["failures"], state["cooldown"], state["inflight"]) == (0, None, 0)
    attempt = conn.execute(
        "select status, http_status from job_attempts where job_id = %s and attempt = 1", (match.job_id,)
    ).fetchone()
    assert attempt == ("cancelled", 421)


def test_handoff_with_no_node_left_changes_nothing(conn: psycopg.Connection) -> None:
    node = make_node(conn)
    key = make_key(conn)
    conn.execute("update api_keys set budget_usd = 1 where id = %s", (key,))
    match = match_job(conn, REQUEST, api_key_id=key, reserve_usd=0.25)
    state = (
        "select (select row(j.*)::text from jobs j), (select array_agg(row(a.*)::text) from job_attempts a),"
    )
    state += " (select row(n.*)::text from nodes n), (select row(k.*)::text from api_keys k)"
    before = conn.execute(state).fetchone()
    assert conn.execute(HANDOFF, (match.job_id, [])).fetchall() == []
    assert conn.execute(state).fetchone() == before
    complete_job(conn, match.job_id, status="failed", completion_tokens=3)  # the job still ends as it was
    assert node_state(conn, node)["inflight"] == 0


def test_cooldown_grows_exponentially_and_is_capped(conn: psycopg.Connection) -> None:
    node = make_node(conn)
    seconds = []
    for _ in range(8):
        conn.execute("update nodes set cooldown_until = null where id = %s", (node,))
        match = match_job(conn, REQUEST)
        failover_job(conn, match.job_id, "boom", candidates=[])
        row = conn.execute(
            "select extract(epoch from cooldown_until - now()) from nodes where id = %s", (node,)
        ).fetchone()
        assert row is not None
        seconds.append(round(float(row[0])))
    assert seconds == [5, 10, 20, 40, 80, 160, 300, 300]


def test_bad_arguments_are_refused(conn: psycopg.Connection) -> None:
    make_node(conn)
    match = match_job(conn, REQUEST)
    with pytest.raises(InvalidRequest, match="ends succeeded, failed or cancelled"):
        complete_job(conn, match.job_id, status="done")  # type: ignore[arg-type]  # SQL must refuse it
    with pytest.raises(InvalidRequest, match="must not be negative"):
        complete_job(conn, match.job_id, prompt_tokens=-1)
    with pytest.raises(InvalidRequest, match="fallbacks must not be negative"):
        match_job(conn, REQUEST, fallbacks=-1)
    # Nothing half-done: the job is still running and its node still holds the slot.
    assert conn.execute("select status from jobs where id = %s", (match.job_id,)).fetchone() == ("running",)


async def test_concurrent_matches_never_overcommit(db_url: str) -> None:
    """200 concurrent match_job calls on 5 nodes x 8 slots: exactly 40 claims, no node over 8."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        nodes = [make_node(conn, max_concurrency=8) for _ in range(5)]

    async def one(sem: asyncio.Semaphore) -> uuid.UUID | None:
        async with sem, await psycopg.AsyncConnection.connect(db_url, autocommit=True) as aconn:
            cur = await aconn.execute("select node_id from match_job(%s)", (LLAMA8,))
            row = await cur.fetchone()
            return row[0] if row else None

    sem = asyncio.Semaphore(50)  # 50 connections at once, 200 calls in all
    results = await asyncio.gather(*(one(sem) for _ in range(200)))
    claimed = [r for r in results if r is not None]
    assert len(claimed) == 40
    assert {n: claimed.count(n) for n in nodes} == dict.fromkeys(nodes, 8)
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("select inflight, max_concurrency, status from nodes").fetchall()
        assert all(r == (8, 8, "busy") for r in rows)
        counts = conn.execute("select status, count(*) from jobs group by 1 order by 1").fetchall()
        assert counts == [("failed", 160), ("running", 40)]


def test_a_claim_that_waited_for_a_node_filled_meanwhile_takes_another(db_url: str) -> None:
    """Both free nodes are locked when the claim looks (one by a claim taking its last slot, one by
    a heartbeat): it waits for the first, finds it full, and takes the second rather than answering
    "none free"."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = make_node(conn, "first", hourly_rate=0.1, max_concurrency=2, inflight=1)
        second = make_node(conn, "second", hourly_rate=2.0)
    with psycopg.connect(db_url) as claim, psycopg.connect(db_url) as beat, ThreadPoolExecutor(1) as pool:
        claim.execute("update nodes set inflight = 2, status = 'busy' where id = %s", (first,))
        beat.execute("select from nodes where id = %s for update", (second,))

        def match() -> uuid.UUID | None:
            with psycopg.connect(db_url, autocommit=True) as third:
                return match_job(third, REQUEST).node_id

        waiting = pool.submit(match)
        with psycopg.connect(db_url, autocommit=True) as watch:
            wait_for(
                lambda: watch.execute(
                    "select 1 from pg_stat_activity where wait_event_type = 'Lock' and query like '%match_job%'"
                ).fetchone()
            )
        beat.commit()
        claim.commit()
        assert waiting.result(timeout=10) == second


def test_a_node_deleted_mid_job_still_lets_the_job_finish(conn: psycopg.Connection) -> None:
    node = make_node(conn, models={"custom:7b": "loaded"})
    match = match_job(conn, MatchRequest(model="custom:7b"))
    conn.execute("delete from nodes where id = %s", (node,))
    assert complete_job(conn, match.job_id, completion_tokens=5) == 0.0
    assert conn.execute("select status, node_id from jobs").fetchone() == ("succeeded", None)


def test_an_unknown_api_key_is_refused(conn: psycopg.Connection) -> None:
    make_node(conn)
    with pytest.raises(InvalidRequest, match="api_key"):
        match_job(conn, REQUEST, api_key_id=uuid.uuid4())
    assert conn.execute("select count(*) from jobs").fetchone() == (0,)


def test_budget_reservations_hold_under_concurrency_in_sql(conn: psycopg.Connection) -> None:
    """Each match holds its estimate; once spent + held reaches the budget, matches are refused."""
    conn.execute("select set_config('request.jwt.claims', '', false)")
    key = conn.execute("select id from create_api_key('b', null, null, 1.0)").fetchone()
    assert key is not None
    make_node(conn, max_concurrency=64)
    held = [match_job(conn, REQUEST, api_key_id=key[0], reserve_usd=0.3) for _ in range(3)]
    with pytest.raises(BudgetExhausted):
        match_job(conn, REQUEST, api_key_id=key[0], reserve_usd=0.3)
    assert conn.execute("select reserved_usd::float8 from api_keys").fetchone() == (pytest.approx(0.9),)
    # Finishing releases the hold and charges the real cost (catalog price: tiny here).
    for m in held:
        complete_job(conn, m.job_id, prompt_tokens=10, completion_tokens=10)
    spent, reserved = conn.execute("select spent_usd, reserved_usd from api_keys").fetchone() or (0, 0)
    assert float(reserved) == 0 and float(spent) == pytest.approx(3 * (10 * 0.05 + 10 * 0.10) / 1e6)
    # With nothing held and budget left, one request is admitted even if its estimate is larger.
    big = match_job(conn, REQUEST, api_key_id=key[0], reserve_usd=5.0)
    assert big.node_id is not None
    with pytest.raises(BudgetExhausted):
        match_job(conn, REQUEST, api_key_id=key[0], reserve_usd=0.01)
    failover_job(conn, big.job_id, "boom", candidates=[])  # a failed job releases its hold too
    assert conn.execute("select reserved_usd from api_keys").fetchone() == (0,)


def test_a_node_far_slower_than_its_claimed_gpu_loses_reputation(conn: psycopg.Connection) -> None:
    honest = make_node(conn, "honest-4090", tflops=165)
    liar = make_node(conn, "claims-h100", tflops=989)  # more compute: it ranks first on its word
    assert match_job(conn, REQUEST).node_id == liar
    conn.execute("update nodes set inflight = 0, status = 'online'")
    conn.execute("update jobs set status = 'cancelled', finished_at = now()")
    for _ in range(5):  # it delivers 10 tokens/s; an H100 should give ~346 on an 8B model
        match = match_job(conn, MatchRequest(model=LLAMA8, max_hourly_rate=None), stream=True)
        if match.node_id != liar:
            complete_job(conn, match.job_id, completion_tokens=10, ttft_ms=0, latency_ms=100)
            continue
        complete_job(conn, match.job_id, completion_tokens=100, ttft_ms=0, latency_ms=10_000)
    ratio = conn.execute("select speed_ratio from nodes where id = %s", (liar,)).fetchone()
    assert ratio is not None and ratio[0] < 0.05
    ranked = {r.name: r for r in score_nodes(conn, REQUEST)}
    assert ranked["claims-h100"].reputation is not None and ranked["claims-h100"].reputation < 0.25
    assert score_nodes(conn, REQUEST, limit=1)[0].name == "honest-4090"  # its lie no longer pays
    assert match_job(conn, REQUEST).node_id == honest
