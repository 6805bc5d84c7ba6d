"""Leased jobs written behind (issue 42): record_jobs() records a job a gateway dispatched on a
leased slot and ends it as complete_jobs() ends any job (the same price, charge, earnings and node
figures), idempotently, freeing no slot (the lease holds it); its hold moves from the gateway's escrow
to the job; failover, hand-over, rejection and the sweep work on it as on a placed job."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from neuralgrid.db import queries as q
from neuralgrid.db.store import SyncStore
from neuralgrid.gateway.journal import JobRecord
from tests.conftest import LLAMA8, make_key, make_node, make_user
from tests.slots import ENDED, JOB_SLOTS, record

GATEWAY = uuid.UUID("00000000-0000-4000-8000-0000000000a1")


def lease(conn: psycopg.Connection, want: int) -> list[q.LeaseRow]:
    lanes: list[dict[str, Any]] = [
        {"model": LLAMA8, "policy": "balanced", "region": None, "want": want, "in_use": {}}
    ]
    return SyncStore(conn).all(q.RENEW_LEASES, (GATEWAY, json.dumps(lanes)))


def write(
    conn: psycopg.Connection, *records: dict[str, Any], gateway: uuid.UUID = GATEWAY
) -> list[q.RecordedJob]:
    return SyncStore(conn).all(q.RECORD_JOBS, (gateway, json.dumps(list(records))))


def one(conn: psycopg.Connection, sql: str, *params: Any) -> Any:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0] if len(row) == 1 else tuple(row)


def place_in_sql(conn: psycopg.Connection, key: uuid.UUID) -> q.Match:
    """A request placed in SQL as GATEWAY places one (PLACE_JOB): its job holds a slot in SQL."""
    params = q.match_params(
        q.MatchRequest(model=LLAMA8), key, False, 0, prompt_bytes=4, max_out=4, wait=False
    )
    return SyncStore(conn).get(q.PLACE_JOB, {**params, "gateway": str(GATEWAY), "end_user": None})


def job_record(job: uuid.UUID, node: uuid.UUID, key: uuid.UUID | None = None) -> JobRecord:
    """The journal's record of a job dispatched now, holding nothing of a budget."""
    return JobRecord(job, key, LLAMA8, "balanced", None, False, node, datetime.now(UTC), Decimal(0), None)


def key_money(conn: psycopg.Connection, key: uuid.UUID) -> tuple[Any, Any]:
    """The key's (reserved_usd, spent_usd)."""
    return tuple(one(conn, "select reserved_usd, spent_usd from api_keys where id = %s", key))


def assert_reserved_adds_up(conn: psycopg.Connection, key: uuid.UUID) -> None:
    """reserved_usd is the escrows held for the key plus the holds of its running jobs."""
    assert key_money(conn, key)[0] == one(
        conn,
        "select coalesce((select sum(usd) from private.key_escrows where api_key_id = %s), 0)"
        " + coalesce((select sum(reserved_usd) from jobs where api_key_id = %s and status = 'running'), 0)",
        key,
        key,
    )


def escrow(conn: psycopg.Connection, key: uuid.UUID, usd: str) -> None:
    """An escrow as renew_escrows() leaves one: held on the key too."""
    conn.execute(
        "insert into private.key_escrows (gateway_id, api_key_id, usd) values (%s, %s, %s)",
        (GATEWAY, key, usd),
    )
    conn.execute("update api_keys set reserved_usd = reserved_usd + %s::numeric where id = %s", (usd, key))


def test_a_leased_job_is_recorded_then_ended_without_freeing_its_slot(conn: psycopg.Connection) -> None:
    node = make_node(conn, max_concurrency=4)
    key = make_key(conn, budget_usd=5.0)
    escrow(conn, key, "1.0")
    lease(conn, 2)
    assert one(conn, "select inflight from nodes") == 2
    job = uuid.uuid4()
    assert write(conn, record(job, node, key, hold="0.3")) == [q.RecordedJob(job, None, "started")]
    row = conn.execute(
        "select status, node_id, attempts, gateway_id, api_key_id, owner_id is not distinct from"
        " (select owner_id from api_keys where id = %s), reserved_usd, end_user, cold_start, stream,"
        " min_vram_gb > 0 from jobs where id = %s",
        (key, job),
    ).fetchone()
    assert row == ("running", node, 1, GATEWAY, key, True, Decimal("0.3"), "end-user-7", False, True, True)
    assert conn.execute("select attempt, node_id, leased, status from job_attempts").fetchall() == [
        (1, node, True, "running")
    ]
    # The hold left the escrow for the job; the key holds what it held.
    assert one(conn, "select usd from private.key_escrows") == Decimal("0.7")
    assert key_money(conn, key) == (Decimal("1.0"), 0)
    assert_reserved_adds_up(conn, key)
    assert one(conn, "select inflight from nodes") == 2  # the lease's slots, nothing more

    ended = write(conn, record(job, node, key, end=ENDED, hold="0.3"))
    assert ended == [q.RecordedJob(job, Decimal("0.00005900"), "ended")]
    assert conn.execute("select status, cost_usd, prompt_tokens from jobs").fetchone() == (
        "succeeded",
        Decimal("0.00005900"),
        1000,
    )
    assert one(conn, "select inflight, successes, status from nodes") == (2, 1, "online")
    assert key_money(conn, key) == (Decimal("0.7"), Decimal("0.00005900"))
    assert_reserved_adds_up(conn, key)
    # Written again (a retry, a replayed spool): nothing twice.
    assert write(conn, record(job, node, key, end=ENDED, hold="0.3")) == [
        q.RecordedJob(job, Decimal("0.00005900"), "already")
    ]
    assert key_money(conn, key) == (Decimal("0.7"), Decimal("0.00005900"))
    assert one(conn, "select successes from nodes") == 1
    assert one(conn, "select count(*) from job_attempts") == 1


