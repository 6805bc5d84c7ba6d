"""Requests served from leases, end to end: a gateway renews its lanes, places requests on leased
slots with no round trip to Postgres, writes the jobs behind, and hands a failed one to SQL. The
regression suite runs with leases on too (the default); these tests watch the lease path itself."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from neuralgrid.db import queries as q
from neuralgrid.gateway import renewals
from neuralgrid.gateway.pipeline.leased import DRAIN_S
from neuralgrid.server.app import STOP_S, create_app
from neuralgrid.server.serving import ThreadedServer
from neuralgrid.server.settings import Settings
from tests.conftest import LLAMA8, free_port, wait_for
from tests.slots import JOB_SLOTS, metric, written_behind

PLAIN = {"model": LLAMA8, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def leased_gateway(db_url: str, spool: Path) -> Iterator[str]:
    settings = Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5, NEURALGRID_SPOOL_DIR=spool)
    with ThreadedServer(create_app(settings, db_url, sweep=False)) as server:
        yield server.url


def ask(gateway: str, key: str, body: dict[str, Any] = PLAIN) -> httpx.Response:
    return httpx.post(
        f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=20
    )


def leases_held(conn: psycopg.Connection, node_id: uuid.UUID | None = None) -> int:
    row = conn.execute(
        "select coalesce(sum(slots), 0) from private.slot_leases where %(node)s::uuid is null or node_id = %(node)s",
        {"node": node_id},
    ).fetchone()
    assert row is not None
    return int(row[0])


class Intercepted:
    """A gateway's store, with `before` awaited (in the gateway's loop) ahead of each `query`."""

    def __init__(self, store: Any, query: q.Query[Any], before: Callable[[Any], Awaitable[None]]) -> None:
        self.store, self.query, self.before = store, query, before

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def all(self, query: Any, params: Any = None) -> Any:
        if query is self.query:
            await self.before(params)
        return await self.store.all(query, params)


def served_from_a_lease(gateway: str, key: str) -> bool:
    """Whether a request was, once the gateway holds the lease and the key's escrow in memory (a
    lease in Postgres is not yet one the gateway has: its renewal's answer may still be on the way)."""
    before = metric(gateway, "neuralgrid_leased_placements_total")
    return (
        ask(gateway, key).status_code == 200
        and metric(gateway, "neuralgrid_leased_placements_total") > before
    )


def test_a_lane_once_leased_is_served_without_asking_postgres(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str, api_key: str
) -> None:
    node = fake_nodes("leased-a")
    first = ask(leased_gateway, api_key)  # cold: placed in SQL, and the lane is wanted from now on
    assert first.status_code == 200, first.text
    wait_for(lambda: leases_held(conn) > 0, timeout=5)
    matched = metric(leased_gateway, "neuralgrid_matcher_seconds_count")
    jobs = [ask(leased_gateway, api_key).headers["x-neuralgrid-job"] for _ in range(10)]
    assert metric(leased_gateway, "neuralgrid_matcher_seconds_count") == matched  # not one ask
    assert metric(leased_gateway, "neuralgrid_leased_placements_total") >= 10

    # Written behind: each job, its usage and its leased attempt, soon after its answer.
    def written() -> bool:
        row = conn.execute(
            "select count(*) from jobs j join job_attempts a on a.job_id = j.id"
            " where j.id = any(%s::uuid[]) and j.status = 'succeeded' and a.leased and j.completion_tokens > 0",
            (jobs,),
        ).fetchone()
        return row is not None and row[0] == 10

    wait_for(written, timeout=5)
    # The node's slots: what the leases hold, nothing more (every leased job's end released none).
    row = conn.execute("select inflight from nodes where id = %s", (node.node_id,)).fetchone()
    assert row is not None and row[0] == leases_held(conn)


