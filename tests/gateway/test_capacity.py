"""Capacity under load at the default settings: slots freed as answers are delivered, and requests
that find every capable node busy wait their turn (fair across keys, bounded, with a deadline)
instead of an immediate 503."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import psycopg
import pytest

from neuralgrid.gateway import claims, journal, leases, renewals
from tests.conftest import LLAMA8, stream_chat
from tests.slots import JOB_SLOTS, written_behind

T = TypeVar("T")
BODY = {"model": LLAMA8, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(params=[True, False], ids=["leases", "leases-off"])
def either_gateway(request: pytest.FixtureRequest, gateway_settings: dict[str, Any]) -> str:
    """The gateway with leases on, then off (NEURALGRID_LEASES=false places every request in SQL):
    leases off, a waiting request's turns once asked nothing (1e7c71b to dc4a560), every one of them
    waiting for its deadline, and no test ran that way."""
    gateway_settings["NEURALGRID_LEASES"] = request.param
    return str(request.getfixturevalue("gateway"))


def _inflight(conn: psycopg.Connection) -> int:
    row = conn.execute(f"select coalesce(sum({JOB_SLOTS}), 0)::int from nodes n").fetchone()
    assert row is not None
    return int(row[0])


async def _load(url: str, key: str, callers: int, each: int, stream: bool = False) -> list[httpx.Response]:
    """`callers` clients, each sending `each` requests one after another."""
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:

        async def caller() -> list[httpx.Response]:
            return [
                await http.post("/v1/chat/completions", json={**BODY, "stream": stream}) for _ in range(each)
            ]

        runs = await asyncio.gather(*(caller() for _ in range(callers)))
    return [resp for run in runs for resp in run]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_slot_is_free_when_the_answer_arrives(
    conn: psycopg.Connection,
    fake_nodes: Any,
    gateway_settings: dict[str, Any],
    request: pytest.FixtureRequest,
    api_key: str,
    stream: bool,
) -> None:
    """A caller's next request must find the slot its last answer held. Leases off: free in SQL once
    the answer is in (it waits for the write)."""
    gateway_settings["NEURALGRID_LEASES"] = False
    gateway: str = request.getfixturevalue("gateway")
    fake_nodes(max_concurrency=1)
    with httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {api_key}"}) as http:
        for _ in range(10):
            resp = http.post("/v1/chat/completions", json={**BODY, "stream": stream})
            assert resp.status_code == 200, resp.text
            assert _inflight(conn) == 0  # at once, not after a later batch write


def _one_after_another(gateway: str, api_key: str, count: int = 10) -> list[float]:
    """A caller's `count` requests, each sent once the one before is answered: how long each waited
    for a slot, in ms."""
    with httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {api_key}"}) as http:
        answers = [http.post("/v1/chat/completions", json=BODY) for _ in range(count)]
    assert [r.status_code for r in answers] == [200] * count
    return [float(r.headers["x-neuralgrid-queue-ms"]) for r in answers]


def _made(monkeypatch: pytest.MonkeyPatch, cls: type[T]) -> list[T]:
    """Each instance of `cls` (the gateway's renewals, its journal) that the gateways started from
    now on make."""
    made: list[T] = []
    init: Any = cls.__init__

    def noted(self: T, *args: Any) -> None:
        init(self, *args)
        made.append(self)

    monkeypatch.setattr(cls, "__init__", noted)
    return made


async def _holding_rows(db_url: str, node_id: object, send: Any, journals: list[journal.Journal]) -> None:
    """`send` while another transaction holds the node's row and every job's (a placement, a job's
    end being written): a renewal skips them, and leases nothing on the node. The gateway's journal
    waits meanwhile: its write would wait for those rows holding the gateway's advisory lock, which
    the renewal takes first (a wait in a circle through this test, which no gateway makes)."""
    async with journals[0].lock, await psycopg.AsyncConnection.connect(db_url) as other:
        await other.execute("select from nodes where id = %s for no key update", (node_id,))
        await other.execute("select from jobs for no key update")
        await other.execute("select from job_attempts for no key update")
        await send()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_with_leases_the_next_request_takes_the_slot_in_the_lease(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str, stream: bool
) -> None:
    """Leases on (the default), an answer does not wait for its job's end to be written, whether a
    lease or SQL placed it. The first request of a lane is placed in SQL (one round trip), and the
    renewal it starts moves its slot into the gateway's lease: the caller's next request takes that
    slot, with no wait but for that renewal, and SQL holds it for no job once the ends are written."""
    fake_nodes(max_concurrency=1)
    with httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {api_key}"}) as http:
        answers = [http.post("/v1/chat/completions", json={**BODY, "stream": stream}) for _ in range(10)]
    assert [r.status_code for r in answers] == [200] * 10
    waited = [float(r.headers["x-neuralgrid-queue-ms"]) for r in answers]
    assert waited[2:] == [0.0] * 8, waited
    assert waited[1] < 250, waited  # at most the renewal under way (the periodic one: 500 ms)
    written_behind(gateway)
    assert _inflight(conn) == 0


def test_a_lane_whose_first_renewal_leased_nothing_is_leased_by_the_next(
    conn: psycopg.Connection,
    db_url: str,
    fake_nodes: Any,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    api_key: str,
) -> None:
    """A cold lane's renewal can lease nothing: it skips the rows another transaction holds (a job's
    end being written, a placement), never waiting for them. The next request is then placed in
    SQL, and that placement asks for the lane again: the renewal it starts leases the slot, and the
    caller's requests after it wait for nothing. Before, the lane stayed in SQL until the periodic
    renewal, each request waiting for the end of the one before it to be written. (One request may
    wait for a third renewal: the node's row may be held by another transaction still, its
    heartbeat's, say. A renewal under way as SQL placed the request, and this gateway's own journal,
    no longer leave the lane in SQL: the next two tests.)"""
    node = fake_nodes(max_concurrency=1)
    journals = _made(monkeypatch, journal.Journal)
    send = renewals.Renewals._send
    held: list[bool] = []

    async def send_while_held(self: renewals.Renewals, lanes: list[dict[str, object]], *args: Any) -> None:
        if not lanes or held:
            return await send(self, lanes, *args)
        held.append(True)  # the lane's first renewal: its node's and jobs' rows locked elsewhere
        await _holding_rows(db_url, node.node_id, lambda: send(self, lanes, *args), journals)

    monkeypatch.setattr(renewals.Renewals, "_send", send_while_held)
    waited = _one_after_another(request.getfixturevalue("gateway"), api_key)
    assert held and sum(w > 0 for w in waited[3:]) <= 1 and waited[5:] == [0.0] * 5, waited


def test_a_lease_renewal_sent_while_the_journal_writes_still_leases_the_lane(
    fake_nodes: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, api_key: str
) -> None:
    """A write of the gateway's journal holds its own jobs' rows, which a renewal skips: a renewal
    running beside it would not move the slot of a job SQL placed into the lease, and the caller's
    next request would be placed in SQL again. The gateway had sent the two one at a time; now
    Postgres orders them (the gateway's advisory lock), so that both are on their way at once (a far
    gateway's ends no longer wait a round trip). Here one is asked for as each write begins."""
    fake_nodes(max_concurrency=1)
    made = _made(monkeypatch, renewals.Renewals)
    writing: list[bool] = []
    met: list[bool] = []  # for each renewal sent, whether the journal was writing
    asked: set[asyncio.Task[None]] = set()
    write = journal.Journal._write

    async def write_as_a_renewal_is_asked_for(self: journal.Journal, batch: list[Any]) -> None:
        renewal = asyncio.get_running_loop().create_task(made[0].renew())
        asked.add(renewal)
        renewal.add_done_callback(asked.discard)
        writing.append(True)
        try:
            await asyncio.sleep(0.02)  # the renewal's turn
            await write(self, batch)
        finally:
            writing.clear()

    send = renewals.Renewals._send

    async def send_noted(self: renewals.Renewals, *args: Any) -> None:
        met.append(bool(writing))
        await send(self, *args)

    monkeypatch.setattr(journal.Journal, "_write", write_as_a_renewal_is_asked_for)
    monkeypatch.setattr(renewals.Renewals, "_send", send_noted)
    waited = _one_after_another(request.getfixturevalue("gateway"), api_key)
    assert any(met) and waited[3:] == [0.0] * 7, (met, waited)


def test_a_request_placed_in_sql_asks_for_a_renewal_sent_after_it(
    db_url: str,
    fake_nodes: Any,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    api_key: str,
) -> None:
    """A renewal sent before SQL placed a request cannot see its job: the request asks for one sent
    after it, and only such a renewal's empty answer counts against the lane. Here a renewal is sent
    just before the lane's first placement and answers after it (the periodic one, say, on a
    loaded machine), and the first renewal sent after the placement meets held rows: the one after
    it leases the slot. Before, the request asked for no renewal (one was under way), and the two
    empty answers left the lane in SQL until the periodic renewal, each request waiting for the end
    of the one before it to be written (CI at 751a219: [0, 79, 28, 11, 11, 11, ...] ms)."""
    monkeypatch.setattr(renewals, "RENEW_EVERY_S", 60.0)  # no periodic renewal within the test
    node = fake_nodes(max_concurrency=1)
    made, journals = _made(monkeypatch, renewals.Renewals), _made(monkeypatch, journal.Journal)
    events: dict[str, asyncio.Event] = {}
    early: list[asyncio.Task[None]] = []
    sent: list[int] = []
    place = claims.Claims.place

    async def place_as_a_renewal_answers(self: claims.Claims, params: Any) -> Any:
        if not early:
            events.update(sent=asyncio.Event(), asked=asyncio.Event())
            early.append(asyncio.get_running_loop().create_task(made[0].renew()))
            await events["sent"].wait()
        return await place(self, params)

    send = renewals.Renewals._send

    async def send_held(self: renewals.Renewals, lanes: list[dict[str, object]], *args: Any) -> None:
        if not lanes or len(sent) >= 2:
            return await send(self, lanes, *args)
        sent.append(len(lanes))
        await _holding_rows(db_url, node.node_id, lambda: send(self, lanes, *args), journals)
        if len(sent) == 1:  # the renewal sent before the placement answers after it
            events["sent"].set()
            await asyncio.wait_for(events["asked"].wait(), 5)

    soon = renewals.Renewals.soon

    def soon_noted(self: renewals.Renewals, lane: leases.Lane) -> None:
        soon(self, lane)
        events["asked"].set()

    monkeypatch.setattr(claims.Claims, "place", place_as_a_renewal_answers)
    monkeypatch.setattr(renewals.Renewals, "_send", send_held)
    monkeypatch.setattr(renewals.Renewals, "soon", soon_noted)
    waited = _one_after_another(request.getfixturevalue("gateway"), api_key)
    assert sent == [1, 1] and waited[3:] == [0.0] * 7, (sent, waited)


def test_a_request_waits_for_the_renewal_asked_for_its_lane_not_sql(
    fake_nodes: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, api_key: str
) -> None:
    """A request of a lane that holds no free leased slot, with a renewal on its way that asks for
    the lane (SQL placed one of its requests), waits for that renewal's answer rather than ask SQL:
    a placement beside the renewal holds the node's row, which the renewal skips, and on a loaded
    machine (its renewals slow) the lane got nothing renewal after renewal while one caller's
    requests were each placed in SQL (CI at dee9b7f: [0, 73, 16, 17, 23, 6, ...] ms). Here each
    renewal that asks for a lane is 50 ms on its way: no placement runs then."""
    monkeypatch.setattr(renewals, "RENEW_EVERY_S", 60.0)  # no periodic renewal within the test
    fake_nodes(max_concurrency=1)
    asking: list[bool] = []  # whether a renewal that asks for a lane is on its way
    beside: list[bool] = []  # for each placement in SQL, whether one was
    send = renewals.Renewals._send

    async def send_slowly(self: renewals.Renewals, lanes: Any, sent_at: float, asked: set[Any]) -> None:
        asking.append(bool(asked))
        try:
            if asked:
                await asyncio.sleep(0.05)
            await send(self, lanes, sent_at, asked)
        finally:
            asking.pop()

    place = claims.Claims.place

    async def place_noted(self: claims.Claims, params: Any) -> Any:
        beside.append(any(asking))
        return await place(self, params)

    monkeypatch.setattr(renewals.Renewals, "_send", send_slowly)
    monkeypatch.setattr(claims.Claims, "place", place_noted)
    waited = _one_after_another(request.getfixturevalue("gateway"), api_key)
    assert beside == [False] and waited[2:] == [0.0] * 8, (beside, waited)


@pytest.mark.parametrize("callers", [4, 8])
def test_callers_up_to_the_slots_are_never_refused(
    fake_nodes: Any, gateway: str, api_key: str, callers: int
) -> None:
    """Measured before: two nodes of 4 slots, 8 callers: 399 of 800 requests refused with 503."""
    for _ in range(2):
        fake_nodes(latency_s=0.005)  # the default 4 slots each
    responses = asyncio.run(_load(gateway, api_key, callers, 25))
    refused = [r.text for r in responses if r.status_code != 200]
    assert refused == []


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_eight_times_the_slots_wait_and_are_all_served(
    fake_nodes: Any, either_gateway: str, api_key: str, stream: bool
) -> None:
    fake_nodes(max_concurrency=2, latency_s=0.05)
    responses = asyncio.run(_load(either_gateway, api_key, 16, 3, stream))
    assert [r.status_code for r in responses] == [200] * 48
    waited = [float(r.headers["x-neuralgrid-queue-ms"]) for r in responses]
    assert max(waited) > 50  # most waited for a slot: at least one answer's time
    assert min(waited) >= 0
    # 48 answers of 50 ms on 2 slots take 1.2 s: none waits for its deadline (30 s), whatever the
    # machine's speed.
    assert max(waited) < 5000


@pytest.fixture
def short_queue(gateway_settings: dict[str, Any]) -> Iterator[dict[str, Any]]:
    gateway_settings.update(NEURALGRID_QUEUE_TIMEOUT_S=0.5, NEURALGRID_QUEUE_MAX_WAITING=2)
    yield gateway_settings


def test_past_the_deadline_a_busy_fleet_is_503_with_retry_after(
    conn: psycopg.Connection, short_queue: Any, fake_nodes: Any, gateway: str, api_key: str
) -> None:
    fake_nodes(max_concurrency=1, latency_s=2.0)
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=gateway, timeout=10) as http:
        headers = {"authorization": f"Bearer {api_key}"}
        slow = pool.submit(http.post, "/v1/chat/completions", json=BODY, headers=headers)
        time.sleep(0.3)
        started = time.monotonic()
        resp = http.post("/v1/chat/completions", json=BODY, headers=headers)
        took = time.monotonic() - started
        assert slow.result().status_code == 200
    assert resp.status_code == 503
    assert 0.4 < took < 1.5  # it waited for the deadline, then gave up
    error = resp.json()["error"]
    assert error["code"] == "no_capacity"
    assert "busy" in error["message"] and LLAMA8 in error["message"]
    assert int(resp.headers["retry-after"]) >= 1
    assert 400 < float(resp.headers["x-neuralgrid-queue-ms"]) < 1500  # a refusal says how long it waited
    refused = conn.execute("select error from jobs where status = 'failed'").fetchall()
    assert [row[0] for row in refused] == [error["message"]]  # the refusal is on record, once


