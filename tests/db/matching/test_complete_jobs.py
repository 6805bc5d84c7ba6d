"""complete_jobs(): a batch ends jobs exactly as ending them one at a time, in order, would.

complete_job() is a batch of one, so comparing the two checks what batching adds: the folding of
averages, failure streaks, cooldowns and charges per node and key. test_match_job.py pins the values
one ending gives."""

from __future__ import annotations

import random
import uuid
from typing import Any

import psycopg
import pytest

from neuralgrid.db import queries as q
from neuralgrid.db.errors import InvalidRequest
from neuralgrid.db.matching import JobEnd, MatchRequest, complete_job, complete_jobs, failover_job, match_job
from neuralgrid.db.store import without_nul
from tests.conftest import LLAMA8, make_key, make_node

TIME_PRICED = "custom:7b"  # not in the catalog: priced by node time

NODES = "select id, status, inflight, successes, failures, consecutive_failures, extract(epoch from cooldown_until - now()), ewma_latency_ms, ewma_tokens_per_s, speed_ratio from nodes order by id"
JOBS = "select id, status, prompt_tokens, completion_tokens, cost_usd, ttft_ms, latency_ms, error, finished_at is not null from jobs order by id"
ATTEMPTS = "select job_id, attempt, status, error, ttft_ms, latency_ms, ended_at is not null from job_attempts order by job_id, attempt"
KEYS = "select id, reserved_usd, spent_usd, last_used_at is not null from api_keys order by id"


def _state(conn: psycopg.Connection) -> dict[str, list[tuple[Any, ...]]]:
    return {
        name: conn.execute(query).fetchall()
        for name, query in (("nodes", NODES), ("jobs", JOBS), ("attempts", ATTEMPTS), ("keys", KEYS))
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-5, abs=0.01)  # reals; cooldowns in seconds from now()
    return a == b


def _random_batch(conn: psycopg.Connection, rng: random.Random) -> list[JobEnd]:
    nodes = [
        make_node(
            conn,
            max_concurrency=64,
            tflops=rng.choice([20, 165, 989]),
            models={LLAMA8: "loaded", TIME_PRICED: "loaded"},
        )
        for _ in range(3)
    ]
    # Some history, so that averages, failure streaks and cooldowns start from something.
    conn.execute(
        "update nodes set ewma_latency_ms = %s, consecutive_failures = %s where id = %s",
        (rng.choice([None, 500.0]), rng.choice([0, 3]), nodes[0]),
    )
    conn.execute("select set_config('request.jwt.claims', '', false)")
    budgeted = conn.execute("select id from create_api_key('budgeted', null, null, 5.0)").fetchone()
    assert budgeted is not None
    keys = [make_key(conn), budgeted[0], None]
    ends = []
    for _ in range(rng.randint(1, 24)):
        model = rng.choice([LLAMA8, TIME_PRICED])
        match = match_job(conn, MatchRequest(model=model), api_key_id=rng.choice(keys), reserve_usd=0.01)
        assert match.node_id is not None
        ttft = rng.choice([None, 0.0, 120.0])
        ends.append(
            JobEnd(
                match.job_id,
                status=rng.choice(["succeeded", "succeeded", "failed", "cancelled"]),
                prompt_tokens=rng.randint(0, 2000),
                completion_tokens=rng.choice([0, 1, 300]),
                ttft_ms=ttft,
                latency_ms=rng.choice([90.0, 2500.0]),
                error=rng.choice([None, "the node dropped the stream"]),
            )
        )
    rng.shuffle(ends)
    return ends


@pytest.mark.parametrize("seed", range(8))
def test_a_batch_ends_jobs_as_one_at_a_time_does(db_url: str, seed: int) -> None:
    with psycopg.connect(db_url, autocommit=True) as setup:
        ends = _random_batch(setup, random.Random(seed))
    with psycopg.connect(db_url) as conn:
        one_by_one = {}
        for end in ends:
            one_by_one[end.job_id] = complete_job(
                conn,
                end.job_id,
                status=end.status,
                prompt_tokens=end.prompt_tokens,
                completion_tokens=end.completion_tokens,
                ttft_ms=end.ttft_ms,
                latency_ms=end.latency_ms,
                error=end.error,
            )
        expected = _state(conn)
        conn.rollback()
        batched = complete_jobs(conn, ends)
        got = _state(conn)
        conn.rollback()
    assert batched.keys() == one_by_one.keys()
    assert [batched[j] for j in batched] == pytest.approx([one_by_one[j] for j in batched])
    for table in expected:
        for row_expected, row_got in zip(expected[table], got[table], strict=True):
            assert all(map(_same, row_expected, row_got)), (table, row_expected, row_got)