def test_a_cold_lane_is_one_round_trip_the_request_placed_at_once_its_end_written_behind(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str, api_key: str
) -> None:
    """Measured (bench world, 34c0843): a cold whole answer 4.6 to 4.9 RTT from gateways 80 and 200 ms
    away. It waited for a renewal (one round trip) that, every slot leased, gave it nothing; then
    for place_jobs() (a second), and for its end's complete_jobs() (a third), before a wait in
    line. Now it is placed at once, the renewal behind it moves its slot into the lease, and its
    end is written behind by the journal, as a leased job's is."""
    fake_nodes("cold-a")
    first = ask(leased_gateway, api_key)
    assert first.status_code == 200, first.text
    assert metric(leased_gateway, "neuralgrid_leased_placements_total") == 0  # not held for a renewal
    assert metric(leased_gateway, "neuralgrid_matcher_seconds_count") == 1
    wait_for(lambda: leases_held(conn) > 0, timeout=5)
    written_behind(leased_gateway)
    row = conn.execute(
        "select j.status, j.completion_tokens > 0, a.leased from jobs j join job_attempts a on a.job_id = j.id"
        " where j.id = %s",
        (first.headers["x-neuralgrid-job"],),
    ).fetchone()
    assert row is not None and row[:2] == ("succeeded", True), row
    # Its slot went to the lease (row[2]: the renewal came while it ran) or back to SQL: no job holds one.
    assert conn.execute(f"select sum({JOB_SLOTS}) from nodes n").fetchone() == (0,)
    assert ask(leased_gateway, api_key).status_code == 200
    assert metric(leased_gateway, "neuralgrid_leased_placements_total") == 1  # the next one: leased


def test_a_model_new_to_the_gateway_takes_at_once_a_slot_its_other_lane_leases_idle(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str, api_key: str
) -> None:
    """Every slot of the one node leased, idle, for another model: the request is placed in one
    round trip on a slot its gateway lends from that lease, not kept in line until a renewal gives
    one back (bench world, 2026-12-05: 27 ms to 5.3 s next to the database)."""
    mistral = "mistralai/Mistral-7B-Instruct-v0.3"
    # One slot: a lane's spare never takes a node's last free slot, its need does.
    node = fake_nodes("shared", models={LLAMA8: "loaded", mistral: "loaded"}, max_concurrency=1)
    assert ask(leased_gateway, api_key).status_code == 200
    wait_for(lambda: leases_held(conn, node.node_id) == 1 and served_from_a_lease(leased_gateway, api_key))
    written_behind(leased_gateway)
    answer = ask(leased_gateway, api_key, {**PLAIN, "model": mistral})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-neuralgrid-node"] == str(node.node_id)
    assert float(answer.headers["x-neuralgrid-queue-ms"]) == 0  # placed at once, not in line
    written_behind(leased_gateway)
    # The node's slots in one snapshot: those leases hold and those of jobs SQL placed, never past its own.
    row = conn.execute(
        "select n.inflight, n.max_concurrency,"
        " (select coalesce(sum(l.slots), 0) from private.slot_leases l where l.node_id = n.id)"
        " + (select count(*) from job_attempts a where a.node_id = n.id and a.status = 'running' and not a.leased)"
        " from nodes n where n.id = %s",
        (node.node_id,),
    ).fetchone()
    assert row is not None and row[0] <= row[1] and row[0] == row[2], row
    assert ask(leased_gateway, api_key).status_code == 200  # the first lane is served on


def test_a_model_new_to_a_gateway_finds_the_slot_another_gateways_spare_left_free(
    conn: psycopg.Connection, fake_nodes: Any, db_url: str, spool: Path, api_key: str
) -> None:
    """A busy lane wants a spare slot besides the one its caller needs, but never a node's last
    free one: another gateway's first request for a model is placed at once. Before, the spare
    filled the node, and the request waited in line for the first gateway's renewal to give it back
    (bench world: 2.6 RTT at 80 ms, 2026-12-05). Nor is a spare kept there once a burst had the lane
    need the whole node (CI at 7216741: 116 ms in line)."""
    mistral = "mistralai/Mistral-7B-Instruct-v0.3"
    node = fake_nodes(
        "shared", models={LLAMA8: "loaded", mistral: "loaded"}, max_concurrency=2, latency_s=0.05
    )
    settings = Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5, NEURALGRID_SPOOL_DIR=spool)
    served: list[str] = []  # each answer's job id ("" for one not answered 200)
    steady, burst = threading.Event(), threading.Event()
    with (
        ThreadedServer(create_app(settings, db_url, sweep=False)) as first,
        ThreadedServer(create_app(settings, db_url, sweep=False)) as second,
    ):
        threads = _callers(first.url, api_key, 1, steady, served)
        try:
            threads += _callers(first.url, api_key, 1, burst, served)  # the lane leases the whole node
            wait_for(lambda: leases_held(conn, node.node_id) == 2)
            burst.set()
            # The steady caller's own requests leased, two renewals after the burst ended.
            wait_for(lambda: metric(first.url, "neuralgrid_leased_placements_total") > 0)
            time.sleep(1.5)
            answer = ask(second.url, api_key, {**PLAIN, "model": mistral})
        finally:
            steady.set()
            burst.set()
            for thread in threads:
                thread.join()
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-neuralgrid-node"] == str(node.node_id)
    assert float(answer.headers["x-neuralgrid-queue-ms"]) == 0  # placed at once, not in line
    assert served and all(served)