def test_a_full_queue_refuses_at_once(short_queue: Any, fake_nodes: Any, gateway: str, api_key: str) -> None:
    fake_nodes(max_concurrency=1, latency_s=1.0)
    statuses = asyncio.run(_load(gateway, api_key, 5, 1))
    codes = sorted(r.status_code for r in statuses)
    # One served at once, two waiting (the queue's bound), two refused at once; the waiters' deadline
    # (0.5 s) passes before the 1 s answer frees the slot.
    assert codes.count(200) == 1 and codes.count(503) == 4
    full = [r for r in statuses if r.status_code == 503 and "queue" in r.json()["error"]["message"]]
    assert len(full) == 2 and all(r.headers.get("retry-after") for r in full)
    assert all(float(r.headers["x-neuralgrid-queue-ms"]) < 400 for r in full)  # refused at once


def test_no_node_online_is_503_at_once_and_says_so(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    with httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {api_key}"}) as http:
        started = time.monotonic()
        resp = http.post("/v1/chat/completions", json=BODY)
    assert time.monotonic() - started < 1.0
    assert resp.status_code == 503 and resp.headers.get("retry-after")
    assert "no capable node is online" in resp.json()["error"]["message"]


def test_waiting_is_fair_across_keys(
    conn: psycopg.Connection, fake_nodes: Any, either_gateway: str, api_key: str
) -> None:
    """A key that floods the queue does not push another key's request behind all of its own."""
    fake_nodes(max_concurrency=1, latency_s=0.1)
    row = conn.execute("select api_key from create_api_key('patient')").fetchone()
    assert row is not None
    other = str(row[0])

    async def run() -> tuple[list[float], float]:
        async with httpx.AsyncClient(base_url=either_gateway, timeout=60) as http:

            async def one(key: str) -> float:
                resp = await http.post(
                    "/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {key}"}
                )
                assert resp.status_code == 200, resp.text
                return time.monotonic()

            flood = [asyncio.create_task(one(api_key)) for _ in range(8)]
            await asyncio.sleep(0.15)  # the flood is queued first
            patient = await one(other)
            return list(await asyncio.gather(*flood)), patient

    flood_done, patient_done = asyncio.run(run())
    # Served second or third in line, not ninth.
    assert sum(done < patient_done for done in flood_done) <= 3


