"""The lease book, the escrows and the journal's spool on their own: what is counted here, with no
database (tests/db/test_leases.py holds SQL's side; tests/gateway/test_leased_requests.py both)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest

from neuralgrid.db import queries as q
from neuralgrid.gateway.auth import ApiKey
from neuralgrid.gateway.escrow import IDLE_S, Escrows, budget_hold
from neuralgrid.gateway.journal import JobRecord, Journal, Spool, as_array, orphaned_spools, read_spool
from neuralgrid.gateway.leases import MARGIN_S, Lane, LeaseBook, Taken
from neuralgrid.gateway.pipeline.admit import Admitted, Call
from neuralgrid.gateway.pipeline.leased import LeasedJobs
from neuralgrid.gateway.renewals import GROW_EVERY_S, Renewals

LANE = Lane("m", "balanced")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def row(node: UUID, slots: int, rank: int, routes: tuple[str, ...] = ("chat/completions",)) -> q.LeaseRow:
    return q.LeaseRow(
        "m", "balanced", "", node, "http://n", None, slots, 0, rank, None, list(routes), datetime.now(UTC)
    )


def offline_jobs(book: LeaseBook) -> LeasedJobs:
    """Leased jobs over `book` with no database: nothing is written or renewed here."""
    journal = Journal(None, uuid4(), None)  # type: ignore[arg-type]
    return LeasedJobs(None, uuid4(), book, Escrows(), journal, None)  # type: ignore[arg-type]


def chat_call() -> Admitted:
    """A chat request of a key with no budget, admitted."""
    call = Call("chat", {"model": "m", "messages": []}, ApiKey(uuid4(), None, "k", None, None, None))
    return Admitted(call, call.body, b"{}", False, 16)


def test_takes_the_best_ranked_free_slot_and_never_more_than_leased() -> None:
    clock = Clock()
    book = LeaseBook(clock)
    a, b = uuid4(), uuid4()
    book.renewed([row(b, 1, 2), row(a, 2, 1)], clock(), 5.0)
    taken = [book.take(LANE, "chat/completions") for _ in range(4)]
    assert [t.node_id if t else None for t in taken] == [a, a, b, None]
    first = taken[0]
    assert first is not None
    book.give_back(first)
    again = book.take(LANE, None)
    assert again is not None and again.node_id == a


def test_a_lane_sql_refused_as_unknown_is_forgotten_unless_it_holds_or_uses_anything() -> None:
    clock = Clock()
    book = LeaseBook(clock)
    made_up = Lane("nobody/serves-this", "balanced")
    assert book.take(made_up, None) is None  # asked: wanted from now
    assert [lane["model"] for lane in book.lanes()] == ["nobody/serves-this"]
    book.take(made_up, None)
    book.forget(made_up)
    assert book.lanes() == []
    a = uuid4()
    book.renewed([row(a, 1, 1)], clock(), 5.0)
    assert book.take(LANE, None) is not None  # in use: a refusal of another request keeps it
    book.forget(LANE)
    assert [(lane["model"], lane["in_use"]) for lane in book.lanes()] == [("m", {str(a): 1})]


def test_lent_slots_are_out_of_use_until_settled_and_the_one_sql_took_leaves_its_lease() -> None:
    """A request placed in SQL lends an idle slot of each of a few leased nodes (place_jobs()
    "lend"): none is taken here meanwhile, each is reported in use, and the one SQL took leaves
    its lease, also in a renewal sent before the answer came (which may still count it)."""
    clock = Clock()
    book = LeaseBook(clock)
    a, b = uuid4(), uuid4()
    book.renewed([row(a, 2, 1), row(b, 1, 2)], clock(), 5.0)
    busy = book.take(LANE, None)
    assert busy is not None and busy.node_id == a
    lent = book.lend()
    assert sorted(lent.slots, key=str) == sorted([(LANE, a), (LANE, b)], key=str)  # one idle slot a node
    assert book.take(LANE, None) is None  # all in use or lent
    assert book.lanes()[0]["in_use"] == {str(a): 2, str(b): 1}
    assert book.lend().slots == ()  # nothing left to lend twice
    sent_before = clock()
    clock.now += 0.1
    book.settle(lent, a)
    taken = book.take(LANE, None)
    assert taken is not None and taken.node_id == b and book.take(LANE, None) is None  # a: one slot, in use
    book.give_back(taken)
    book.renewed([row(a, 2, 1), row(b, 1, 2)], sent_before, 5.0)  # sent before SQL took it
    assert [t.node_id if t else None for t in (book.take(LANE, None), book.take(LANE, None))] == [b, None]
    book.renewed([row(a, 1, 1), row(b, 1, 2)], clock(), 5.0)  # sent after: as SQL says
    assert book.take(LANE, None) is None  # b in use; a's one slot in use


def test_a_node_lends_first_a_slot_the_renewal_keeps_then_one_it_moved_for_a_job_ended_then_any() -> None:
    """A renewal on its way may give back a lease's idle slots, and moves the slots of this
    gateway's running jobs SQL placed into their lanes' leases, unknown here until its answer. A far
    gateway's placement that lent a slot given back met a full node and waited in line, while one
    its own job had left idle in a lease was there to lend (bench world, 2026-12-07). SQL is told of
    such jobs still running (placed), or it could lend the slot one of them runs on."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    other = Lane("other", "balanced")
    book.renewed([row(a, 1, 1)], clock(), 5.0)
    ended, running, leased_lane = uuid4(), uuid4(), uuid4()
    book.sql_job(ended, other, a)
    book.sql_job(running, other, a)
    book.sql_job(leased_lane, LANE, a)  # of the leased lane too: the renewal moves it into that lease
    book.lanes({other: [ended, running], LANE: [leased_lane]})  # on its way, reporting a's slot idle
    at_risk = book.lend()
    assert at_risk.slots == ((LANE, a),) and at_risk.placed == ((leased_lane,),)  # nothing else to lend yet
    book.settle(at_risk, None)
    book.sql_job_ended(ended)
    lent = book.lend()
    assert lent.slots == ((other, a),) and lent.placed == ((running,),)  # SQL counts it if moved
    assert lent.as_json()[0]["placed"] == [str(running)]
    again = book.lend()
    assert again.slots == ((LANE, a),)  # the moved slot is lent once: then the one at risk
    book.settle(again, None)
    assert book.lend(other).slots == ()  # a request's own lane's slots alone: leased ones only
    clock.now += 0.1
    book.settle(lent, a)  # SQL took it
    assert book.lend().slots == ((LANE, a),)
    book.renewed([row(a, 1, 1)], clock(), 5.0)  # the answer: the moved leases as SQL holds them now
    book.sql_job_ended(running)  # no renewal on its way: its slot was SQL's, freed by its end
    assert book.lend().slots == ()  # a's one slot lent already