def test_a_budget_is_spent_from_escrow_and_charged_as_placements_charge(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str
) -> None:
    fake_nodes("leased-b")
    conn.execute("update models set input_usd_per_mtok = 1, output_usd_per_mtok = 2 where id = %s", (LLAMA8,))
    row = conn.execute("select api_key from create_api_key('budgeted', null, null, 0.5)").fetchone()
    assert row is not None
    key = str(row[0])
    assert ask(leased_gateway, key).status_code == 200
    wait_for(lambda: leases_held(conn) > 0, timeout=5)
    wait_for(lambda: conn.execute("select count(*) from private.key_escrows").fetchone() == (1,), timeout=5)
    before = metric(leased_gateway, "neuralgrid_leased_placements_total")
    jobs = [ask(leased_gateway, key).headers["x-neuralgrid-job"] for _ in range(5)]
    assert metric(leased_gateway, "neuralgrid_leased_placements_total") == before + 5

    def settled() -> bool:
        row = conn.execute(
            "select count(*) filter (where status = 'succeeded') from jobs where id = any(%s::uuid[])",
            (jobs,),
        ).fetchone()
        return row == (5,)

    wait_for(settled, timeout=5)
    row = conn.execute(
        "select k.spent_usd, (select sum(cost_usd) from jobs j where j.api_key_id = k.id),"
        " k.reserved_usd, (select coalesce(sum(usd), 0) from private.key_escrows e where e.api_key_id = k.id)"
        " + (select coalesce(sum(reserved_usd), 0) from jobs j where j.api_key_id = k.id and j.status = 'running')"
        " from api_keys k where k.id = (select api_key_id from jobs where id = %s)",
        (jobs[0],),
    ).fetchone()
    assert row is not None
    spent, costs, reserved, held = row
    assert spent == costs > 0  # each job charged its price, once
    assert reserved == held  # what the key holds: its escrows and its running jobs' holds


def test_escrows_are_renewed_only_for_keys_with_a_budget(
    conn: psycopg.Connection, fake_nodes: Any, db_url: str, spool: Path, api_key: str
) -> None:
    """An escrow renewal holds the journal's lock a round trip: a gateway whose keys have no budget
    sends none (it had, every renewal)."""
    fake_nodes("leased-no-escrow")
    app = create_app(Settings(NEURALGRID_SPOOL_DIR=spool), db_url, sweep=False)
    with ThreadedServer(app) as gateway:
        leased = app.state.services.pipeline.placement.leased
        escrows: list[Any] = []

        async def count(params: Any) -> None:
            escrows.append(params)

        leased.store = Intercepted(leased.store, q.RENEW_ESCROWS, count)
        assert ask(gateway.url, api_key).status_code == 200
        wait_for(lambda: served_from_a_lease(gateway.url, api_key), timeout=10)
        time.sleep(4 * renewals.RENEW_EVERY_S)
        assert escrows == []
        row = conn.execute("select api_key from create_api_key('budgeted', null, null, 0.5)").fetchone()
        assert row is not None
        wait_for(lambda: served_from_a_lease(gateway.url, str(row[0])), timeout=10)
        assert escrows and conn.execute("select count(*) from private.key_escrows").fetchone() == (1,)


def test_a_failed_leased_node_hands_its_job_to_another(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str, api_key: str
) -> None:
    # The node to fail ranks best (faster on paper), so the lease's first slots are on it. It fails
    # only once leased: failing the cold request, it would cool down before the renewal behind that
    # request leased its slots.
    bad = fake_nodes("leased-bad", fail_status=503, tflops=300)
    good = fake_nodes("leased-good", tflops=50)
    assert ask(leased_gateway, api_key).status_code == 200
    wait_for(lambda: leases_held(conn, bad.node_id) >= 1, timeout=5)
    bad.config.failure_rate = 1.0
    attempts = []
    for _ in range(6):
        answer = ask(leased_gateway, api_key)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-neuralgrid-node"] == str(good.node_id)
        attempts.append(int(answer.headers["x-neuralgrid-attempts"]))
    assert attempts[0] == 2  # tried on the leased failing node, then moved
    row = conn.execute(
        "select failures, cooldown_until > now() from nodes where id = %s", (bad.node_id,)
    ).fetchone()
    assert row is not None and row[0] >= 1 and row[1]  # its failure recorded at once: cooling down


