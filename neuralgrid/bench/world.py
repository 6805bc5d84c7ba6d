"""`neuralgrid bench world`: gateways across the world from their database, on one machine (issue 42).

A scratch database on the platform's Postgres, two fake nodes, and gateways (`neuralgrid up`) each
connected to Postgres through a delay proxy of its own (bench/delay.py: this kernel has no netem),
by default at 5, 80 and 200 ms RTT, beside a reference gateway connected directly: "next to the
database". Everything each gateway adds over the reference is what its distance costs. Measured:

- each link: a `select 1` over it, the median (the RTT it was given, and the proxy's own cost);

- steady state: sequential requests (after warm-up ones), whole answers and streams in turn, the
  gateways in alternating rounds; the median whole answer and the median stream's first byte (its
  first body bytes), less the reference gateway's, in ms and in RTTs (the link's, as measured: the
  proxy's own cost, a millisecond or two, is part of every round trip over it);
- cold: the first request for a model the gateway has not served (models of their own, one whole
  answer and one stream each, every gateway asking each once), less the reference's, likewise;
  and how many of them waited in line for a slot (x-neuralgrid-queue-ms), and how long;
- revocation: a key every gateway has served (and cached) is revoked in SQL; each gateway is asked
  every 20 ms until it refuses; per gateway, how long after the revocation the first request sent
  was refused (none admitted after it) and when that refusal arrived;
- node death: a model on two nodes, the cheaper one (the one the matcher prefers) on a fake node
  process of its own, which is killed (SIGKILL); each gateway is asked every 20 ms, without
  waiting for the answers, until three answers in a row (in the order sent) come from the other
  node at the first attempt (x-neuralgrid-node, x-neuralgrid-attempts); per gateway, how long after
  the kill the first of them was sent, and how many requests failed over (or failed) meanwhile.

The fake nodes answer at once, so an answer's time is the gateways' own and their links'. A proxy
delays bytes, not the TCP handshake: pools keep their connections open.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psycopg

from neuralgrid.bench import LEDGER_HISTORY, MODEL, ledger_history, scratch_database
from neuralgrid.bench.world_stack import (
    Gateway,
    add_fake_node,
    add_gateway,
    add_key,
    add_models,
    add_node,
    add_proxies,
    gateway_database_url,
    gateways,
    processes,
)
from neuralgrid.server.serving import run_fast

SCRATCH_DB = "neuralgrid_bench_world"
RTTS_MS = (5.0, 80.0, 200.0)
DEATH_MODEL = "mistralai/Mistral-7B-Instruct-v0.3"  # two nodes; the preferred one dies
COLD_MODEL = "world/cold-{}"  # a model per cold request, in the catalog, on the main node
ROUNDS = 4  # the gateways take turns, the order reversed every round, so drift falls on all alike
POLL_S = 0.02  # how often each gateway is asked while a revocation or a node's death spreads
IN_A_ROW = 3  # answers from the surviving node, first attempt, that say the dead one is avoided
TARGET = (
    "steady state: whole answer and stream's first byte each add at most 0.1 RTT over the gateway next"
    " to the database; cold: at most 1 RTT; a revoked key refused and a dead node avoided everywhere"
    " within 1 s"
)


@dataclass
class Answer:
    status: int  # 0: no answer
    sent: float  # perf_counter
    first_byte_s: float  # after sent: the first body bytes (a stream's first event)
    total_s: float  # after sent: the whole answer read
    node: str | None
    attempts: int
    job: str | None
    queued_ms: float = 0.0  # x-neuralgrid-queue-ms: its wait in line for a slot


def body(model: str, stream: bool, max_tokens: int = 16) -> bytes:
    messages = [{"role": "user", "content": "Across the world."}]
    return json.dumps(
        {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    ).encode()


async def ask(client: aiohttp.ClientSession, url: str, data: bytes, key: str) -> Answer:
    """One request, timed from before it is sent: first body bytes and the whole answer."""
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    sent = time.perf_counter()
    first = 0.0
    try:
        async with client.post(url, data=data, headers=headers) as resp:
            async for chunk in resp.content.iter_any():
                if chunk and not first:
                    first = time.perf_counter() - sent
            total = time.perf_counter() - sent
            h = resp.headers
            attempts = int(h.get("x-neuralgrid-attempts") or 0)
            return Answer(
                resp.status,
                sent,
                first or total,
                total,
                h.get("x-neuralgrid-node"),
                attempts,
                h.get("x-neuralgrid-job"),
                float(h.get("x-neuralgrid-queue-ms") or 0),
            )
    except (aiohttp.ClientError, TimeoutError):
        took = time.perf_counter() - sent
        return Answer(0, sent, took, took, None, 0, None)


def client(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit), timeout=aiohttp.ClientTimeout(total=60)
    )


@dataclass
class Samples:
    whole_ms: list[float]
    first_byte_ms: list[float]
    failed: int = 0
    queued_ms: list[float] = field(default_factory=list)  # each answer's wait in line, in order

    def medians(self) -> tuple[float | None, float | None]:
        return _median(self.whole_ms), _median(self.first_byte_ms)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


async def steady(gws: Sequence[Gateway], key: str, requests: int, warmup: int) -> dict[str, Samples]:
    """`requests` whole answers and as many streams per gateway, in turn, after `warmup` of each."""
    found = {g.name: Samples([], []) for g in gws}
    per_round = max(1, -(-requests // ROUNDS))
    async with client() as session:
        for g in gws:
            for _ in range(warmup):
                for stream in (False, True):
                    await ask(session, g.chat, body(MODEL, stream), key)
        for r in range(ROUNDS):
            for g in gws if r % 2 == 0 else gws[::-1]:
                for _ in range(min(per_round, requests - r * per_round)):
                    for stream in (False, True):
                        _record(found[g.name], await ask(session, g.chat, body(MODEL, stream), key), stream)
    return found


async def cold(gws: Sequence[Gateway], key: str, count: int) -> dict[str, Samples]:
    """Each gateway's first request for a model: `count` whole answers and `count` streams, a model
    each (COLD_MODEL numbered from 0), every gateway asking each model once, in turn. Who asks
    first rotates (a model's first job on the node costs Postgres more: its cold start is marked)."""
    found = {g.name: Samples([], []) for g in gws}
    async with client() as session:
        for i in range(2 * count):
            stream = i % 2 == 1
            first = (i // 2) % len(gws)
            for g in [*gws[first:], *gws[:first]]:
                _record(
                    found[g.name], await ask(session, g.chat, body(COLD_MODEL.format(i), stream), key), stream
                )
    return found


def _record(samples: Samples, answer: Answer, stream: bool) -> None:
    if answer.status != 200:
        samples.failed += 1
        return
    samples.queued_ms.append(answer.queued_ms)
    if stream:
        samples.first_byte_ms.append(answer.first_byte_s * 1000)
    else:
        samples.whole_ms.append(answer.total_s * 1000)


async def revocation(
    gws: Sequence[Gateway], db_url: str, key_id: str, key: str, timeout_s: float
) -> dict[str, dict[str, Any]]:
    """The key served by every gateway, revoked in SQL, then each gateway asked every POLL_S until
    it refuses (401): when, after the revocation, the first refused request was sent (every request
    sent after it refused too) and when its refusal arrived; requests admitted after it."""
    data = body(MODEL, False, max_tokens=1)
    async with client() as session:
        for g in gws:
            warm = await ask(session, g.chat, data, key)
            if warm.status != 200:
                raise RuntimeError(
                    f"{g.name}: the key to revoke was answered {warm.status} before its revocation"
                )
        with psycopg.connect(db_url, autocommit=True) as conn:
            revoked = time.perf_counter()
            conn.execute("update public.api_keys set revoked_at = now() where id = %s", (key_id,))

        async def poll(g: Gateway) -> dict[str, Any]:
            pending: list[asyncio.Task[Answer]] = []
            while time.perf_counter() - revoked < timeout_s:
                pending.append(asyncio.ensure_future(ask(session, g.chat, data, key)))
                await asyncio.sleep(POLL_S)
                done = [t.result() for t in pending if t.done()]
                if sum(a.status == 401 for a in done) > IN_A_ROW:
                    break
            answers = sorted(await asyncio.gather(*pending), key=lambda a: a.sent)
            return _refusal(answers, revoked)

        polled = await asyncio.gather(*(poll(g) for g in gws))
    return {g.name: found for g, found in zip(gws, polled, strict=True)}


def _refusal(answers: list[Answer], since: float) -> dict[str, Any]:
    """The first request from which on all were refused: when it was sent and answered."""
    last_admitted = max((i for i, a in enumerate(answers) if a.status != 401), default=-1)
    refused = answers[last_admitted + 1 :]
    first_refused = next((a for a in answers if a.status == 401), None)
    return {
        "revoked_refused_ms": round((refused[0].sent - since) * 1000, 1) if refused else None,
        "revoked_answered_ms": round((refused[0].sent + refused[0].total_s - since) * 1000, 1)
        if refused
        else None,
        "revoked_admitted_after_refusal": (
            sum(a.status == 200 for a in answers if a.sent > first_refused.sent) if first_refused else 0
        ),
        "revoked_polls": len(answers),
    }


async def node_death(
    gws: Sequence[Gateway], key: str, kill: Callable[[], None], dying: str, survivor: str, timeout_s: float
) -> dict[str, dict[str, Any]]:
    """Requests for DEATH_MODEL through every gateway, then the preferred node's process killed and
    each gateway asked every POLL_S (not waiting for the answers: a request failing over is not the
    gateway's other traffic) until IN_A_ROW answers in a row, in the order sent, come from the
    survivor at the first attempt."""
    data = body(DEATH_MODEL, False, max_tokens=1)
    async with client() as session:
        before = {g.name: [await ask(session, g.chat, data, key) for _ in range(IN_A_ROW)] for g in gws}
        kill()
        killed = time.perf_counter()

        async def poll(g: Gateway) -> tuple[list[Answer], list[Answer]]:
            asked: list[asyncio.Task[Answer]] = []
            seen: list[Answer] = []  # the answers come so far, in the order sent
            while time.perf_counter() - killed < timeout_s:
                asked.append(asyncio.ensure_future(ask(session, g.chat, data, key)))
                await asyncio.sleep(POLL_S)
                seen = [t.result() for t in itertools.takewhile(lambda t: t.done(), asked)]
                if len(seen) >= IN_A_ROW and all(_avoided(a, survivor) for a in seen[-IN_A_ROW:]):
                    break
            return seen, list(await asyncio.gather(*asked))

        polled = await asyncio.gather(*(poll(g) for g in gws))
    found = {}
    for g, (seen, answers) in zip(gws, polled, strict=True):
        run = len(seen)
        while run > 0 and _avoided(seen[run - 1], survivor):
            run -= 1
        avoided = seen[run] if len(seen) - run >= IN_A_ROW else None
        found[g.name] = {
            "dead_node_share_before": round(sum(a.node == dying for a in before[g.name]) / IN_A_ROW, 2),
            "dead_node_avoided_ms": round((avoided.sent - killed) * 1000, 1) if avoided else None,
            "dead_node_failovers": sum(a.attempts > 1 for a in answers),
            "dead_node_failed": sum(a.status != 200 for a in answers),
        }
    return found


def link_rtts(db_url: str, gws: Sequence[Gateway], rounds: int = 5) -> dict[str, float]:
    """Each gateway's round trip to Postgres as measured (`select 1` over its link, the median):
    the RTT it was given and what the proxy itself adds."""
    found = {}
    for g in gws:
        with psycopg.connect(gateway_database_url(db_url, g), autocommit=True) as conn:
            conn.execute("select 1")
            took = []
            for _ in range(rounds):
                started = time.perf_counter()
                conn.execute("select 1")
                took.append((time.perf_counter() - started) * 1000)
        found[g.name] = round(statistics.median(took), 2)
    return found


def _avoided(answer: Answer, survivor: str) -> bool:
    return answer.status == 200 and answer.node == survivor and answer.attempts == 1


def run(
    admin_url: str,
    rtts_ms: Sequence[float] = RTTS_MS,
    requests: int = 30,
    warmup: int = 5,
    cold_requests: int = 10,
    timeout_s: float = 10.0,
    history: int = LEDGER_HISTORY,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """One row per gateway, the reference first."""
    gws = gateways(rtts_ms)
    cold_models = [COLD_MODEL.format(i) for i in range(2 * cold_requests)]
    with scratch_database(admin_url, SCRATCH_DB) as db_url, processes() as procs:
        main_url = add_fake_node(procs, "node-main")
        dying_url = add_fake_node(procs, "node-dying")
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("update public.platform_settings set heartbeat_interval_s = 86400")
            add_models(conn, cold_models)
            add_node(conn, "world-main", main_url, [MODEL, *cold_models])
            dying = add_node(conn, "world-dying", dying_url, [DEATH_MODEL], hourly_rate=0.2)
            survivor = add_node(conn, "world-survivor", main_url, [DEATH_MODEL])
            key_id, key = add_key(conn, "world")
            revoked_id, revoked_key = add_key(conn, "world-revoked")
            ledger_history(conn, key_id, MODEL, history)
            conn.execute("analyze")
        add_proxies(procs, db_url, gws)
        for g in gws:
            add_gateway(procs, db_url, g)
        progress(
            f"starting {len(gws)} gateways ({', '.join(g.name for g in gws)}), two fake nodes, the proxies"
        )
        procs.start("node-main", "node-dying", "proxies")
        procs.start(*(g.name for g in gws))
        links = link_rtts(db_url, gws)
        progress(f"steady state: {requests} whole answers and {requests} streams per gateway")
        warm = run_fast(steady(gws, key, requests, warmup))
        progress(f"cold: {cold_requests} whole answers and streams per gateway, a model each")
        first = run_fast(cold(gws, key, cold_requests))
        progress("revocation: a key revoked in SQL")
        revoked = run_fast(revocation(gws, db_url, revoked_id, revoked_key, timeout_s))
        progress("node death: the preferred node of a model killed")
        death = run_fast(node_death(gws, key, lambda: procs.kill("node-dying"), dying, survivor, timeout_s))
    return _rows(gws, links, warm, first, revoked, death)


def _rows(
    gws: Sequence[Gateway],
    links: dict[str, float],
    warm: dict[str, Samples],
    first: dict[str, Samples],
    revoked: dict[str, dict[str, Any]],
    death: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    ref = gws[0].name
    rows = []
    for g in gws:
        row: dict[str, Any] = {"gateway": g.name, "rtt_ms": g.rtt_ms, "link_rtt_ms": links[g.name]}
        for prefix, found in (("", warm), ("cold_", first)):
            whole, first_byte = found[g.name].medians()
            ref_whole, ref_first_byte = found[ref].medians()
            row[f"{prefix}whole_p50_ms"] = whole
            row[f"{prefix}first_byte_p50_ms"] = first_byte
            row[f"{prefix}samples"] = len(found[g.name].whole_ms) + len(found[g.name].first_byte_ms)
            row[f"{prefix}failed"] = found[g.name].failed
            if prefix == "cold_":  # few, and spread widely: each one, in the order asked
                row["cold_whole_each_ms"] = [round(ms, 1) for ms in found[g.name].whole_ms]
                row["cold_first_byte_each_ms"] = [round(ms, 1) for ms in found[g.name].first_byte_ms]
                # Each one's wait in line for a slot (whole answers and streams as asked): a node full
                # of other gateways' leases, not the distance, made those wait.
                row["cold_queued_each_ms"] = [round(ms, 1) for ms in found[g.name].queued_ms]
                row["cold_waited"] = sum(1 for ms in found[g.name].queued_ms if ms > 0)
            for name, mine, theirs in (
                ("whole", whole, ref_whole),
                ("first_byte", first_byte, ref_first_byte),
            ):
                added = round(mine - theirs, 3) if mine is not None and theirs is not None else None
                row[f"{prefix}{name}_added_ms"] = added
                row[f"{prefix}{name}_added_rtt"] = (
                    round(added / links[g.name], 2) if added is not None and g.rtt_ms else None
                )
        rows.append({**row, **revoked[g.name], **death[g.name]})
    return rows