def test_jobs_no_longer_running_are_left_out(conn: psycopg.Connection) -> None:
    make_node(conn, max_concurrency=8)
    first, second = (match_job(conn, MatchRequest(model=LLAMA8)) for _ in range(2))
    complete_job(conn, first.job_id)
    ended = complete_jobs(conn, [JobEnd(first.job_id), JobEnd(second.job_id), JobEnd(uuid.uuid4())])
    assert list(ended) == [second.job_id]
    assert conn.execute("select inflight, successes from nodes").fetchone() == (0, 2)
    # A latency left out is measured by the database, from the attempt's start.
    latency = conn.execute("select latency_ms from jobs where id = %s", (second.job_id,)).fetchone()
    assert latency is not None and latency[0] > 0
    assert complete_jobs(conn, []) == {}


def test_a_bad_batch_is_refused_and_changes_nothing(conn: psycopg.Connection) -> None:
    make_node(conn)
    job = match_job(conn, MatchRequest(model=LLAMA8)).job_id
    bad = [
        [JobEnd(job, status="done")],  # type: ignore[arg-type]  # SQL must refuse it
        [JobEnd(job, prompt_tokens=-1)],
        [JobEnd(job), JobEnd(job)],
    ]
    for ends in bad:
        with pytest.raises(InvalidRequest):
            complete_jobs(conn, ends)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="arrays of one length"):
        conn.execute(  # one array short
            "select * from complete_jobs(array[%s]::uuid[], '{succeeded}', '{1}', '{1}', '{1}', '{1}', '{}')",
            (job,),
        )
    assert conn.execute("select status from jobs").fetchone() == ("running",)
    assert conn.execute("select inflight from nodes").fetchone() == (1,)


def test_text_from_outside_with_nul_bytes_is_written(conn: psycopg.Connection) -> None:
    """Postgres text cannot hold NUL: a node's error message with one still ends its job, and still
    fails it over, the NUL written as U+FFFD."""
    make_node(conn, max_concurrency=8)
    ended, moved = (match_job(conn, MatchRequest(model=LLAMA8)).job_id for _ in range(2))
    assert list(complete_jobs(conn, [JobEnd(ended, status="failed", error="bad\x00byte")])) == [ended]
    assert failover_job(conn, moved, "tunnel said \x00", candidates=[]) is None  # no node left: failed
    errors: dict[uuid.UUID, str] = dict(conn.execute("select id, error from jobs").fetchall())
    assert errors == {ended: "bad\ufffdbyte", moved: "tunnel said \ufffd"}
    assert without_nul({"model": "a\x00", "limit": 3}) == {"model": "a\ufffd", "limit": 3}
    params = q.complete_jobs_params([JobEnd(ended, error="clean")])
    assert without_nul(params) is params  # nothing to replace: nothing copied


def test_a_claim_and_its_release_leave_the_indexes_alone(conn: psycopg.Connection) -> None:
    """Both change only the node's load: heap-only updates, which write no index entry."""
    make_node(conn)
    with conn.transaction():
        job = match_job(conn, MatchRequest(model=LLAMA8)).job_id
        assert job is not None
        complete_job(conn, job)
        updated, heap_only = conn.execute(
            "select pg_stat_get_xact_tuples_updated(r), pg_stat_get_xact_tuples_hot_updated(r)"
            " from (select 'public.nodes'::regclass::oid as r) t"
        ).fetchone() or (None, None)
    assert (updated, heap_only) == (2, 2)


def test_the_rescored_rows_carry_only_the_indexes_the_matcher_reads(conn: psycopg.Connection) -> None:
    """A claim and a release each rescore the node's node_scores rows, one per policy and model it
    serves: never heap-only updates (the score is indexed), so each writes an entry into every index
    of the table. Those are the matcher's three walks (by score; within a region; within a VRAM
    tier) and the key, node first, which also finds a node's rows for the rescoring."""
    rows = conn.execute(
        "select c.relname::text, pg_get_indexdef(i.indexrelid) from pg_index i"
        " join pg_class c on c.oid = i.indexrelid where i.indrelid = 'public.node_scores'::regclass"
    ).fetchall()
    keys = {name: definition.split(" USING btree ")[1] for name, definition in rows}
    assert keys == {
        "node_scores_pkey": "(node_id, policy, model_id)",
        "node_scores_rank_idx": "(policy, model_id, base_score DESC, node_id)",
        "node_scores_region_rank_idx": "(policy, model_id, region, base_score DESC, node_id)",
        "node_scores_tier_rank_idx": "(policy, model_id, tier_gb, base_score DESC, node_id)",
    }