def test_a_dead_gateways_spool_is_written_by_the_next(
    conn: psycopg.Connection, fake_nodes: Any, db_url: str, spool: Path, api_key: str
) -> None:
    node = fake_nodes("leased-spooled")
    key_id = conn.execute("select id from api_keys order by created_at desc limit 1").fetchone()
    assert key_id is not None
    dead, job = uuid.uuid4(), uuid.uuid4()
    record = {
        "id": str(job),
        "key": str(key_id[0]),
        "model": LLAMA8,
        "policy": "balanced",
        "region": None,
        "stream": False,
        "node": str(node.node_id),
        "started_at": datetime.now(UTC).isoformat(),
        "hold_usd": "0",
        "end_user": None,
        "end": {
            "status": "succeeded",
            "prompt_tokens": 5,
            "completion_tokens": 7,
            "ttft_ms": 3.0,
            "latency_ms": 4.0,
            "error": None,
        },
    }
    # Beside it, a record the database refuses for good (its node was deleted since): dropped alone,
    # not kept and tried again every second, the rest of the spool with it.
    gone = {**record, "id": str(uuid.uuid4()), "node": str(uuid.uuid4())}
    folder = spool / hashlib.sha256(db_url.encode()).hexdigest()[:16]
    folder.mkdir(parents=True)
    (folder / f"{dead}.0.jsonl").write_text(json.dumps(gone) + "\n" + json.dumps(record) + "\n")
    settings = Settings(NEURALGRID_SPOOL_DIR=spool)
    with ThreadedServer(create_app(settings, db_url, sweep=False)):
        row = conn.execute(
            "select status, completion_tokens, gateway_id from jobs where id = %s", (job,)
        ).fetchone()
        wait_for(lambda: not list(folder.glob(f"{dead}.*")), timeout=5)
    assert row == ("succeeded", 7, dead)
    assert conn.execute("select count(*) from jobs where id = %s", (gone["id"],)).fetchone() == (0,)


def test_a_gateway_cut_off_from_its_database_still_stops_and_spools_what_it_could_not_write(
    conn: psycopg.Connection, fake_nodes: Any, pg_server: Any, db_url: str, spool: Path, api_key: str
) -> None:
    """Found by `bench world`: a gateway whose database went away (its link cut) served on from its
    leases, as it should, but on SIGTERM did not stop: its Realtime feed and its journal's writer
    retried for as long as the database stayed away, and shutdown waited for them (the bench killed
    it 30 s later). It stops within seconds, and what it could not write waits in the spool for the
    next gateway on that database."""
    fake_nodes("leased-cut-off")
    port = free_port()
    far = psycopg.conninfo.make_conninfo(db_url, host="127.0.0.1", port=port)  # through the link
    settings = Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5, NEURALGRID_SPOOL_DIR=spool)
    with link_to_postgres(port, pg_server.port) as link:
        gateway = ThreadedServer(create_app(settings, far, sweep=False)).start()
        try:
            assert ask(gateway.url, api_key).status_code == 200
            wait_for(lambda: served_from_a_lease(gateway.url, api_key), timeout=10)
            link.kill()
            served = ask(gateway.url, api_key)  # from the lease: its record cannot be written
            assert served.status_code == 200, served.text
            job = served.headers["x-neuralgrid-job"]
        finally:
            stopped = time.monotonic()
            gateway.stop()
        assert not gateway.thread.is_alive(), "the gateway did not stop within 10 s of being told to"
        assert time.monotonic() - stopped < DRAIN_S + STOP_S + 2
    assert conn.execute("select count(*) from jobs where id = %s", (job,)).fetchone() == (0,)
    with link_to_postgres(port, pg_server.port), ThreadedServer(create_app(settings, far, sweep=False)):
        wait_for(lambda: conn.execute("select 1 from jobs where id = %s", (job,)).fetchone(), timeout=10)
    assert conn.execute("select status from jobs where id = %s", (job,)).fetchone() == ("succeeded",)


@contextmanager
def link_to_postgres(port: int, postgres_port: int) -> Iterator[subprocess.Popen[str]]:
    """A link from `port` to Postgres (`bench world`'s delay proxy, with no delay) in its own process."""
    args = [sys.executable, "-m", "neuralgrid.bench.delay", f"--link={port}:127.0.0.1:{postgres_port}:0"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True) as link:
        try:
            assert link.stdout is not None and link.stdout.readline().strip() == "ready"
            yield link
        finally:
            link.kill()