def test_only_a_slot_the_renewal_on_its_way_may_have_moved_is_lent_for_a_job_ended() -> None:
    """The renewal on its way moves only the jobs SQL placed that it names: one placed after it was
    sent moved nothing, and its slot lent was refused by SQL (traced: a round trip more). Of those
    named, the one that ended first is lent first."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    older, newer, later = Lane("older", "balanced"), Lane("newer", "balanced"), Lane("later", "balanced")
    first, second, third = uuid4(), uuid4(), uuid4()
    book.renewed([], clock(), 5.0)
    book.sql_job(first, older, a)
    book.sql_job(second, newer, a)
    book.lanes({older: [first], newer: [second]})
    book.sql_job(third, later, a)  # placed after the renewal was sent
    for job in (third, second, first):
        book.sql_job_ended(job)
    assert book.lend().slots == ((newer, a),)  # ended first
    assert book.lend().slots == ((older, a),)
    assert book.lend().slots == ()


def test_a_slot_moved_for_a_job_ended_is_not_lent_where_its_node_does_not_serve_the_route() -> None:
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    other = Lane("other", "balanced")
    job = uuid4()
    book.renewed([row(a, 0, 1, routes=("embeddings",))], clock(), 5.0)
    book.sql_job(job, other, a)
    book.lanes({other: [job]})
    book.sql_job_ended(job)
    assert book.lend(route="chat/completions").slots == ()
    assert book.lend(route="embeddings").slots == ((other, a),)


def test_a_slot_lent_from_what_the_renewal_on_its_way_keeps_is_not_taken_here_too() -> None:
    """A review (2026-12-07): the renewal on its way keeps the slots it reported in use, lent ones
    among them. One in use ended, and a placement lent its slot (SQL told it is the only one busy);
    had a request here taken a slot as well, counting only those in use against the report, SQL could
    lend the slot after the renewal had given back the rest: two requests on a lease of one."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    book.renewed([row(a, 3, 1)], clock(), 5.0)
    one, two = book.take(LANE, None), book.take(LANE, None)
    assert one is not None and two is not None
    book.lanes()  # on its way: 2 of a's 3 slots kept, the third idle (it may give it back)
    book.give_back(one)
    lent = book.lend()
    assert lent.slots == ((LANE, a),) and lent.busy == (1,)
    assert book.take(LANE, None) is None  # in use 1 and lent 1: all the renewal keeps
    book.settle(lent, None)  # SQL took none of them
    assert book.take(LANE, None) is not None