def test_a_leased_job_costs_and_earns_what_a_placed_one_does(conn: psycopg.Connection) -> None:
    """Started and ended in one call, priced by the same SQL: the same cost, charge, earning and
    node figures as a job placed by match_job() and ended by complete_job() with the same usage."""
    owner = one(conn, "insert into auth.users (email) values ('owner@example.test') returning id")
    make_node(conn, "placed", owner_id=owner, max_concurrency=4)
    leased_node = make_node(conn, "leased", owner_id=owner, max_concurrency=4)
    placed_key, leased_key = make_key(conn, budget_usd=5.0), make_key(conn, budget_usd=5.0)
    conn.execute("update nodes set status = 'offline' where id = %s", (leased_node,))
    placed = one(conn, "select job_id from match_job(%s, %s, p_stream => true)", LLAMA8, placed_key)
    conn.execute("select * from complete_job(%s, 'succeeded', 1000, 90, 100, 1000)", (placed,))
    conn.execute(
        "update nodes set status = case when id = %s then 'online' else 'offline' end", (leased_node,)
    )
    lease(conn, 1)
    job = uuid.uuid4()
    assert write(conn, record(job, leased_node, leased_key, end=ENDED)) == [
        q.RecordedJob(job, Decimal("0.00005900"), "started+ended")
    ]
    figures = (
        "select j.cost_usd, j.status, k.spent_usd, k.reserved_usd, e.gross_usd, e.fee_usd, e.net_usd, n.successes,"
        " n.ewma_latency_ms, n.ewma_tokens_per_s from jobs j join api_keys k on k.id = j.api_key_id"
        " join earnings e on e.job_id = j.id join nodes n on n.id = j.node_id where j.id = %s"
    )
    assert one(conn, figures, job) == one(conn, figures, placed)
    assert one(conn, "select inflight from nodes where id = %s", leased_node) == 1  # the lease's


def test_a_job_recorded_with_its_end_is_written_once_as_a_start_and_an_end_would_leave_it(
    conn: psycopg.Connection,
) -> None:
    """A job that ended before its gateway wrote it is inserted ended: neither its job nor its
    attempt is updated (each was inserted running, then updated, in the same call), and what it
    leaves (the rows, the charge, the escrow, the earning, the developer's broadcast) is what a
    start and a later end leave."""
    dev, owner = make_user(conn), make_user(conn)
    node = make_node(conn, owner_id=owner, max_concurrency=4)
    key = make_key(conn, owner=dev, budget_usd=5.0)
    escrow(conn, key, "1.0")
    lease(conn, 2)
    later, once = uuid.uuid4(), uuid.uuid4()
    started = datetime.now(UTC) - timedelta(seconds=2)
    write(conn, record(later, node, key, hold="0.3", started_at=started.isoformat()))
    write(conn, record(later, node, key, end=ENDED, hold="0.3", started_at=started.isoformat()))
    # The session's counts of rows inserted and updated (its earlier transactions' too, until
    # they are flushed to the shared statistics): what the call adds to them.
    counts = (
        "select relname, n_tup_ins, n_tup_upd from pg_stat_xact_user_tables"
        " where relname in ('jobs', 'job_attempts') order by relname"
    )
    with conn.transaction():
        before = conn.execute(counts).fetchall()
        recorded = write(conn, record(once, node, key, end=ENDED, hold="0.3", started_at=started.isoformat()))
        after = conn.execute(counts).fetchall()
    assert recorded == [q.RecordedJob(once, Decimal("0.00005900"), "started+ended")]
    written = [
        (name, ins - ins0, upd - upd0)
        for (name, ins, upd), (_, ins0, upd0) in zip(after, before, strict=True)
    ]
    assert written == [("job_attempts", 1, 0), ("jobs", 1, 0)]

    job = (
        "select j.api_key_id, j.owner_id, j.model_id, j.policy, j.status, j.node_id, j.attempts, j.stream,"
        " j.region, j.min_vram_gb, j.prompt_tokens, j.completion_tokens, j.cost_usd, j.ttft_ms, j.latency_ms,"
        " j.error, j.reserved_usd, j.created_at, j.gateway_id, j.end_user, j.cold_start, j.finished_at > j.created_at,"
        " a.attempt, a.node_id, a.leased, a.status, a.ttft_ms, a.latency_ms, a.error, a.started_at,"
        " a.ended_at > a.started_at, e.node_id, e.owner_id, e.gross_usd, e.fee_usd, e.net_usd,"
        " e.settles_at - e.earned_at, e.forfeited_at"
        " from jobs j join job_attempts a on a.job_id = j.id join earnings e on e.job_id = j.id where j.id = %s"
    )
    assert one(conn, job, once) == one(conn, job, later)
    assert one(conn, "select successes, inflight from nodes") == (2, 2)
    assert key_money(conn, key) == (Decimal("0.4"), Decimal("0.00011800"))  # the escrow's 1.0 less two holds
    assert_reserved_adds_up(conn, key)
    jobs = conn.execute(
        "select event, payload -> 'job' ->> 'id' from realtime.messages where topic = %s order by inserted_at",
        (f"jobs:{dev}",),
    ).fetchall()
    assert jobs == [("job_succeeded", str(later)), ("job_succeeded", str(once))]