def _callers(
    gateway: str, key: str, count: int, stop: threading.Event, served: list[str], body: dict[str, Any] = PLAIN
) -> list[threading.Thread]:
    """`count` callers, each asking again as soon as answered, until stop; each answer's job id."""

    def caller() -> None:
        with httpx.Client(timeout=20) as client:
            while not stop.is_set():
                resp = client.post(
                    f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
                )
                served.append(resp.headers.get("x-neuralgrid-job", "") if resp.status_code == 200 else "")

    threads = [threading.Thread(target=caller) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_a_gateway_that_keeps_its_slots_busy_yields_its_share_to_another(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str, api_key: str, spool: Path, db_url: str
) -> None:
    """Leases gave back only idle slots, and callers that ask again as soon as answered leave none
    idle: a gateway that came second got nothing for good. Its waiting callers make its demand, the
    first gateway's slots above its share drain, and the second is served its share."""
    fake_nodes("leased-shared", latency_s=0.05)  # 4 slots
    stop = threading.Event()
    first: list[str] = []
    second: list[str] = []
    threads = _callers(leased_gateway, api_key, 4, stop, first)
    settings = Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5, NEURALGRID_SPOOL_DIR=spool)
    try:
        time.sleep(1.5)  # the first gateway leases all 4 slots, all busy
        with ThreadedServer(create_app(settings, db_url, sweep=False)) as other:
            threads += _callers(other.url, api_key, 4, stop, second)
            time.sleep(3)  # a few renewals: the first's share drains to the second
            before = (len(first), len(second))
            time.sleep(2)
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
    finally:
        stop.set()
    served_first, served_second = len(first) - before[0], len(second) - before[1]
    # Equal demand, equal shares: the second gateway serves at least a third of the window's answers.
    assert served_second >= (served_first + served_second) / 3, (served_first, served_second)
    assert "" not in first[before[0] :] + second[before[1] :]  # none refused meanwhile


def test_a_key_no_lease_can_serve_takes_its_turns_in_line_where_every_slot_is_leased(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str, api_key: str, spool: Path, db_url: str
) -> None:
    """A key whose escrow cannot cover its requests' holds is placed in SQL. With every slot leased
    to gateways at their shares it waited in a line of its own (at the head of the model's line it
    had kept the others from the slots leases free), asking SQL for a free slot there was none of:
    it was served only as a slot passed from one gateway to another (2 answers in 2 s here), and
    its waits counted in no gateway's share. It takes its turns in the model's line, lending SQL
    the leased slot freed for it (where its budget is checked), and the others are served too."""
    fake_nodes("leased-lines", latency_s=0.05)  # 4 slots
    row = conn.execute("select api_key from create_api_key('short', null, null, 0.5)").fetchone()
    assert row is not None
    long = {**PLAIN, "max_tokens": 20_000}  # its hold, the answer at its full length, tops any escrow
    conn.execute("update platform_settings set escrow_usd = 0.0001")
    hold = conn.execute("select private.budget_hold(%s, 100, 20000)", (LLAMA8,)).fetchone()
    assert hold is not None and hold[0] > Decimal("0.0001")
    stop = threading.Event()
    first: list[str] = []
    second: list[str] = []
    short: list[str] = []
    threads = _callers(leased_gateway, api_key, 4, stop, first)
    settings = Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5, NEURALGRID_SPOOL_DIR=spool)
    try:
        time.sleep(1.5)  # the first gateway leases all 4 slots, all busy
        with ThreadedServer(create_app(settings, db_url, sweep=False)) as other:
            threads += _callers(other.url, api_key, 2, stop, second)
            threads += _callers(other.url, str(row[0]), 2, stop, short, long)  # placed in SQL
            time.sleep(3)  # a few renewals: shares settle
            before = (len(first), len(second), len(short))
            time.sleep(2)
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
    finally:
        stop.set()
    served = (len(first) - before[0], len(second) - before[1], len(short) - before[2])
    # 4 slots at 50 ms an answer, some 160 answers; the short key's callers are a quarter of all.
    assert served[2] >= sum(served) / 8, served
    assert served[0] + served[1] >= sum(served) / 2, served  # the others are served meanwhile
    assert "" not in first[before[0] :] + second[before[1] :]