def test_a_lent_slot_sql_took_is_one_fewer_the_renewal_on_its_way_keeps() -> None:
    """Lent slots are reported in use; SQL took one after the report was sent. The renewal may have
    given back the lease's other idle slot, so none may be taken until its answer (a review)."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    book.renewed([row(a, 2, 1)], clock(), 5.0)
    book.asked(LANE)
    lent = book.lend()
    [report] = book.lanes()
    assert report["in_use"] == {str(a): 1}
    book.settle(lent, a)
    assert book.take(LANE, None) is None  # the other slot: reported idle, perhaps given back
    book.renewed([row(a, 1, 1)], clock(), 5.0)
    assert book.take(LANE, None) is not None


def test_lent_slots_whose_answer_never_came_all_leave_their_leases_until_the_next_renewal() -> None:
    clock = Clock()
    book = LeaseBook(clock)
    a, b = uuid4(), uuid4()
    book.renewed([row(a, 1, 1), row(b, 1, 2)], clock(), 5.0)
    lent = book.lend()
    clock.now += 0.1
    book.settle(lent, None, known=False)  # any of them may have been taken
    assert book.take(LANE, None) is None
    book.renewed([row(a, 1, 1), row(b, 0, 2)], clock(), 5.0)  # SQL took b's
    taken = book.take(LANE, None)
    assert taken is not None and taken.node_id == a
    # A placement SQL answered without taking any: each lent slot is usable again.
    book.give_back(taken)
    lent = book.lend()
    book.settle(lent, None)
    assert book.take(LANE, None) is not None


def test_a_route_the_lease_does_not_serve_is_not_taken_there() -> None:
    clock = Clock()
    book = LeaseBook(clock)
    book.renewed([row(uuid4(), 4, 1)], clock(), 5.0)
    assert book.take(LANE, "embeddings") is None


def test_a_lease_is_not_used_past_the_senders_reckoning_of_its_end() -> None:
    clock = Clock()
    book = LeaseBook(clock)
    sent = clock()
    clock.now += 0.3  # the renewal's round trip
    book.renewed([row(uuid4(), 4, 1)], sent, 5.0)
    clock.now = sent + 5.0 - MARGIN_S - 0.01
    assert book.take(LANE, None) is not None
    clock.now = sent + 5.0 - MARGIN_S
    assert book.take(LANE, None) is None


def test_the_renewal_reports_what_is_in_use_and_wants_the_busiest_moment_and_a_spare() -> None:
    """It needs its busiest moment since the last renewal; it wants a spare besides."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    book.renewed([row(a, 2, 1)], clock(), 5.0)
    held = [book.take(LANE, None), book.take(LANE, None)]
    assert book.take(LANE, None) is None  # a third at once: placed in SQL
    book.unleased(LANE, 1)
    book.unleased(LANE, -1)
    [report] = book.lanes()
    assert report == {
        "model": "m",
        "policy": "balanced",
        "region": None,
        "want": 4,
        "need": 3,
        "in_use": {str(a): 2},
    }
    for taken in held:
        assert taken is not None
        book.give_back(taken)
    [report] = book.lanes()  # since the last renewal nobody asked: what was in use then, and a spare
    assert (report["want"], report["need"], report["in_use"]) == (3, 2, {str(a): 2})  # in use since
    [report] = book.lanes()
    assert report["in_use"] == {}
    clock.now += 60
    assert book.lanes() == []  # nobody asked for a while: the lane is given back


def test_requests_sql_placed_count_as_the_lanes_demand() -> None:
    """A lane's load grows from 1 request in flight to 16: the first renewal after wants them all
    (and a spare), not one slot more than the few it held (which grew the lease a slot a renewal,
    while the rest were placed in SQL)."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    book.renewed([row(a, 2, 1)], clock(), 5.0)
    held = [book.take(LANE, None), book.take(LANE, None)]
    for _ in range(14):  # no leased slot free: each is placed in SQL, and goes on there
        assert book.take(LANE, None) is None
        book.unleased(LANE, 1)
    [report] = book.lanes()
    assert (report["want"], report["need"], report["in_use"]) == (17, 16, {str(a): 2})
    for _ in range(14):
        book.unleased(LANE, -1)
    for taken in held:
        assert taken is not None
        book.give_back(taken)
    [report] = book.lanes()  # the busiest moment since: 16 were in flight when the period began
    assert report["want"] == 17
    reports = [book.lanes()[0] for _ in range(6)]  # then nothing: half as many each time, all spare
    assert [(report["want"], report["need"]) for report in reports] == [
        (9, 0),
        (5, 0),
        (3, 0),
        (2, 0),
        (1, 0),
        (1, 0),
    ]


def test_a_lane_has_outgrown_its_lease_once_as_many_requests_are_in_sql_as_on_it() -> None:
    """A slot or two short (a renewal skipped a node another transaction held) waits for the
    periodic renewal; a burst past the lease asks for one at once (leased.py placed_elsewhere())."""
    clock = Clock()
    book = LeaseBook(clock)
    book.renewed([row(uuid4(), 4, 1)], clock(), 5.0)
    for _ in range(4):
        assert book.take(LANE, None) is not None
    book.unleased(LANE, 1)
    assert not book.outgrown(LANE)
    for _ in range(3):
        book.unleased(LANE, 1)
    assert book.outgrown(LANE)
    assert not book.outgrown(Lane("other", "balanced"))  # nothing in flight


def test_a_scarce_lane_held_at_its_share_or_above_is_not_placed_in_sql() -> None:
    clock = Clock()
    book = LeaseBook(clock)
    a, b = uuid4(), uuid4()
    for _ in range(5):
        assert book.take(LANE, None) is None
        book.unleased(LANE, 1, waiting=True)
    assert book.lanes()[0]["want"] == 5  # 5 waiting: the line is the demand, with no spare
    book.renewed([replace(row(a, 2, 1), draining=2, share=3)], clock(), 5.0)  # 4 held, 2 draining
    assert book.at_share(LANE) and not book.at_share(Lane("other", "balanced"))
    book.renewed([replace(row(a, 2, 1), share=2), replace(row(b, 0, 2), share=2)], clock(), 5.0)
    assert book.at_share(LANE)  # exactly its share
    book.renewed([replace(row(a, 2, 1), share=3)], clock(), 5.0)
    assert not book.at_share(LANE)  # owed a slot: a request may claim one in SQL
    book.renewed([replace(row(a, 5, 1), share=5)], clock(), 5.0)
    assert not book.at_share(LANE)  # all it wanted: nothing scarce
    book.renewed([replace(row(a, 3, 1), share=3)], clock(), 5.0)
    clock.now += 5.0  # past the sender's reckoning of the lease's end: nothing held
    assert not book.at_share(LANE)


def test_a_lane_needing_nothing_is_not_scarce_whatever_it_wants() -> None:
    """After a burst a lane wants slots it does not need (spares); SQL shares the needs, so a share
    of 0 for a lane that needs none is no scarcity: its next request may be placed in SQL."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    book.renewed([row(a, 4, 1)], clock(), 5.0)
    held = [book.take(LANE, None) for _ in range(4)]
    book.lanes()
    for taken in held:
        assert taken is not None
        book.give_back(taken)
    book.lanes()
    [report] = book.lanes()
    assert (report["want"], report["need"]) == (3, 0)
    book.renewed([replace(row(a, 1, 1), share=0)], clock(), 5.0)
    assert not book.at_share(LANE)