def test_a_waiting_stream_is_served(fake_nodes: Any, either_gateway: str, api_key: str) -> None:
    fake_nodes(max_concurrency=1, latency_s=0.3)

    def read(_: int) -> str:
        with stream_chat(either_gateway, api_key, {**BODY, "stream": True}) as resp:
            assert resp.status_code == 200, resp.read()
            return str(resp.read().decode())

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(read, range(2)))
    assert all(answer.rstrip().endswith("data: [DONE]") for answer in answers)


def test_queue_wait_is_a_metric(fake_nodes: Any, gateway: str, api_key: str) -> None:
    fake_nodes(max_concurrency=1, latency_s=0.05)
    asyncio.run(_load(gateway, api_key, 4, 2))
    text = httpx.get(f"{gateway}/metrics").text
    count = next(line for line in text.splitlines() if line.startswith("neuralgrid_queue_wait_seconds_count"))
    assert float(count.split()[-1]) == 8


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_client_that_leaves_while_waiting_leaves_the_line(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str, stream: bool
) -> None:
    """A request whose client hangs up while it waits for a slot is not served later: nothing is
    sent to a node for it, no job is recorded and nothing is charged."""
    node = fake_nodes(latency_s=1.0, max_concurrency=1)
    headers = {"authorization": f"Bearer {api_key}"}
    body = {**BODY, "stream": stream}
    with ThreadPoolExecutor(1) as pool:
        holding = pool.submit(
            httpx.post, f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=10
        )
        time.sleep(0.3)  # the node's one slot is taken
        with pytest.raises(httpx.ReadTimeout):  # waits in line, then hangs up
            httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=0.3)
        assert holding.result().status_code == 200
    time.sleep(1.5)  # time enough to be served, had it stayed in line
    assert node.requests == 1
    assert conn.execute("select count(*) from jobs").fetchone() == (1,)