def test_a_job_recorded_ended_without_saying_stream_is_not_a_stream(conn: psycopg.Connection) -> None:
    """ "stream" may be left out, as for a running record (found in review: the ended insert wrote
    null into a column that takes none, and the journal dropped the record)."""
    node = make_node(conn, max_concurrency=4)
    lease(conn, 1)
    job = uuid.uuid4()
    bare = {k: v for k, v in record(job, node, end=ENDED).items() if k != "stream"}
    assert [r.recorded for r in write(conn, bare)] == ["started+ended"]
    assert one(conn, "select stream, status from jobs where id = %s", job) == (False, "succeeded")


def test_a_job_two_calls_record_at_once_is_recorded_once(conn: psycopg.Connection, db_url: str) -> None:
    """Two calls carry the same ended job (a batch retried while its first try still runs, a spool
    written twice): the second waits for the first's locks and finds the job recorded, rather than
    failing on its id (found in review) or taking its hold from the escrow twice."""
    node = make_node(conn, max_concurrency=4)
    key = make_key(conn, budget_usd=5.0)
    escrow(conn, key, "1.0")
    lease(conn, 1)
    job = uuid.uuid4()
    with (
        psycopg.connect(db_url, autocommit=True) as first,
        psycopg.connect(db_url, autocommit=True) as second,
        ThreadPoolExecutor(1) as pool,
    ):
        with first.transaction():
            written = write(first, record(job, node, key, end=ENDED, hold="0.3"))
            assert [r.recorded for r in written] == ["started+ended"]
            later = pool.submit(write, second, record(job, node, key, end=ENDED, hold="0.3"))
            time.sleep(0.3)  # the second call waits on the node the first holds
            assert not later.done()
        assert [r.recorded for r in later.result(timeout=10)] == ["already"]
    assert one(conn, "select count(*) from jobs") == 1
    assert one(conn, "select usd from private.key_escrows") == Decimal("0.7")
    assert key_money(conn, key) == (Decimal("0.7"), Decimal("0.00005900"))
    assert_reserved_adds_up(conn, key)


def test_a_recorded_leased_job_fails_over_as_a_placed_one_and_frees_no_leased_slot(
    conn: psycopg.Connection,
) -> None:
    leased = make_node(conn, "leased", tflops=300, max_concurrency=2)
    lease(conn, 2)
    other = make_node(conn, "other", tflops=50, max_concurrency=2)
    job = uuid.uuid4()
    write(conn, record(job, leased))
    moved = conn.execute(
        "select node_id, attempt from failover_job(%s, 'boom', 502, %s)", (job, [other])
    ).fetchall()
    assert moved == [(other, 2)]
    assert conn.execute("select attempt, status, leased from job_attempts order by attempt").fetchall() == [
        (1, "failed", True),
        (2, "running", False),
    ]
    # The leased node is blamed (failure, cooldown) and keeps its slots held by the lease; the new
    # node's slot is a claim's, freed when the job ends.
    assert one(
        conn, "select inflight, failures, cooldown_until > now() from nodes where id = %s", leased
    ) == (
        2,
        1,
        True,
    )
    assert one(conn, "select inflight from nodes where id = %s", other) == 1
    # Its end, written behind or by complete_jobs(), frees the claimed slot, not a leased one.
    assert write(conn, record(job, leased, end=ENDED))[0].recorded == "ended"
    assert conn.execute("select id, inflight from nodes order by name").fetchall() == [
        (leased, 2),
        (other, 0),
    ]