def test_a_lane_asked_for_without_a_lease_is_reported_wanted() -> None:
    book = LeaseBook(Clock())
    lane = Lane("x", "fast", "eu")
    assert book.take(lane, None) is None
    book.unleased(lane, 1)  # placed in SQL: the cold path
    assert book.lanes() == [
        {"model": "x", "policy": "fast", "region": "eu", "want": 2, "need": 1, "in_use": {}}
    ]


def test_demand_is_what_holds_or_waits_for_a_slot_and_a_line_wants_no_spare() -> None:
    """Asking is not demand: a request its key's budget then refuses held nothing and waited for
    nothing, and counted would tip a scarce lane's shares towards the gateways it asks. And where
    requests wait in line, the line is the demand: a spare each would favour the gateways with the
    fewest callers (bench chaos: 4 callers of 42 were served 12.5% of the answers, not 9.5%)."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    book.renewed([row(a, 2, 1)], clock(), 5.0)
    held = [book.take(LANE, None), book.take(LANE, None)]
    for _ in range(3):
        assert book.take(LANE, None) is None  # asked, then refused: no slot held, no line joined
    assert book.lanes()[0]["want"] == 3  # the two in flight, and a spare
    for _ in range(2):
        book.unleased(LANE, 1, waiting=True)
    assert book.lanes()[0]["want"] == 4  # two in flight, two waiting, no spare
    for _ in range(2):
        book.unleased(LANE, -1, waiting=True)
    for taken in held:
        assert taken is not None
        book.give_back(taken)
    assert book.lanes()[0]["want"] == 4  # the busiest moment of the last period: still no spare
    assert book.lanes()[0]["want"] == 2  # nobody waited since: half as many, and a spare again


def test_escrow_covers_holds_until_spent_and_follows_what_was_written() -> None:
    key = uuid4()
    escrows = Escrows(Clock())
    assert not escrows.take(key, Decimal("0.1"))  # none yet: the key is now wanted
    assert escrows.wants() == [{"key": str(key), "want_usd": "0.8"}]
    escrows.renewed([q.EscrowRow(key, Decimal("0.25"), Decimal("1"))])
    assert escrows.take(key, Decimal("0.1")) and escrows.take(key, Decimal("0.1"))
    assert not escrows.take(key, Decimal("0.1"))
    escrows.written(key, Decimal("0.1"))  # SQL moved one hold to its job: 0.15 left, 0.1 taken
    assert not escrows.take(key, Decimal("0.1"))
    assert escrows.take(key, Decimal("0.05"))
    escrows.renewed([q.EscrowRow(key, Decimal(0), Decimal(0))])
    assert not escrows.take(key, Decimal(0))  # an empty escrow serves nothing, not even a free model


def test_escrows_are_renewed_only_while_one_is_wanted_or_may_be_held() -> None:
    """A renewal of escrows holds the journal's lock a round trip (escrow.py): a gateway whose keys
    have no budget, or none lately, sends none, once Postgres has given back what it held."""
    clock, key = Clock(), uuid4()
    escrows = Escrows(clock)
    assert escrows.due() is None  # nothing wanted, nothing held
    escrows.want(key, Decimal("0.1"))
    assert escrows.due() == [{"key": str(key), "want_usd": "0.8"}]
    # Its answer lost on the way (an error): Postgres may hold the escrow all the same.
    clock.now += IDLE_S
    assert escrows.due() == []  # no longer wanted: one renewal gives back what may be held
    escrows.renewed([])
    assert escrows.due() is None
    escrows.want(key, Decimal("0.1"))
    assert escrows.due() is not None
    escrows.renewed([q.EscrowRow(key, Decimal("0.8"), Decimal("1"))])
    clock.now += IDLE_S
    assert escrows.due() == []
    assert escrows.due() == []  # until a renewal wanting none came back
    escrows.renewed([])
    assert escrows.due() is None


def test_budget_hold_prices_as_sql_does() -> None:
    prices = q.ModelKind("m", "chat", 4096, Decimal("0.5"), Decimal("1.5"))
    assert budget_hold(prices, 4000, 100) == Decimal("0.00065000")
    assert budget_hold(None, 4000, 100) == 0


def _record(job: UUID) -> JobRecord:
    return JobRecord(job, None, "m", "balanced", None, False, uuid4(), datetime.now(UTC), Decimal(0), None)


def test_a_records_line_is_the_json_of_its_fields_whatever_its_strings_hold() -> None:
    """line() writes the JSON by hand: a client's strings (the end user, the model) and a node's
    error must come out as json.dumps would have them, quotes, controls and non-ASCII included."""
    key, node = uuid4(), uuid4()
    started = datetime.now(UTC)
    odd = 'a "quoted" \\ back\nslash\x00 é \u2028 😀'
    record = JobRecord(uuid4(), key, odd, "balanced", None, True, node, started, Decimal("0.00012"), odd)
    start = {
        "id": str(record.id),
        "key": str(key),
        "model": odd,
        "policy": "balanced",
        "region": None,
        "stream": True,
        "node": str(node),
        "started_at": started.isoformat(),
        "hold_usd": "0.00012",
        "end_user": odd,
    }
    assert json.loads(record.line()) == {**start, "end": None}
    assert record.line().isascii()
    record.end = q.JobEnd(record.id, "failed", 3, 4, 1.25, 20, odd)
    end = {
        "status": "failed",
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "ttft_ms": 1.25,
        "latency_ms": 20.0,
    }
    assert json.loads(record.line()) == {**start, "end": {**end, "error": odd}}
    assert json.loads(as_array([record, _record(uuid4())]))[0]["end"]["error"] == odd


def test_the_spool_keeps_what_is_not_committed_and_empties_when_all_is(tmp_path: Path) -> None:
    gateway = uuid4()
    spool = Spool(tmp_path, gateway)
    one, two = _record(uuid4()), _record(uuid4())
    spool.append(one)
    spool.append(two)
    one.end = q.JobEnd(one.id, "succeeded", 3, 4)
    spool.append(one)
    assert orphaned_spools(tmp_path) == {}  # locked: its gateway lives
    [latest_one, latest_two] = sorted(
        read_spool(list(tmp_path.glob("*.jsonl"))), key=lambda r: r["id"] != str(one.id)
    )
    assert latest_one["end"]["completion_tokens"] == 4 and latest_two["end"] is None
    spool.committed(one)
    spool.committed(two)
    assert [p.stat().st_size for p in tmp_path.glob("*.jsonl")] == [0]


def test_a_killed_gateways_spool_is_found_and_read(tmp_path: Path) -> None:
    gateway, job = uuid4(), uuid4()
    script = (
        "import os, sys, uuid, datetime, decimal, pathlib\n"
        "from neuralgrid.gateway.journal import Spool, JobRecord\n"
        f"s = Spool(pathlib.Path({str(tmp_path)!r}), uuid.UUID({str(gateway)!r}))\n"
        f"s.append(JobRecord(uuid.UUID({str(job)!r}), None, 'm', 'balanced', None, True, uuid.uuid4(),"
        " datetime.datetime.now(datetime.UTC), decimal.Decimal(0), None))\n"
        "os.kill(os.getpid(), 9)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=False, env={**os.environ})
    found = orphaned_spools(tmp_path)
    assert list(found) == [gateway]
    assert [r["id"] for r in read_spool(found[gateway])] == [str(job)]


def test_a_node_that_failed_is_passed_over_until_a_later_renewal_comes_back() -> None:
    clock = Clock()
    book = LeaseBook(clock)
    a, b = uuid4(), uuid4()
    book.renewed([row(a, 2, 1), row(b, 2, 2)], clock(), 5.0)
    book.failed(a)
    taken = book.take(LANE, None)
    assert taken is not None and taken.node_id == b
    book.renewed([row(a, 2, 1), row(b, 2, 2)], clock() - 0.1, 5.0)  # sent before the failure
    taken = book.take(LANE, None)
    assert taken is not None and taken.node_id == b
    clock.now += 0.5
    book.renewed([row(a, 2, 1), row(b, 2, 2)], clock(), 5.0)  # sent after it: SQL knows
    taken = book.take(LANE, None)
    assert taken is not None and taken.node_id == a


def test_a_price_cap_takes_the_best_ranked_lease_within_it() -> None:
    clock = Clock()
    book = LeaseBook(clock)
    dear, cheap = uuid4(), uuid4()
    rows = [
        replace(row(dear, 2, 1), hourly_rate=Decimal(2)),
        replace(row(cheap, 2, 2), hourly_rate=Decimal("0.5")),
    ]
    book.renewed(rows, clock(), 5.0)
    taken = book.take(LANE, None, max_rate=1.0)
    assert taken is not None and taken.node_id == cheap
    assert book.take(LANE, None, max_rate=0.1) is None
    assert book.others(LANE, cheap, max_rate=1.0) == []
    assert book.others(LANE, cheap) == [dear]


def test_a_job_sql_ended_frees_the_slot_a_renewal_moved_into_the_lease_meanwhile() -> None:
    """A job SQL placed fails; while failover_job() is in Postgres, the renewal sent before the
    failure comes back having moved the job's slot into the lease. failover_job() finds no node and
    ends the job: its slot was left in use here for good, reported so at every renewal (a review)."""

    async def main() -> None:
        clock = Clock()
        book = LeaseBook(clock)
        node = uuid4()
        book.renewed([row(node, 1, 1)], clock(), 5.0)
        jobs = offline_jobs(book)
        job = uuid4()
        jobs.placed_elsewhere(job, node, chat_call(), "chat/completions")
        taken = book.take(LANE, "chat/completions")  # the lease, as a renewal would name it
        assert taken is not None
        book.give_back(taken)
        jobs.renewals.absorbed(job, taken.lease)  # the renewal's answer, mid-failover
        assert jobs.holds(job)
        jobs.ended_elsewhere(job)  # failover_job() ended it: no node left
        assert not jobs.holds(job)
        book.lanes()  # it was in use since the last report
        assert [lane["in_use"] for lane in book.lanes()] == [{}]

    asyncio.run(main())


def test_while_a_renewal_is_on_its_way_no_slot_is_taken_past_what_it_reported_in_use() -> None:
    """The renewal may give back any idle slot above what it reported in use: a slot taken while it
    is on its way could be one SQL gave back, which another claim then takes, and the node runs one
    more than its slots (a review). A lease's most in use since the last report is reported, and
    that many may be used until the answer comes."""
    clock = Clock()
    book = LeaseBook(clock)
    a, b = uuid4(), uuid4()
    book.renewed([row(a, 2, 1), row(b, 2, 2)], clock(), 5.0)
    first = book.take(LANE, None)
    assert first is not None
    book.give_back(first)  # a's most in use since: 1
    [report] = book.lanes()  # sent: a renewal on its way
    assert report["in_use"] == {str(a): 1}
    again = book.take(LANE, None)
    assert again is not None and again.node_id == a
    assert book.take(LANE, None) is None  # a's second slot and both of b's: the renewal may give them back
    book.renewed([row(a, 1, 1), row(b, 2, 2)], clock(), 5.0)  # it gave back one of a's
    taken = [book.take(LANE, None) for _ in range(3)]
    assert [t.node_id if t else None for t in taken] == [b, b, None]  # a's one slot is in use
    clock.now += 1
    book.lanes()  # on its way again, its answer lost (a connection broke):
    book.give_back(again)
    assert book.take(LANE, None) is not None  # a's slot, in use when reported
    assert book.take(LANE, None) is None  # no more until a renewal's answer comes


def test_a_draining_slot_whose_job_ended_is_not_reported_in_use_by_the_next_renewal() -> None:
    """A slot SQL marked draining is not taken again here, so holding it through a renewal's flight
    serves nothing: reported in use as the most in use since the last report, it went back a
    renewal later, and the gateway below its share that was to claim it waited that much longer
    (bench chaos: the smallest gateway's slots 0.23 of 1.64 draining, its answers 7% under fair)."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    book.renewed([row(a, 2, 1)], clock(), 5.0)
    first, second = book.take(LANE, None), book.take(LANE, None)
    assert first is not None and second is not None
    [report] = book.lanes()
    assert report["in_use"] == {str(a): 2}
    book.renewed([replace(row(a, 1, 1), draining=1)], clock(), 5.0)  # above its share: one drains
    book.give_back(first)  # the draining one's job ends (either: the gateway counts slots, not which)
    [report] = book.lanes()
    assert report["in_use"] == {str(a): 1}  # the draining slot goes back now
    assert book.take(LANE, None) is None  # and nothing more of the lease is taken meanwhile
    book.give_back(second)
    clock.now += 1
    [report] = book.lanes()  # a slot used since the last report, and usable: promised still
    assert report["in_use"] == {str(a): 1}


def test_a_draining_slot_that_falls_idle_asks_for_a_renewal_at_once() -> None:
    """Idle, a draining slot waited for the next periodic renewal to go back, up to half a second
    of a scarce lane's slot that no gateway used (bench chaos: 0.19 to 0.23 of the smallest
    gateway's 1.6 slots draining). Its job's end asks for a renewal; an idle slot not draining
    does not (a renewal every GROW_EVERY_S cost Postgres 15% more a request, 2026-12-04)."""

    async def main() -> None:
        clock = Clock()
        book = LeaseBook(clock)
        a = uuid4()
        book.renewed([row(a, 3, 1)], clock(), 5.0)
        jobs = offline_jobs(book)
        asked: list[Lane] = []
        jobs.renewals.drained = asked.append  # type: ignore[method-assign,assignment]
        admitted = chat_call()
        one, two, three = [await jobs.dispatch(admitted, LANE, None) for _ in range(3)]
        assert one is not None and two is not None and three is not None
        jobs.release(one.job_id)
        assert asked == []  # idle, and takable: nothing drains
        book.renewed([replace(row(a, 1, 1), draining=1)], clock(), 5.0)  # 2 in use, 1 above the share
        jobs.release(two.job_id)
        assert asked == [LANE]  # the draining slot is idle: back at the next renewal, sent now
        jobs.release(three.job_id)
        assert asked == [LANE]  # an idle slot it may take again: no hurry

    asyncio.run(main())


def test_a_renewal_that_moved_the_slot_of_a_job_since_ended_here_leaves_the_slot_idle() -> None:
    """A renewal named a job SQL placed, and moved its slot into the lease; the job ended here before
    the renewal's answer came. The slot is idle, free at once (held, it had kept the next cold
    requests waiting, bench world's showed). SQL moves only the jobs a renewal names, so an answer
    naming a job never known here leaves nothing in use either."""

    async def main() -> None:
        clock = Clock()
        book = LeaseBook(clock)
        node = uuid4()
        jobs = offline_jobs(book)
        admitted = chat_call()
        book.renewed([row(node, 1, 1)], clock(), 5.0)  # the renewal's answer: one slot, the job's
        [lease] = [t.lease for t in [book.take(LANE, None)] if t is not None]
        book.give_back(Taken(lease))
        ended, running = uuid4(), uuid4()
        jobs.placed_elsewhere(ended, node, admitted, "chat/completions")
        assert jobs.renewals.placed() == {LANE: [ended]}  # what the renewal names
        jobs.end(q.JobEnd(ended, "succeeded", 1, 1))
        jobs.renewals.absorbed(ended, lease)  # it had ended here before the answer came
        taken = book.take(LANE, None)
        assert taken is not None
        book.give_back(taken)
        jobs.renewals.absorbed(uuid4(), lease)  # never known here: nothing runs on it
        taken = book.take(LANE, None)
        assert taken is not None
        book.give_back(taken)
        jobs.placed_elsewhere(running, node, admitted, "chat/completions")
        jobs.renewals.absorbed(running, lease)
        assert jobs.holds(running) and book.take(LANE, None) is None  # the job runs on it

    asyncio.run(main())


def test_a_lent_slot_sql_took_is_not_reported_in_use_by_the_next_renewal() -> None:
    """A lent slot SQL took left the lease; counted among the most in use since the last report, the
    next renewal reported it in use still, and SQL claimed a free slot of the node to match (a
    review). What is lent is SQL's to take or not; only what is taken here is reported."""
    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    book.renewed([row(a, 2, 1)], clock(), 5.0)
    assert book.take(LANE, None, exclude=[a]) is None  # asked for: a lane the renewals report
    book.lanes()
    lent = book.lend()
    book.settle(lent, a)  # SQL took it for the placement
    [report] = book.lanes()
    assert report["in_use"] == {}


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("/root/.cache/models/model.gguf", True),
        ("~/models/smollm2.gguf", True),
        ("./model.gguf", True),
        ("C:\\models\\m.gguf", True),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", False),
        ("lmstudio-community/Qwen-GGUF/qwen.Q4_K_M.gguf", False),  # a repository's file: a name
        ("llama3.1:8b", False),
    ],
)
def test_a_model_named_by_where_its_file_lies_is_told_from_a_model_id(name: str, path: bool) -> None:
    from neuralgrid.agent.run import _is_file_path

    assert _is_file_path(name) is path


