"""`neuralgrid bench gateway`: the same load sent to a fake node, through a bare relay, through node
agents, through the gateway, and through the gateway to node agents, at the default settings.

Processes besides this one's load generator: Postgres, the fake node, a bare relay in front of it
(bench/relay.py: one more HTTP hop through Python, nothing else), the same relay holding a slot in
Postgres while the node works, the gateway (`neuralgrid up`
against a scratch database) and node agents (`neuralgrid node run`, registered with that gateway,
their server the fake node). Each case sends the same load, in alternating rounds, to each path:

- direct: the fake node itself;
- relay: the bare relay;
- relay_sql: the relay, which also claims a slot in the scratch database before asking the node and
  frees it before answering (one UPDATE each): the floor under any gateway that keeps capacity in
  Postgres and frees a slot when its answer is delivered;
- agent: the agents' signed fronts (one per 4 callers, in turn), each request signed with its node's
  key as the gateway signs;
- gateway: the gateway (auth, match, proxy, metering), to nodes with no agent in front;
- gateway_agent: the gateway, to the agents' nodes: the whole way a request takes in production;
- gateway_placed: a second gateway with leases off (NEURALGRID_LEASES=false), to nodes of its own:
  every request placed in SQL and ended there before its answer, as the gateway worked before
  leases (docs/scaling.md#far-from-the-database-leases), for the gateway's figures beside it;
- smg: SGLang's model gateway, a router in Rust (bench/peer.py), round robin over the fake node: a
  peer measured as ours is, reported with ours over it (added p50, requests/s, CPU per request).

Nothing runs above its default settings. Every node has the default slots (the `nodes` table's
max_concurrency, 4; an agent its own default, 4), and there are enough of them for the most callers
asked (64 callers: 16 nodes, and 16 agents), all in front of the one fake node, which sets no limit of
its own. So callers never outnumber slots on either gateway path, and what those paths report
(refusals, the wait for a slot, requests/s) is what a fleet of default nodes gives. `bench capacity`
is the one that puts more callers than slots on them. The scratch database starts as a deployment in
service does, not as a new one: its ledger holds LEDGER_HISTORY finished jobs, analyzed, since
Postgres plans by the tables' statistics.

For each path it reports latency and what it adds to the direct path, requests/s, refused (503) and
failed requests, the wait for a slot, and the CPU per request of the processes on the path (their
on-CPU time from /proc, read before and after each round): the gateway and all of Postgres on the
gateway paths, the agents on the agent paths, smg's process on its path.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import psycopg

from neuralgrid.agent.run import DEFAULT_CONCURRENCY
from neuralgrid.bench import (
    CHAT,
    MODEL,
    CpuMeter,
    Load,
    bench_fleet,
    chat_body,
    peer,
    postmaster_pid,
    scratch_database,
    send_load,
    served,
)
from neuralgrid.protocol import signing
from neuralgrid.server.serving import free_port, run_fast
from neuralgrid.server.settings import Settings

# The gateway_agent path asks for a model only the agents' nodes have, and the gateway path caps the
# price below the agents': each path's requests reach its own nodes, whatever the matcher prefers.
# The gateway_placed path asks for a model of its own too: the other gateway's leases hold none of
# its slots.
AGENT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
PLACED_MODEL = "mistralai/Mistral-7B-Instruct-v0.3"
AGENT_PRICE, FLEET_MAX_PRICE = "5", "1"
AGENT_NAME = "bench-agent-{}"
SCRATCH_DB = "neuralgrid_bench_gateway"
PATHS = ("direct", "relay", "relay_sql", "agent", "gateway", "gateway_placed", "gateway_agent", "smg")
WARMUP = 20  # requests before each round counts: connections, caches and plans
# Then the round's own load for this long, uncounted: a gateway's leases follow its load at each
# renewal (every 0.5 s), and between its rounds, while the other paths took theirs, they shrank.
WARMUP_S = 0.6
ROUNDS = 4  # each case alternates its targets round by round, so that drift spreads over all of them
# What each path's numbers are reported as, against the direct path: "<prefix>added_p50_ms", ….
ADDED = {
    "relay": "relay_",
    "relay_sql": "relay_sql_",
    "agent": "agent_",
    "gateway": "",
    "gateway_placed": "gateway_placed_",
    "gateway_agent": "gateway_agent_",
    "smg": "smg_",
}


@dataclass(frozen=True)
class Target:
    urls: tuple[str, ...]  # taken in turn, as many as the callers need (4 callers an agent)
    headers: dict[str, str] = field(default_factory=dict)
    model: str = MODEL
    keys: dict[str, bytes] = field(default_factory=dict)  # URL: the node key its requests are signed with
    cpu: dict[str, list[int]] = field(default_factory=dict)  # the processes on the path, by name
    slots: int | None = None  # through the gateway: the slots of the nodes the path reaches
    ledger: int | None = None  # through the gateway: the finished jobs its ledger started with


@dataclass(frozen=True)
class Agents:
    pids: list[int]
    urls: list[str]  # their signed fronts' chat URLs
    keys: dict[str, bytes]  # each URL's node key
    slots: int  # as they registered them: their default


def run(
    admin_url: str,
    callers: list[int],
    requests: int,
    progress: Callable[[str], None] = lambda _: None,
    paths: tuple[str, ...] = PATHS,
    smg: str | None = None,
    warmup_s: float = WARMUP_S,
) -> list[dict[str, Any]]:
    """Each case's numbers for the `paths` asked (the direct one always: it is the baseline); `smg`:
    the command of the peer's path (peer.find_smg()); `warmup_s`: each round's uncounted load."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}: choose from {', '.join(PATHS)}")
    if "smg" in paths and smg is None:
        raise ValueError("the smg path needs the smg command (peer.find_smg())")
    names = [name for name in PATHS if name == "direct" or name in paths]
    node_port, relay_port, relay_sql_port, gateway_port, placed_port = (free_port() for _ in range(5))
    smg_port, smg_metrics_port = free_port(), free_port()
    node_url = f"http://127.0.0.1:{node_port}"
    relay_url, gateway_url = f"http://127.0.0.1:{relay_port}", f"http://127.0.0.1:{gateway_port}"
    relay_sql_url, smg_url = f"http://127.0.0.1:{relay_sql_port}", f"http://127.0.0.1:{smg_port}"
    placed_url = f"http://127.0.0.1:{placed_port}"
    with scratch_database(admin_url, SCRATCH_DB) as db_url:
        more = [PLACED_MODEL] if "gateway_placed" in names else []
        fleet = bench_fleet(db_url, [node_url], MODEL, slots=max(callers), more_models=more)  # default size
        env = {**os.environ, "DATABASE_URL": db_url, "NEURALGRID_PORT": str(gateway_port)}
        cli = [sys.executable, "-m", "neuralgrid.cli"]
        relay = [sys.executable, "-m", "neuralgrid.bench.relay", "--node", node_url, "--port"]
        auth = {"authorization": f"Bearer {fleet.key}"}
        results: list[dict[str, Any]] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                served([*cli, "fake-node", "--port", str(node_port)], env, f"{node_url}/v1/models")
            )
            if "relay" in names:
                stack.enter_context(served([*relay, str(relay_port)], env, relay_url))
            relay_sql: list[int] = []
            if "relay_sql" in names:
                with_slots = [*relay, str(relay_sql_port), "--database", db_url]
                relay_sql.append(stack.enter_context(served(with_slots, env, relay_sql_url)).pid)
            on_smg: list[int] = []
            if "smg" in names and smg is not None:
                launch = peer.launch(smg, [node_url], smg_port, smg_metrics_port)
                ready = f"{smg_url}{peer.READY}"
                on_smg.append(stack.enter_context(served(launch, {**env, **peer.ENV}, ready)).pid)
            gateway: list[int] = []
            if {"gateway", "agent", "gateway_agent"} & set(names):
                gateway.append(stack.enter_context(served([*cli, "up"], env, f"{gateway_url}/readyz")).pid)
            placed: list[int] = []
            if "gateway_placed" in names:
                no_leases = {**env, "NEURALGRID_PORT": str(placed_port), "NEURALGRID_LEASES": "false"}
                up = served([*cli, "up"], no_leases, f"{placed_url}/readyz")
                placed.append(stack.enter_context(up).pid)
            agents = Agents([], [], {}, 0)
            if {"agent", "gateway_agent"} & set(names):
                count = math.ceil(max(callers) / DEFAULT_CONCURRENCY)
                progress(f"starting {count} node agent(s) at their default concurrency")
                agents = stack.enter_context(_agents(db_url, gateway_url, fleet.key, node_url, count))
            on_gateway = {"gateway": gateway, "postgres": [postmaster_pid(db_url)]}
            targets = {
                "direct": Target((f"{node_url}{CHAT}",)),
                "relay": Target((f"{relay_url}{CHAT}",)),
                "relay_sql": Target(
                    (f"{relay_sql_url}{CHAT}",),
                    cpu={"gateway": relay_sql, "postgres": [postmaster_pid(db_url)]},
                ),
                "agent": Target(tuple(agents.urls), keys=agents.keys, cpu={"agent": agents.pids}),
                "gateway": Target(
                    (f"{gateway_url}{CHAT}",),
                    {**auth, "x-neuralgrid-max-price": FLEET_MAX_PRICE},
                    cpu=on_gateway,
                    slots=fleet.slots,
                    ledger=fleet.history,
                ),
                "gateway_placed": Target(
                    (f"{placed_url}{CHAT}",),
                    {**auth, "x-neuralgrid-max-price": FLEET_MAX_PRICE},
                    PLACED_MODEL,
                    cpu={"gateway": placed, "postgres": [postmaster_pid(db_url)]},
                    slots=fleet.slots,
                    ledger=fleet.history,
                ),
                "gateway_agent": Target(
                    (f"{gateway_url}{CHAT}",),
                    auth,
                    AGENT_MODEL,
                    cpu={**on_gateway, "agent": agents.pids},
                    slots=agents.slots,
                    ledger=fleet.history,
                ),
                "smg": Target((f"{smg_url}{CHAT}",), cpu={"gateway": on_smg}),  # its process, as ours
            }
            targets = {name: targets[name] for name in names}
            for stream in (False, True):
                for n in callers:
                    total = requests if n == 1 else requests * 4
                    mode = "stream" if stream else "plain"
                    progress(f"{mode} x{n}: {', '.join(names)}, {ROUNDS} rounds")
                    runs = _alternate(targets, stream, n, max(n, total // ROUNDS), warmup_s)
                    result: dict[str, Any] = {"stream": stream, "callers": n, "requests": total, **runs}
                    d = runs["direct"]
                    for name, prefix in ADDED.items():
                        if name in runs and "p50_ms" in runs[name] and "p50_ms" in d:
                            result[f"{prefix}added_p50_ms"] = round(runs[name]["p50_ms"] - d["p50_ms"], 3)
                            result[f"{prefix}added_p99_ms"] = round(runs[name]["p99_ms"] - d["p99_ms"], 3)
                    result.update(_leased_over_placed(runs))
                    if "added_p50_ms" in result and "gateway_agent_added_p50_ms" in result:
                        # the agents' hop behind the gateway
                        added = runs["gateway_agent"]["p50_ms"] - runs["gateway"]["p50_ms"]
                        result["agent_behind_gateway_added_p50_ms"] = round(added, 3)
                    result.update(peer.ratios(result))
                    results.append(result)
    return results


def _leased_over_placed(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The gateway (leases on) over the gateway with leases off: Postgres's CPU per request, and
    the gateway process's, and requests/s."""
    if "gateway" not in runs or "gateway_placed" not in runs:
        return {}
    ours, before = runs["gateway"], runs["gateway_placed"]
    found = {}
    for key, measure in (
        ("leased_over_placed_postgres_cpu", "postgres_cpu_ms_per_request"),
        ("leased_over_placed_gateway_cpu", "gateway_cpu_ms_per_request"),
        ("leased_over_placed_rps", "rps"),
    ):
        if ours.get(measure) is not None and before.get(measure):
            found[key] = round(ours[measure] / before[measure], 3)
    return found


@contextlib.contextmanager
def _agents(db_url: str, gateway_url: str, key: str, node_url: str, count: int) -> Iterator[Agents]:
    """`count` processes of `neuralgrid node run` in front of the fake node, each registered with the
    gateway at its default concurrency, once all their nodes are online."""
    ports = [free_port() for _ in range(count)]
    names = [AGENT_NAME.format(i) for i in range(count)]
    procs: list[tuple[subprocess.Popen[str], IO[str]]] = []
    with contextlib.ExitStack() as logs:
        try:
            for name, port in zip(names, ports, strict=True):
                args = [sys.executable, "-m", "neuralgrid.cli", "node", "run", "--gateway", gateway_url]
                args += ["--token", key, "--backend", node_url, "--name", name, "--region", "eu-west"]
                args += ["--price", AGENT_PRICE, "--listen-port", str(port)]
                args += ["--gpu-model", "NVIDIA GeForce RTX 4090", "--vram-gb", "24", "--tflops", "165"]
                # a file, not a pipe: a chatty child must never block
                log = logs.enter_context(tempfile.TemporaryFile("w+"))
                procs.append((subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True), log))
            rows = _online(db_url, names, procs)
            urls = [f"http://127.0.0.1:{port}{CHAT}" for port in ports]
            # Signed as the gateway signs (the agents registered with one of this environment).
            platform = Settings().platform_key(signing.REQUEST_KEYS)
            keys = {
                url: signing.request_key(platform, bytes(rows[name][0]))
                for url, name in zip(urls, names, strict=True)
            }
            yield Agents([p.pid for p, _ in procs], urls, keys, sum(int(row[1]) for row in rows.values()))
        finally:
            for proc, _ in procs:
                proc.terminate()
            for proc, _ in procs:
                proc.wait(timeout=90)  # each drains first


def _online(
    db_url: str, names: list[str], procs: list[tuple[subprocess.Popen[str], IO[str]]]
) -> dict[str, Any]:
    """Each agent's node key and slots, by name, once all are online."""
    online = "select name, secret_hash, max_concurrency from public.nodes where status = 'online'"
    deadline = time.monotonic() + 60 + 5 * len(names)
    with psycopg.connect(db_url, autocommit=True) as conn:
        while len(rows := [r for r in conn.execute(online).fetchall() if r[0] in names]) < len(names):
            dead = [log for proc, log in procs if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                log = (dead or [procs[0][1]])[0]
                log.seek(0)
                raise RuntimeError(f"a node agent did not come online: {log.read()[-2000:]}")
            time.sleep(0.2)
    return {row[0]: row[1:] for row in rows}


def _alternate(
    targets: dict[str, Target], stream: bool, callers: int, per_round: int, warmup_s: float
) -> dict[str, dict[str, Any]]:
    """The same load sent to each target in turn, ROUNDS times, the order reversed every round;
    each target's numbers pooled over its rounds."""
    loads = {name: Load() for name in targets}
    names = list(targets)
    for i in range(ROUNDS):
        for name in names if i % 2 == 0 else names[::-1]:
            t = targets[name]
            body = chat_body(t.model, stream)
            sent = run_fast(
                send_load(
                    t.urls[: math.ceil(callers / DEFAULT_CONCURRENCY)],  # the agents these callers need
                    body,
                    callers,
                    per_round,
                    headers=t.headers,
                    sign_keys=t.keys,
                    warmup=WARMUP,
                    warmup_s=warmup_s,
                    meter=CpuMeter(t.cpu),
                )
            )
            loads[name].add(sent)
    runs: dict[str, dict[str, Any]] = {}
    for name, t in targets.items():
        runs[name] = loads[name].summary()
        if t.slots is not None:
            runs[name]["slots"] = t.slots
        if t.ledger is not None:
            runs[name]["ledger_jobs"] = t.ledger
    return runs