def test_a_leased_job_moves_to_another_leased_slot(conn: psycopg.Connection) -> None:
    first = make_node(conn, "first", tflops=300, max_concurrency=1)
    second = make_node(conn, "second", tflops=50, max_concurrency=1)
    lease(conn, 2)
    job = uuid.uuid4()
    write(conn, record(job, first))
    moved = SyncStore(conn).one(q.MOVE_TO_LEASE, (job, "tunnel gone", 421, second))
    assert moved is not None and (moved.node_id, moved.attempt) == (second, 2)
    assert conn.execute("select attempt, status, leased from job_attempts order by attempt").fetchall() == [
        (1, "cancelled", True),
        (2, "running", True),
    ]
    # 421 is nobody's failure; no slot changes hands: both are the lease's.
    assert conn.execute("select name, inflight, failures from nodes order by name").fetchall() == [
        ("first", 1, 0),
        ("second", 1, 0),
    ]
    assert one(conn, "select node_id from jobs") == second
    conn.execute("select complete_job(%s)", (job,))
    assert SyncStore(conn).one(q.MOVE_TO_LEASE, (job, "boom", 502, first)) is None  # ended: nothing to move
    assert conn.execute("select inflight from nodes").fetchall() == [(1,), (1,)]


@pytest.mark.parametrize("how", ["reject_job", "abandoned by the sweep"])
def test_a_leased_job_ended_in_sql_frees_no_leased_slot(conn: psycopg.Connection, how: str) -> None:
    node = make_node(conn, max_concurrency=4)
    key = make_key(conn, budget_usd=5.0)
    lease(conn, 1)
    job = uuid.uuid4()
    write(conn, record(job, node, key, hold="0.2"))
    assert key_money(conn, key) == (Decimal("0.2"), 0)  # no escrow: held on the key anew
    if how == "reject_job":
        conn.execute("select reject_job(%s, 'bad request', 400)", (job,))
    else:
        conn.execute("update private.gateways set seen_at = now() - interval '1 minute'")
        conn.execute("update platform_settings set gateway_timeout_s = 0.5")
        conn.execute("select private.sweep_orphaned_jobs()")
    assert one(conn, "select status from jobs") in {"cancelled", "failed"}
    assert one(conn, "select inflight from nodes") == 1  # the lease's slot: the lease sweep frees it
    assert key_money(conn, key) == (0, 0)


def test_bad_records_are_refused_naming_them_and_nothing_is_written(conn: psycopg.Connection) -> None:
    node = make_node(conn, max_concurrency=4)
    key = make_key(conn, budget_usd=1.0)
    good = record(uuid.uuid4(), node, key, hold="0.1")
    cases: list[tuple[Any, type[psycopg.Error], str]] = [
        ({"id": "x"}, psycopg.errors.InvalidParameterValue, "JSON array"),
        (
            [good, {**good, "id": "job-1"}],
            psycopg.errors.InvalidParameterValue,
            r"record 2 \(job-1\): \"id\"",
        ),
        ([{**good, "key": 5}], psycopg.errors.InvalidParameterValue, '"key" must be'),
        ([{**good, "node": None}], psycopg.errors.InvalidParameterValue, '"node" must be'),
        ([{**good, "started_at": "yesterday"}], psycopg.errors.InvalidParameterValue, '"started_at"'),
        (
            [{**good, "started_at": "2026-13-45T00:00:00Z"}],
            psycopg.errors.InvalidParameterValue,
            "could not be read",
        ),
        ([{**good, "hold_usd": "-1"}], psycopg.errors.InvalidParameterValue, '"hold_usd"'),
        ([{**good, "end_user": "u" * 257}], psycopg.errors.InvalidParameterValue, '"end_user"'),
        ([{**good, "end": {**ENDED, "status": "done"}}], psycopg.errors.InvalidParameterValue, '"status"'),
        (
            [{**good, "end": {**ENDED, "prompt_tokens": -1}}],
            psycopg.errors.InvalidParameterValue,
            "token counts",
        ),
        (
            [{**good, "end": {**ENDED, "latency_ms": "1s"}}],
            psycopg.errors.InvalidParameterValue,
            '"latency_ms"',
        ),
        ([good, good], psycopg.errors.InvalidParameterValue, "appears twice"),
        (
            [{**good, "model": "acme/nobody-holds-this"}],
            psycopg.errors.InvalidParameterValue,
            "unknown model",
        ),
        (
            [{**good, "policy": "fastest-ever"}],
            psycopg.errors.InvalidParameterValue,
            "unknown matching policy",
        ),
        (
            [good, {**good, "id": str(uuid.uuid4()), "node": str(uuid.uuid4())}],
            psycopg.errors.ForeignKeyViolation,
            "record 2 .*no node with id",
        ),
        ([{**good, "key": str(uuid.uuid4())}], psycopg.errors.ForeignKeyViolation, "no API key with id"),
    ]
    for records, error, message in cases:
        with pytest.raises(error, match=message):
            conn.execute("select * from record_jobs(%s, %s::jsonb)", (GATEWAY, json.dumps(records)))
    assert one(conn, "select count(*) from jobs") == 0
    assert key_money(conn, key) == (0, 0)
    # Amounts as Python's str(Decimal) writes them are read.
    assert [
        r.recorded for r in write(conn, {**good, "hold_usd": "1E-8"}, record(uuid.uuid4(), node, hold="0E-8"))
    ] == [
        "started",
        "started",
    ]
    assert key_money(conn, key) == (Decimal("0.00000001"), 0)