def test_a_bursts_next_renewal_waits_a_moment_after_the_last_answer() -> None:
    """A renewal on its way holds each lease to what it reported in use. A burst's renewals, each
    sent GROW_EVERY_S after the one before, went back to back on a gateway whose round trip is longer:
    every slot an answer leased was held idle by the next renewal, sent as that answer came, and the
    burst went to SQL (a review). The next one waits GROW_EVERY_S after an answer."""

    clock = Clock()
    book = LeaseBook(clock)
    a = uuid4()
    sent: list[float] = []

    class FarStore:
        async def all(self, query: Any, params: Any) -> list[q.LeaseRow]:
            sent.append(clock())
            clock.now += 0.2  # the round trip
            return [row(a, 2, 1)]

    async def main() -> None:
        renewals = Renewals(FarStore(), uuid4(), book)  # type: ignore[arg-type]
        book.renewed([row(a, 1, 1)], clock(), 5.0)
        assert book.take(LANE, None) is not None
        renewals.soon(LANE)
        await renewals.settled()
        clock.now += GROW_EVERY_S / 2
        renewals.soon(LANE)  # answered a moment ago: the new slot is for the burst to take first
        await renewals.settled()
        assert len(sent) == 1
        clock.now += GROW_EVERY_S
        renewals.soon(LANE)
        await renewals.settled()
        assert len(sent) == 2

    asyncio.run(main())