def test_at_full_load_requests_sql_placed_move_into_the_lease(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str, api_key: str
) -> None:
    """As many callers as the node has slots, each asking again as soon as answered: those SQL
    placed while the lease was still small hold slots the lease cannot claim, and each one's caller
    used to claim its slot in SQL again the moment it was freed, for good. A renewal moves those
    jobs' slots into the lease (renew_leases()'s absorbed), and the requests go on leased alone."""
    fake_nodes("leased-full", latency_s=0.02)  # 4 slots, the default
    stop = threading.Event()
    failures: list[str] = []

    def caller() -> None:
        with httpx.Client(timeout=20) as client:
            while not stop.is_set():
                resp = client.post(
                    f"{leased_gateway}/v1/chat/completions",
                    json=PLAIN,
                    headers={"authorization": f"Bearer {api_key}"},
                )
                if resp.status_code != 200:
                    failures.append(resp.text)

    callers = [threading.Thread(target=caller) for _ in range(4)]
    for thread in callers:
        thread.start()
    try:
        time.sleep(2.5)  # the lease grows to the load, the jobs SQL placed move in (renewals: 0.5 s)
        matched = metric(leased_gateway, "neuralgrid_matcher_seconds_count")
        leased = metric(leased_gateway, "neuralgrid_leased_placements_total")
        time.sleep(1.5)
        assert metric(leased_gateway, "neuralgrid_matcher_seconds_count") == matched  # none placed in SQL
        assert metric(leased_gateway, "neuralgrid_leased_placements_total") > leased + 40
    finally:
        stop.set()
        for thread in callers:
            thread.join(timeout=30)
    assert failures == []


def test_a_request_that_finds_its_slot_held_back_by_a_renewal_on_its_way_waits_for_its_answer(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str, api_key: str, monkeypatch: Any
) -> None:
    """A renewal on its way holds each lease to the slots it reported in use: an idle one may be
    given back. A request that found only such a slot was placed in SQL, a round trip, though the
    renewal, sent before it, answers first and most often keeps the slot; it waits for that answer
    now. (On a loaded machine this sent a sequential caller's requests to SQL as renewals came.)"""
    fake_nodes("held-back")
    assert ask(leased_gateway, api_key).status_code == 200  # cold: placed in SQL, the lane leased
    wait_for(lambda: leases_held(conn) > 0, timeout=5)
    assert ask(leased_gateway, api_key).status_code == 200  # leased
    send = renewals.Renewals._send
    sent: list[bool] = []
    on_way = threading.Event()

    async def slowly(self: renewals.Renewals, *args: Any) -> None:
        sent.append(True)
        if len(sent) == 2:  # the first reports the lease's slot not in use: the second holds it back
            on_way.set()
            await asyncio.sleep(0.5)
        await send(self, *args)

    monkeypatch.setattr(renewals.Renewals, "_send", slowly)
    assert on_way.wait(timeout=5)
    matched = metric(leased_gateway, "neuralgrid_matcher_seconds_count")
    leased = metric(leased_gateway, "neuralgrid_leased_placements_total")
    assert ask(leased_gateway, api_key).status_code == 200
    assert metric(leased_gateway, "neuralgrid_matcher_seconds_count") == matched  # not placed in SQL
    assert metric(leased_gateway, "neuralgrid_leased_placements_total") == leased + 1


def test_a_new_model_takes_the_slot_a_renewal_on_its_way_moved_into_a_lease_for_a_job_since_ended(
    conn: psycopg.Connection, fake_nodes: Any, db_url: str, spool: Path, api_key: str
) -> None:
    """A far gateway's cold request: SQL placed it, and the renewal sent behind it moved its slot
    into the lane's lease while it ran; it ended before that renewal's answer came back (a round
    trip). The gateway's next new model found the node full (that lease, idle, the one slot), and
    lent nothing (it knew no lease there yet): it waited in line for the answer, two round trips
    (bench world, 2026-12-07: 5 of 20 cold requests 200 ms away, each traced at a proxy). It lends
    that slot now, and is placed at once."""
    mistral = "mistralai/Mistral-7B-Instruct-v0.3"
    node = fake_nodes(
        "one-slot", models={LLAMA8: "loaded", mistral: "loaded"}, max_concurrency=1, latency_s=0.3
    )
    app = create_app(
        Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5, NEURALGRID_SPOOL_DIR=spool), db_url, sweep=False
    )
    with ThreadedServer(app) as gateway:
        renewing = app.state.services.pipeline.placement.leased.renewals
        held, let_go = threading.Event(), threading.Event()

        class AnswerHeld:  # the renewal that names a placed job runs in SQL; its answer is on its way
            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            async def all(self, query: Any, params: Any = None) -> Any:
                rows = await store.all(query, params)
                if query is q.RENEW_LEASES and not held.is_set() and '"placed"' in params[1]:
                    held.set()
                    await asyncio.to_thread(let_go.wait, 30)
                return rows

        store = renewing.store
        renewing.store = AnswerHeld()
        try:
            first = ask(gateway.url, api_key)  # cold: placed in SQL, its slot moved into a lease
            assert first.status_code == 200, first.text
            assert held.is_set()
            written_behind(gateway.url)  # its end: the lease keeps the slot, idle
            assert leases_held(conn, node.node_id) == 1
            answer = ask(gateway.url, api_key, {**PLAIN, "model": mistral})
            assert answer.status_code == 200, answer.text
            assert float(answer.headers["x-neuralgrid-queue-ms"]) == 0  # placed at once, not in line
            assert not let_go.is_set()
        finally:
            let_go.set()
        written_behind(gateway.url)
        # The answer, once it came, is read a slot smaller: the lease lent it, and nothing is overbooked.
        assert ask(gateway.url, api_key).status_code == 200
        written_behind(gateway.url)
        row = conn.execute(
            "select n.inflight, (select coalesce(sum(l.slots), 0) from private.slot_leases l where l.node_id = n.id)"
            " + (select count(*) from job_attempts a where a.node_id = n.id and a.status = 'running' and not a.leased)"
            " from nodes n where n.id = %s",
            (node.node_id,),
        ).fetchone()
        assert row is not None and row[0] <= 1 and row[0] == row[1], row