def test_a_gateways_renewal_and_writes_run_one_after_the_other_in_postgres(
    conn: psycopg.Connection, db_url: str
) -> None:
    """The gateway sends a renewal and its journal's writes at once (gateway/leases.py: Renewals):
    they meet on the rows of its own jobs, and Postgres orders them (the gateway's advisory lock,
    taken first by each); another gateway's are not held up."""
    node = make_node(conn, max_concurrency=4)
    other = uuid.UUID("00000000-0000-4000-8000-0000000000a2")
    with psycopg.connect(db_url) as renewing:  # a renewal, not yet committed
        lease(renewing, 2)
        conn.execute("set lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            write(conn, record(uuid.uuid4(), node))
        assert [r.recorded for r in write(conn, record(uuid.uuid4(), node), gateway=other)] == ["started"]
        renewing.commit()
    job = uuid.uuid4()
    with psycopg.connect(db_url) as writing:  # a write, not yet committed
        write(writing, record(job, node))
        with pytest.raises(psycopg.errors.LockNotAvailable):
            lease(conn, 2)
        writing.commit()
    held_after = lease(conn, 2)
    assert one(conn, "select status from jobs where id = %s", job) == "running"
    assert sum(r.slots for r in held_after) == 2


# Escrows ------------------------------------------------------------------------------------------


def renew_escrows(conn: psycopg.Connection, *wants: tuple[uuid.UUID, str]) -> list[q.EscrowRow]:
    keys = [{"key": str(key), "want_usd": usd} for key, usd in wants]
    return SyncStore(conn).all(q.RENEW_ESCROWS, (GATEWAY, json.dumps(keys)))


def test_escrows_are_capped_returned_and_held_on_their_keys(conn: psycopg.Connection) -> None:
    rich, poor, free = make_key(conn, budget_usd=100.0), make_key(conn, budget_usd=0.5), make_key(conn)
    conn.execute("update api_keys set spent_usd = 0.1, reserved_usd = 0.15 where id = %s", (poor,))
    got = renew_escrows(conn, (rich, "5"), (poor, "0.4"), (free, "0.4"))
    # Capped by platform_settings.escrow_usd ($1), by half what the key has free (0.5 - 0.1 - 0.15);
    # a key without a budget needs none.
    assert got == [
        q.EscrowRow(rich, Decimal("1.00000000"), Decimal("99.00000000")),
        q.EscrowRow(poor, Decimal("0.12500000"), Decimal("0.12500000")),
        q.EscrowRow(free, None, None),
    ]
    assert key_money(conn, rich) == (Decimal("1"), 0) and key_money(conn, poor)[0] == Decimal("0.275")
    assert one(conn, "select count(*) from private.key_escrows") == 2
    # Asked again for less: the difference is returned; a key no longer named gets all of it back.
    assert renew_escrows(conn, (rich, "0.3")) == [
        q.EscrowRow(rich, Decimal("0.30000000"), Decimal("99.70000000"))
    ]
    assert key_money(conn, rich)[0] == Decimal("0.3") and key_money(conn, poor)[0] == Decimal("0.15")
    assert_reserved_adds_up(conn, rich)  # (poor's 0.15 held is made up: no job holds it)
    # A leased job's hold leaves the escrow; the next renewal tops it up from the key's free money.
    node = make_node(conn, max_concurrency=2)
    lease(conn, 1)
    write(conn, record(uuid.uuid4(), node, rich, hold="0.2"))
    assert one(conn, "select usd from private.key_escrows") == Decimal("0.1")
    assert renew_escrows(conn, (rich, "0.3")) == [
        q.EscrowRow(rich, Decimal("0.30000000"), Decimal("99.50000000"))
    ]
    assert key_money(conn, rich)[0] == Decimal("0.5")
    assert_reserved_adds_up(conn, rich)
    # A revoked key's escrow is returned.
    conn.execute("update api_keys set revoked_at = now() where id = %s", (rich,))
    assert renew_escrows(conn, (rich, "0.3")) == [q.EscrowRow(rich, Decimal("0"), Decimal("99.80000000"))]
    assert one(conn, "select count(*) from private.key_escrows") == 0
    assert_reserved_adds_up(conn, rich)


def test_a_small_budget_is_never_escrowed_whole_at_one_gateway(conn: psycopg.Connection) -> None:
    """An escrow is at most half what the key has free (its own counted): in bench chaos the first
    gateway to ask took a $0.002 key's last money whole, and the other gateways refused its requests
    as spent for 15 s while that one served them. Each gateway's escrow leaves the rest free, for the
    others' escrows and for placements in SQL."""
    key = make_key(conn, budget_usd=0.002)
    first, second = uuid.uuid4(), uuid.uuid4()
    for gateway in (first, second):
        conn.execute("select gateway_alive(%s, null)", (gateway,))
    escrow = conn.execute(
        "select usd, free_usd from renew_escrows(%s, %s::jsonb)",
        (first, json.dumps([{"key": str(key), "want_usd": "0.01"}])),
    ).fetchone()
    assert escrow == (Decimal("0.00100000"), Decimal("0.00100000"))
    escrow = conn.execute(
        "select usd, free_usd from renew_escrows(%s, %s::jsonb)",
        (second, json.dumps([{"key": str(key), "want_usd": "0.01"}])),
    ).fetchone()
    assert escrow == (Decimal("0.00050000"), Decimal("0.00050000"))
    # Renewed again, the first gateway's escrow is half what is free with its own counted.
    escrow = conn.execute(
        "select usd, free_usd from renew_escrows(%s, %s::jsonb)",
        (first, json.dumps([{"key": str(key), "want_usd": "0.01"}])),
    ).fetchone()
    assert escrow == (Decimal("0.00075000"), Decimal("0.00075000"))
    assert key_money(conn, key)[0] == Decimal("0.00125")  # held in escrows; the rest free for SQL


def test_bad_escrow_requests_are_refused_and_change_nothing(conn: psycopg.Connection) -> None:
    key = make_key(conn, budget_usd=1.0)
    renew_escrows(conn, (key, "0.5"))
    cases: list[tuple[Any, type[psycopg.Error], str]] = [
        ({"key": str(key)}, psycopg.errors.InvalidParameterValue, "JSON array"),
        (["x"], psycopg.errors.InvalidParameterValue, "key 1: each key is a JSON object"),
        ([{"key": "k", "want_usd": "1"}], psycopg.errors.InvalidParameterValue, '"key" must be'),
        ([{"key": str(key), "want_usd": -1}], psycopg.errors.InvalidParameterValue, '"want_usd"'),
        ([{"key": str(key)}], psycopg.errors.InvalidParameterValue, '"want_usd"'),
        ([{"key": str(key), "want_usd": 1}] * 2, psycopg.errors.InvalidParameterValue, "named twice"),
        ([{"key": str(uuid.uuid4()), "want_usd": 1}], psycopg.errors.ForeignKeyViolation, "no API key"),
    ]
    for keys, error, message in cases:
        with pytest.raises(error, match=message):
            conn.execute("select * from renew_escrows(%s, %s::jsonb)", (GATEWAY, json.dumps(keys)))
    assert key_money(conn, key) == (Decimal("0.5"), 0)
    assert one(conn, "select usd from private.key_escrows") == Decimal("0.5")


def test_a_large_batch_is_ended_whole(conn: psycopg.Connection) -> None:
    """Past the 64 ends record_jobs() hands complete_jobs() at a time: every job ended once, charged
    once, on a node whose leased slots stay held."""
    nodes = [make_node(conn, max_concurrency=2) for _ in range(3)]
    key = make_key(conn, budget_usd=10.0)
    lease(conn, 6)
    records = [record(uuid.uuid4(), nodes[i % 3], key, end=ENDED, hold="0.0001") for i in range(150)]
    written = write(conn, *records)
    assert [r.job_id for r in written] == [uuid.UUID(r["id"]) for r in records]
    assert {r.recorded for r in written} == {"started+ended"} and {r.cost_usd for r in written} == {
        Decimal("0.000059")
    }
    assert key_money(conn, key) == (0, Decimal("0.00885000"))
    assert conn.execute("select sum(successes), sum(inflight) from nodes").fetchone() == (150, 6)
    assert [r.recorded for r in write(conn, *records)] == ["already"] * 150


def test_a_record_sql_refuses_is_dropped_alone_and_the_rest_still_go_in_batches(
    conn: psycopg.Connection, db_url: str
) -> None:
    """A batch with a record SQL refuses (its node deleted, say) is written again a record at a time
    and the refused one dropped. It had stayed queued: while jobs kept ending, every batch held it
    again and went a record at a time, one round trip each (a review: 218 of 231 calls), and the
    escrow hold it had taken stayed taken at its gateway for good."""
    from neuralgrid.db.store import Store
    from neuralgrid.gateway.escrow import Escrows
    from neuralgrid.gateway.journal import JobRecord, Journal

    node = make_node(conn, max_concurrency=4)
    key = make_key(conn, budget_usd=5.0)
    refused = uuid.uuid4()
    asked: list[bool] = []  # each record_jobs() call: whether it held the refused record

    class Counted(Store):
        async def all(self, query: Any, params: Any = None) -> Any:
            if query is q.RECORD_JOBS:
                asked.append(str(refused) in params[1])
            return await super().all(query, params)

    def ended(journal: Journal, job: uuid.UUID, node_id: uuid.UUID, hold: Decimal = Decimal(0)) -> JobRecord:
        record = JobRecord(job, key, LLAMA8, "balanced", None, False, node_id, datetime.now(UTC), hold, None)
        journal.start(record)
        journal.end(job, q.JobEnd(job, "succeeded", 1, 1))
        return record

    async def main() -> JobRecord:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as aconn:
            journal = Journal(Counted(aconn), GATEWAY, None)
            escrows = Escrows()
            journal.on_refused.append(lambda record: escrows.give_back(key, record.hold_usd))
            escrows.renewed([q.EscrowRow(key, Decimal("1.0"), None)])
            assert escrows.take(key, Decimal("0.4"))
            bad = ended(journal, refused, uuid.uuid4(), Decimal("0.4"))  # on no node there is
            for _ in range(5):
                ended(journal, uuid.uuid4(), node)
            stop = asyncio.Event()
            writer = asyncio.create_task(journal.run(stop))
            for _ in range(60):  # a job ends every 5 ms meanwhile
                ended(journal, uuid.uuid4(), node)
                await asyncio.sleep(0.005)
            deadline = time.monotonic() + 10
            while journal.pending() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            stop.set()
            await asyncio.wait_for(writer, 5)
            assert not journal.pending(), "the refused record is still queued"
            assert escrows.covers(key, Decimal("1.0"))  # the refused job's hold is back
            return bad

    bad = asyncio.run(main())
    assert bad.written is not None and bad.written.result() is None
    assert one(conn, "select count(*) from jobs where status = 'succeeded'") == 65
    assert sum(asked) == 2, f"the refused record was sent {sum(asked)} times"  # in its batch, then alone


def test_a_hand_over_waiting_on_a_record_sql_refuses_goes_on(conn: psycopg.Connection, db_url: str) -> None:
    """SQL moving a leased job on (a failover, say) first waits for its start to be written; one SQL
    refused, last of its batch, woke no one: the hand-over waited for some later write (a review)."""
    from neuralgrid.db.store import Store
    from neuralgrid.gateway.journal import JobRecord, Journal

    node = make_node(conn, max_concurrency=4)

    def started(journal: Journal, node_id: uuid.UUID) -> uuid.UUID:
        job = uuid.uuid4()
        journal.start(
            JobRecord(
                job, None, LLAMA8, "balanced", None, False, node_id, datetime.now(UTC), Decimal(0), None
            )
        )
        return job

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as aconn:
            journal = Journal(Store(aconn), GATEWAY, None)
            good = started(journal, node)
            bad = started(journal, uuid.uuid4())  # on no node there is: refused, last of the batch
            stop = asyncio.Event()
            writer = asyncio.create_task(journal.run(stop))
            try:
                await asyncio.wait_for(asyncio.gather(journal.hand_over(good), journal.hand_over(bad)), 5)
            finally:
                stop.set()
                await asyncio.wait_for(writer, 5)

    asyncio.run(main())


@pytest.mark.parametrize("placed_in_sql", [False, True], ids=["leased", "placed-in-sql"])
def test_jobs_ending_a_millisecond_apart_are_written_in_few_calls(
    conn: psycopg.Connection, db_url: str, placed_in_sql: bool
) -> None:
    """A call to record_jobs() costs Postgres about 1.4 ms whatever it holds, and a job 0.12 ms more.
    One caller's jobs end about a millisecond apart: the journal wrote each batch as soon as the one
    before was in, so each call held a job or two (bench gateway, one caller: Postgres 0.7 ms a
    request). A write now begins WRITE_EVERY_S after the last at the soonest when it holds the end
    of a job SQL placed (its slot in SQL is free once written), and LEASED_EVERY_S after for leased
    jobs alone (at WRITE_EVERY_S, 10 ms, bench capacity's one gateway wrote 973 calls of 4 jobs:
    Postgres 1.1 ms a request)."""
    from neuralgrid.db.store import Store
    from neuralgrid.gateway.journal import LEASED_EVERY_S, WRITE_EVERY_S, Journal

    count = 200
    node = make_node(conn, max_concurrency=count)
    calls: list[int] = []  # each record_jobs() call: how many records it held
    placed: list[uuid.UUID] = []
    if placed_in_sql:
        key = make_key(conn)
        placed = [place_in_sql(conn, key).job_id for _ in range(count)]

    class Counted(Store):
        async def all(self, query: Any, params: Any = None) -> Any:
            if query is q.RECORD_JOBS:
                calls.append(len(json.loads(params[1])))
            return await super().all(query, params)

    async def main() -> float:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as aconn:
            journal = Journal(Counted(aconn), GATEWAY, None)
            stop = asyncio.Event()
            writer = asyncio.create_task(journal.run(stop))
            began = time.monotonic()
            for i in range(count):
                job = placed[i] if placed_in_sql else uuid.uuid4()
                record = job_record(job, node)
                if placed_in_sql:
                    record.end = q.JobEnd(job, "succeeded", 1, 1)
                    journal.ended(record)
                else:
                    journal.start(record)
                    journal.end(job, q.JobEnd(job, "succeeded", 1, 1))
                await asyncio.sleep(0.001)
            took = time.monotonic() - began
            deadline = time.monotonic() + 10
            while journal.pending() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            stop.set()
            await asyncio.wait_for(writer, 5)
            return took

    took = asyncio.run(main())
    assert sum(calls) == count
    assert one(conn, "select count(*) from jobs where status = 'succeeded'") == count
    every = WRITE_EVERY_S if placed_in_sql else LEASED_EVERY_S
    assert len(calls) <= took / every + 3, f"{len(calls)} calls in {took:.2f} s: {calls}"


def test_the_end_of_a_job_sql_placed_is_written_without_waiting_for_the_leased_cadence(
    conn: psycopg.Connection, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its slot in SQL is free once its end is written, and a request may be waiting for it: the
    write it is in begins WRITE_EVERY_S after the last, even while leased jobs' writes wait longer."""
    from neuralgrid.db.store import Store
    from neuralgrid.gateway import journal as journal_module
    from neuralgrid.gateway.journal import Journal

    monkeypatch.setattr(journal_module, "LEASED_EVERY_S", 2.0)  # unmistakable
    node = make_node(conn, max_concurrency=4)
    key = make_key(conn)
    placed = place_in_sql(conn, key)
    assert placed.node_id == node

    async def main() -> tuple[float, float, float]:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as aconn:
            journal = Journal(Store(aconn), GATEWAY, None)
            stop = asyncio.Event()
            writer = asyncio.create_task(journal.run(stop))
            leased = uuid.uuid4()
            journal.start(job_record(leased, node, key))
            first = journal.end(leased, q.JobEnd(leased, "succeeded", 1, 1))
            await asyncio.wait_for(first, 5)
            began = time.monotonic()
            other = uuid.uuid4()
            journal.start(job_record(other, node, key))
            later = journal.end(other, q.JobEnd(other, "succeeded", 1, 1))
            await asyncio.sleep(0.05)
            sql_placed = job_record(placed.job_id, node, key)
            sql_placed.end = q.JobEnd(placed.job_id, "succeeded", 1, 1)
            await asyncio.wait_for(journal.ended(sql_placed), 5)
            freed = time.monotonic() - began
            await asyncio.wait_for(later, 5)
            both = time.monotonic() - began
            stopping = time.monotonic()
            stop.set()
            await asyncio.wait_for(writer, 5)
            return freed, both, time.monotonic() - stopping

    freed, both, stopped = asyncio.run(main())
    assert freed < 1.0, f"the end that frees a slot waited {freed:.2f} s"
    assert one(conn, "select status from jobs where id = %s", placed.job_id) == "succeeded"
    assert one(conn, f"select {JOB_SLOTS} from nodes n where n.id = %s", node) == 0
    assert both < 1.0  # the leased end queued before it went in the same write
    assert stopped < 1.0  # a stop does not wait out the cadence


def test_a_backlog_is_written_a_full_batch_at_a_time_without_the_cadences_wait(
    conn: psycopg.Connection, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: after a database outage the records queued meanwhile went a batch (500) a
    write, each write waiting out the leased cadence: catching up was capped at 10,000 records a
    second. A full batch is written at once."""
    from neuralgrid.db.store import Store
    from neuralgrid.gateway import journal as journal_module
    from neuralgrid.gateway.journal import BATCH, Journal

    monkeypatch.setattr(journal_module, "LEASED_EVERY_S", 2.0)  # three batches would wait 6 s
    node = make_node(conn, max_concurrency=4)
    count = 3 * BATCH

    async def main() -> float:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as aconn:
            journal = Journal(Store(aconn), GATEWAY, None)
            for _ in range(count):
                job = uuid.uuid4()
                journal.start(job_record(job, node))
                journal.end(job, q.JobEnd(job, "succeeded", 1, 1))
            stop = asyncio.Event()
            began = time.monotonic()
            writer = asyncio.create_task(journal.run(stop))
            deadline = began + 20
            while journal.pending() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            took = time.monotonic() - began
            stop.set()
            await asyncio.wait_for(writer, 5)
            return took

    took = asyncio.run(main())
    assert one(conn, "select count(*) from jobs where status = 'succeeded'") == count
    assert took < 4.0, f"{count} records took {took:.1f} s"