def test_a_request_no_leased_slot_could_take_lends_its_own_lanes_idle_slots_alone() -> None:
    """It asks SQL at each of its turns in line: lending any lane's idle slots on four nodes each
    time would keep them out of use round trip after round trip, and another lane's spares could
    crowd out the slot freed for it (a review)."""
    clock = Clock()
    book = LeaseBook(clock)
    a, b, c = uuid4(), uuid4(), uuid4()
    other = Lane("n", "balanced")
    book.renewed(
        [row(a, 1, 1), row(b, 1, 2, ("embeddings",)), replace(row(c, 1, 1), model_id="n")], clock(), 5.0
    )
    lent = book.lend(LANE, "chat/completions")
    assert lent.slots == ((LANE, a),)  # b serves another route; c another lane
    book.settle(lent, None)
    assert set(book.lend().slots) == {(LANE, a), (LANE, b), (other, c)}


def test_a_drained_slot_asks_for_one_renewal_and_none_while_one_is_on_its_way() -> None:
    """Every draining slot that falls idle asks for a renewal: at most one at a time, none within
    GROW_EVERY_S of the last sent or answered (a lane whose leases all drain holds no slot, so the
    burst rule's limit did not apply), and none while one is on its way (sent on its answer, a far
    gateway's renewal would hold what that answer leased idle a round trip more)."""

    async def main() -> None:
        clock = Clock()
        renewals = Renewals(None, uuid4(), LeaseBook(clock))  # type: ignore[arg-type]
        sent: list[float] = []
        answer = asyncio.Event()

        async def renewal(asked_for: Lane | None = None) -> None:
            sent.append(clock())
            await answer.wait()
            renewals._answered_at = clock()

        renewals.renew = renewal  # type: ignore[method-assign]
        renewals.drained(LANE)
        renewals.drained(LANE)
        await asyncio.sleep(0)
        assert sent == [100.0]  # one
        answer.set()
        await renewals.settled()
        renewals.drained(LANE)
        await asyncio.sleep(0)
        assert sent == [100.0]  # answered just now
        clock.now += 2 * GROW_EVERY_S
        renewals.drained(LANE)
        await renewals.settled()
        assert sent == [100.0, 100.0 + 2 * GROW_EVERY_S]

    asyncio.run(main())