def test_a_job_moved_into_a_lease_by_a_renewal_whose_answer_was_lost_is_known_at_the_next(
    conn: psycopg.Connection, fake_nodes: Any, leased_gateway: str, api_key: str, monkeypatch: Any
) -> None:
    """A renewal that moves a job SQL placed into the lease commits, and its answer is lost (the
    connection breaks as it comes back): the next renewal's lease counts the job's slot, which the
    gateway did not know in use. It sent a second request to that slot while the job still ran,
    the node past its one slot. Now each renewal names the jobs SQL placed that the gateway still
    thinks SQL's, and hears which of them a lease holds."""
    fake_nodes("one-slot", max_concurrency=1, latency_s=1.0)
    send = renewals.Renewals._send
    lost: list[bool] = []

    async def answer_lost(self: renewals.Renewals, lanes: list[dict[str, object]], *args: Any) -> None:
        if lost or not args[1]:  # args: sent_at, the lanes it asks for (after a placement)
            return await send(self, lanes, *args)
        await self.store.all(q.RENEW_LEASES, (self.gateway_id, json.dumps(lanes)))  # committed
        lost.append(True)
        raise psycopg.OperationalError("the connection broke as the answer came")

    monkeypatch.setattr(renewals.Renewals, "_send", answer_lost)
    answered: dict[str, float] = {}

    def timed(name: str) -> None:
        assert ask(leased_gateway, api_key).status_code == 200
        answered[name] = time.monotonic()

    first = threading.Thread(target=timed, args=("first",))
    first.start()
    wait_for(lambda: bool(lost), timeout=5)
    assert leases_held(conn) == 1  # the first job's slot, in the lease
    timed("second")  # the next renewals come within 0.5 s, while the first job runs
    first.join()
    assert answered["second"] - answered["first"] > 0.8, answered  # after the first, not beside it


def test_a_lease_that_runs_out_grows_at_once_not_at_the_next_renewal(
    conn: psycopg.Connection, fake_nodes: Any, db_url: str, spool: Path, api_key: str, monkeypatch: Any
) -> None:
    """A burst past what a lane's lease holds is placed in SQL (a round trip, and four times the
    Postgres CPU) until a renewal grows the lease. Once as many are in SQL as on the lease, the next
    asks for that renewal (bench gateway's rounds began with half a second of it: the periodic
    renewal's wait)."""
    monkeypatch.setattr(renewals, "RENEW_EVERY_S", 60.0)  # no periodic renewal within the test
    node = fake_nodes("leased-grows", latency_s=0.02)  # 4 slots
    settings = Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5, NEURALGRID_SPOOL_DIR=spool)
    stop = threading.Event()
    served: list[str] = []
    with ThreadedServer(create_app(settings, db_url, sweep=False)) as gateway:
        assert ask(gateway.url, api_key).status_code == 200  # cold: a renewal leases the lane
        wait_for(lambda: leases_held(conn, node.node_id) > 0, timeout=10)
        small = leases_held(conn, node.node_id)
        assert small < 4  # one request's worth, and a spare
        threads = _callers(gateway.url, api_key, 4, stop, served)
        try:
            # Grown, with no periodic renewal. Not always to all 4: a renewal leases the slots free
            # as it runs, and the requests SQL placed hold some; a lease one slot short is left to
            # the periodic renewal (LeaseBook.outgrown), which CI's run of c5987a0 met.
            wait_for(lambda: leases_held(conn, node.node_id) > small, timeout=10)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
    assert "" not in served