def test_a_request_no_busy_node_limits_does_not_wait_behind_one_that_is(
    conn: psycopg.Connection, fake_nodes: Any, gateway: str, api_key: str
) -> None:
    """Found in review: the line was one per model, and only its head asked. A head capped at a
    price only a busy node meets (x-neuralgrid-max-price) held every request for the model behind
    it, though a pricier node sat idle: 2.2 s here, up to the whole queue deadline with a longer
    job. A request waits only behind those that could take any node it could."""
    fake_nodes("cheap", hourly_rate=0.2, max_concurrency=1, latency_s=2.0)
    fake_nodes("pricey", hourly_rate=2.0, max_concurrency=4)
    row = conn.execute("select api_key from create_api_key('other')").fetchone()
    assert row is not None
    capped = {"authorization": f"Bearer {api_key}", "x-neuralgrid-max-price": "0.5"}
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=gateway, timeout=30) as http:
        first = pool.submit(http.post, "/v1/chat/completions", json=BODY, headers=capped)  # the cheap node
        time.sleep(0.5)
        second = pool.submit(http.post, "/v1/chat/completions", json=BODY, headers=capped)  # waits for it
        time.sleep(0.5)
        started = time.monotonic()
        resp = http.post("/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {row[0]}"})
        took = time.monotonic() - started
        assert first.result().status_code == 200 and second.result().status_code == 200
    assert resp.status_code == 200, resp.text
    assert took < 1.0 and float(resp.headers["x-neuralgrid-queue-ms"]) < 500, took