class _HeldAnswers:
    """A database whose renewals each answer `rows` once told to: the first when answers[0] is
    set, the second when answers[1] is, and so on."""

    def __init__(self, renewals: int, rows: list[q.LeaseRow]) -> None:
        self.answers = [asyncio.Event() for _ in range(renewals)]
        self._next = iter(self.answers)
        self.rows = rows

    async def all(self, query: Any, params: Any = None) -> list[q.LeaseRow]:
        await next(self._next).wait()
        return self.rows


def test_a_request_waits_for_a_renewal_on_its_way_only_for_a_slot_it_may_give() -> None:
    """A request that finds its lane's only idle slot held back by the renewal on its way waits for
    its answer (one request a slot so held, no more); one that goes away meanwhile gives its key's
    escrow hold back."""

    async def main() -> None:
        clock = Clock()
        book = LeaseBook(clock)
        jobs = offline_jobs(book)
        store = jobs.renewals.store = _HeldAnswers(1, [])  # type: ignore[assignment]
        book.renewed([row(uuid4(), 1, 1)], clock(), 5.0)
        renewal = asyncio.get_running_loop().create_task(jobs.renewals.renew())  # reports none in use
        await asyncio.sleep(0)
        key = ApiKey(uuid4(), None, "k", None, None, Decimal(1))
        jobs.escrows.renewed([q.EscrowRow(key.id, Decimal("0.5"), Decimal(1))])
        call = Call("chat", {"model": "m", "messages": []}, key)
        admitted = Admitted(call, call.body, b"{}", False, 16)
        prices = q.ModelKind("m", "chat", 4096, Decimal("0.5"), Decimal("1.5"))
        jobs._hold = lambda _admitted: _at(budget_hold(prices, 2, 16))  # type: ignore[method-assign,assignment]

        first = asyncio.get_running_loop().create_task(jobs.dispatch(admitted, LANE, None))
        await asyncio.sleep(0.01)
        assert not first.done()  # waits for the answer
        assert await jobs.dispatch(admitted, LANE, None) is None  # one slot held back: one waits
        first.cancel()  # its client went away
        with pytest.raises(asyncio.CancelledError):
            await first
        assert jobs.escrows.take(key.id, Decimal("0.5"))  # every hold given back
        store.answers[0].set()
        await renewal

    asyncio.run(main())