def test_a_renewal_on_its_way_holds_up_no_journal_write(
    conn: psycopg.Connection, fake_nodes: Any, db_url: str, spool: Path, api_key: str
) -> None:
    """A gateway's renewals and its journal's writes meet on the rows of its own jobs. They were sent
    one at a time, and a far gateway's job ends waited behind each renewal a whole round trip, their
    slots held that long (bench world, 65ee3cd: 243 ms after the answer at 200 ms, median). Now
    Postgres orders them (renew_leases() and record_jobs() take the gateway's advisory lock): with a
    renewal held on its way, a leased job's end is written all the same."""
    fake_nodes("leased-renewal-held")
    settings = Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5, NEURALGRID_SPOOL_DIR=spool)
    app = create_app(settings, db_url, sweep=False)
    with ThreadedServer(app) as gateway:
        assert ask(gateway.url, api_key).status_code == 200  # cold: a renewal leases the lane
        wait_for(lambda: served_from_a_lease(gateway.url, api_key), timeout=10)
        renewals = app.state.services.pipeline.placement.leased.renewals
        on_its_way, let_go = threading.Event(), threading.Event()

        async def held(_params: Any) -> None:  # a round trip as long as we like
            on_its_way.set()
            await asyncio.to_thread(let_go.wait, 30)

        renewals.store = Intercepted(renewals.store, q.RENEW_LEASES, held)
        try:
            wait_for(on_its_way.is_set, timeout=5)  # the periodic renewal, held
            answer = ask(gateway.url, api_key)
            assert answer.status_code == 200, answer.text
            job = answer.headers["x-neuralgrid-job"]

            def written() -> bool:
                row = conn.execute("select status from jobs where id = %s", (job,)).fetchone()
                return row is not None and row[0] == "succeeded"

            wait_for(written, timeout=5)
            assert not let_go.is_set()  # written while the renewal was still on its way
        finally:
            let_go.set()


def test_a_request_for_a_model_or_policy_that_does_not_exist_stops_no_renewal(
    conn: psycopg.Connection, fake_nodes: Any, db_url: str, spool: Path, api_key: str
) -> None:
    """Such a request is refused. Its lane had been wanted IDLE_S from its ask, and Postgres had
    refused every renewal that named it: the gateway's leases lapsed, and a key sending one such
    request a second kept them lapsed (a new user's trial). Postgres now gives such a lane nothing,
    and the gateway forgets it once SQL refuses its request: made-up names pile up in no renewal."""
    fake_nodes("leased-a")
    settings = Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5, NEURALGRID_SPOOL_DIR=spool)
    app = create_app(settings, db_url, sweep=False)
    with ThreadedServer(app) as gateway:
        assert ask(gateway.url, api_key).status_code == 200
        wait_for(lambda: leases_held(conn) > 0, timeout=5)
        renewing = app.state.services.pipeline.placement.leased.renewals
        named: list[set[str]] = []

        async def noted(params: Any) -> None:
            named.append({str(lane["model"]) + " " + str(lane["policy"]) for lane in json.loads(params[1])})

        renewing.store = Intercepted(renewing.store, q.RENEW_LEASES, noted)
        for i in range(5):
            made_up = ask(gateway.url, api_key, {**PLAIN, "model": f"nobody/serves-this-{i}"})
            assert made_up.status_code == 404, made_up.text
        no_policy = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json=PLAIN,
            headers={"authorization": f"Bearer {api_key}", "x-neuralgrid-policy": "fastest-ever"},
            timeout=20,
        )
        assert no_policy.status_code == 400, no_policy.text

        def ends() -> Any:
            return conn.execute("select max(expires_at) from private.slot_leases").fetchone()

        after_all = ends()
        wait_for(lambda: ends() > after_all, timeout=4 * renewals.RENEW_EVERY_S + 1)  # renewed again
        seen = len(named)
        wait_for(lambda: len(named) >= seen + 2, timeout=4 * renewals.RENEW_EVERY_S + 1)
        assert all(lanes == {f"{LLAMA8} balanced"} for lanes in named[seen:]), named
        assert served_from_a_lease(gateway.url, api_key)