async def _at(value: Decimal) -> Decimal:
    return value


def test_a_request_waiting_for_a_renewals_answer_takes_its_slot_before_the_next_renewal_is_sent() -> None:
    """The renewal queued behind the one on its way (a burst's, a drained slot's) holds the slots
    back again as it is sent: the request waiting for the answer takes its slot first."""

    async def main() -> None:
        clock = Clock()
        book = LeaseBook(clock)
        jobs = offline_jobs(book)
        node = uuid4()
        store = jobs.renewals.store = _HeldAnswers(2, [row(node, 1, 1)])  # type: ignore[assignment]
        first_answer, second_answer = store.answers
        book.renewed([row(node, 1, 1)], clock(), 5.0)
        loop = asyncio.get_running_loop()
        first = loop.create_task(jobs.renewals.renew())  # reports none in use: the slot held back
        await asyncio.sleep(0)
        waiting = loop.create_task(jobs.dispatch(chat_call(), LANE, None))
        await asyncio.sleep(0)
        second = loop.create_task(jobs.renewals.renew())  # waits for the first
        await asyncio.sleep(0)
        first_answer.set()
        await first
        dispatched = await asyncio.wait_for(waiting, 1)  # before the second's answer
        assert dispatched is not None and dispatched.taken.node_id == node
        second_answer.set()
        await second

    asyncio.run(main())


def test_a_request_leaving_the_line_for_a_leased_slot_is_never_counted_twice() -> None:
    """A request that waited in line and takes a leased slot is counted as holding it in the step
    that stops counting it as waiting. Its line's count dropped only once the line had handed the
    answer on (a loop iteration or two later): a renewal sent between reported the lane needing two
    slots for one request, and SQL leased it two of a node of four (bench world, cold requests
    waiting behind the idle one)."""

    async def main() -> list[dict[str, object]]:
        clock = Clock()
        book = LeaseBook(clock)
        jobs = offline_jobs(book)
        book.renewed([row(uuid4(), 2, 1)], clock(), 5.0)
        admitted = chat_call()
        with jobs.waiting(admitted) as in_line:
            assert in_line is not None
            assert await jobs.dispatch(admitted, LANE, None, in_line) is not None
            during = book.lanes()  # a renewal sent before the request has left the line
        return during + book.lanes()

    during, after = asyncio.run(main())
    assert during["need"] == 1 and after["need"] == 1, (during, after)
