"""`neuralgrid bench verify`: model verification against real honest and cheating servers.

Real processes: the referee (in llama-cpp-python's venv, as scripts/backends.sh builds it), the
gateway (`neuralgrid up` on a scratch database, with the referee, challenges due every CHALLENGE_S
in every state) and node agents (`neuralgrid node run`) in front of real servers of SmolLM2, the
model the catalog pins to the GGUF they were built from:

- honest: llama-server with four slots and llama-cpp-python's server, each under a steady load of
  ordinary requests (prompt cache on) while they are challenged;
- cheats: llama-server with layers pruned and with the model requantized (llama-quantize), with a
  quantized KV cache, with its context cut to 256 tokens; llama-server behind a proxy that samples at
  temperature 0.8 whatever the request says; the fake node's canned answers.

Nothing is judged here: the gateway's verifier challenges, the referee scores, SQL's sequential test
decides. The bench reads what SQL concluded (model_checks, model_challenges, earnings) and the
referee's CPU per challenge from the gateway's /metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psycopg

from neuralgrid.bench import scratch_database, served
from neuralgrid.bench.calibrate import BUILT_MODEL, built_root
from neuralgrid.server.serving import free_port
from neuralgrid.verify import challenge

SCRATCH_DB = "neuralgrid_bench_verify"
CHALLENGE_S = 0.2  # the mean wait between a node's challenges, every state: the bench's hour is a minute
REPO = Path(__file__).resolve().parents[2]
# The honest servers' ordinary traffic: what a node serves between challenges (prompt cache on).
LOAD_EVERY_S = 1.0
LOAD_PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?", "Name three rivers in Europe."]
GROSS = ("pruned", "sampling at 0.8", "canned")  # the gross cheats: flagged within 3 challenges
SUBTLE = ("requantized",)  # within 20


def _llama_server(root: Path, port: int, model: str = "model.gguf", *extra: str) -> list[str]:
    return [
        str(root / "bin" / "llama-server"),
        "-m",
        str(root / model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        "1",
        *extra,
    ]


# Each node: how its server is started (given the build and a port), and whether it is honest.
SERVERS: dict[str, tuple[Callable[[Path, int], list[str]], bool]] = {
    "honest llama-server": (
        lambda root, port: _llama_server(root, port, "model.gguf", "-np", "4", "-c", "8192"),
        True,
    ),
    "honest llama-cpp-python": (
        lambda root, port: [
            str(root / "venv" / "bin" / "python"),
            "-m",
            "llama_cpp.server",
            "--model",
            str(root / "model.gguf"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "4096",
            "--n_threads",
            "1",
        ],
        True,
    ),
    "pruned": (
        lambda root, port: _llama_server(root, port, "model-pruned.gguf", "-np", "2", "-c", "4096"),
        False,
    ),
    "requantized": (
        lambda root, port: _llama_server(root, port, "model-requant.gguf", "-np", "2", "-c", "4096"),
        False,
    ),
    "KV cache q4_0": (
        lambda root, port: _llama_server(
            root, port, "model.gguf", "-np", "2", "-c", "4096", "-fa", "on", "-ctk", "q4_0", "-ctv", "q4_0"
        ),
        False,
    ),
    "context 256": (
        lambda root, port: _llama_server(root, port, "model.gguf", "-np", "1", "-c", "256"),
        False,
    ),
    "sampling at 0.8": (
        lambda root, port: _llama_server(root, port, "model.gguf", "-np", "2", "-c", "4096"),
        False,
    ),
    "canned": (
        lambda root, port: [sys.executable, "-m", "neuralgrid.cli", "fake-node", "--port", str(port)],
        False,
    ),
}


class _Resampling(BaseHTTPRequestHandler):
    """A proxy that sets every request's temperature to its own (a cheat that saves nothing, but
    answers as it likes) and passes everything else on."""

    upstream = ""
    temperature = 0.8

    def do_GET(self) -> None:
        self._relay(None)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if isinstance(body, dict) and "messages" in body:
            body["temperature"] = self.temperature
        self._relay(json.dumps(body).encode())

    def _relay(self, body: bytes | None) -> None:
        method = "GET" if body is None else "POST"
        resp = httpx.request(
            method,
            self.upstream + self.path,
            content=body,
            timeout=300,
            headers={"content-type": "application/json"},
        )
        self.send_response(resp.status_code)
        self.send_header("Content-Type", resp.headers.get("content-type", "application/json"))
        self.send_header("Content-Length", str(len(resp.content)))
        self.end_headers()
        self.wfile.write(resp.content)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _load(url: str, model: str, stop: threading.Event, tokens: list[int]) -> None:
    """Ordinary requests, one every LOAD_EVERY_S, until stopped; counts the completion tokens served.
    Steady, not saturating: on two cores a saturated server would starve the referee."""
    i = 0
    while not stop.wait(LOAD_EVERY_S):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": LOAD_PROMPTS[i % len(LOAD_PROMPTS)]}],
            "max_tokens": 48,
        }
        i += 1
        try:
            answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
            tokens.append(int(answer["usage"]["completion_tokens"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            time.sleep(0.5)


def run(
    admin_url: str,
    honest_challenges: int,
    cheat_challenges: int,
    minutes: float | None = None,
    progress: Callable[[str], None] = lambda _: None,
    cross_checks: bool = False,
) -> dict[str, Any]:
    root = built_root()
    if not (root / "READY").exists():
        raise RuntimeError(f"no real servers in {root}: scripts/backends.sh builds them")
    with scratch_database(admin_url, SCRATCH_DB) as url, ExitStack() as stack:
        logs = Path(stack.enter_context(_tempdir()))
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "update platform_settings set challenge_unverified_s = %s, challenge_suspect_s = %s,"
                " challenge_verified_s = %s",
                (CHALLENGE_S,) * 3,
            )
            key = str((conn.execute("select api_key from create_api_key('bench')").fetchone() or [""])[0])
        referee_port, gateway_port = free_port(), free_port()
        referee = f"http://127.0.0.1:{referee_port}"
        gateway = f"http://127.0.0.1:{gateway_port}"
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "NEURALGRID_PORT": str(gateway_port),
            "NEURALGRID_CHALLENGES_IN_FLIGHT": "4",
            "NEURALGRID_CROSS_CHECKS": "true",  # with a referee, only for what it does not hold: nothing here
        }
        if not cross_checks:
            env["NEURALGRID_REFEREE_URL"] = referee
            stack.enter_context(
                served(
                    [
                        str(root / "venv" / "bin" / "python"),
                        "-m",
                        "neuralgrid.verify.referee",
                        "--threads",  # llama.cpp's threads spin: two on two busy cores slow everything
                        "1",
                        "--port",
                        str(referee_port),
                        "--model",
                        str(root / "model.gguf"),
                    ],
                    {**os.environ, "PYTHONPATH": str(REPO)},
                    f"{referee}/v1/artifacts",
                )
            )
        cli = [sys.executable, "-m", "neuralgrid.cli"]
        stack.enter_context(served([*cli, "up"], env, f"{gateway}/readyz"))
        stop = threading.Event()
        honest_backend = honest_name = ""
        loads: dict[str, list[int]] = {}
        threads: list[threading.Thread] = []
        started = time.monotonic()
        for name, (command, honest) in SERVERS.items():
            port = free_port()
            backend = f"http://127.0.0.1:{port}"
            stack.enter_context(served(command(root, port), dict(os.environ), f"{backend}/v1/models"))
            if name == "sampling at 0.8":
                handler = type("Resampling", (_Resampling,), {"upstream": backend})
                proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
                threading.Thread(target=proxy.serve_forever, daemon=True).start()
                stack.callback(proxy.shutdown)
                backend = f"http://127.0.0.1:{proxy.server_address[1]}"
            served_name = httpx.get(f"{backend}/v1/models", timeout=10).json()["data"][0]["id"]
            stack.enter_context(_agent(cli, env, gateway, key, backend, name, served_name, logs))
            if name == "honest llama-server":
                honest_backend, honest_name = backend, served_name
            if honest:
                loads[name] = []
                thread = threading.Thread(
                    target=_load, args=(backend, served_name, stop, loads[name]), daemon=True
                )
                thread.start()
                threads.append(thread)
            progress(f"node up: {name}")
        stack.callback(stop.set)
        with psycopg.connect(url, autocommit=True) as conn:
            deadline = None if minutes is None else time.monotonic() + minutes * 60
            results = _watch(conn, honest_challenges, cheat_challenges, deadline, progress)
            loaded_s = time.monotonic() - started
            conn.execute("update model_checks set next_challenge_at = 'infinity'")  # quiet, for capacity
            stop.set()
            earnings = _earnings(conn)
            challenge_tokens = _challenge_tokens(conn)
            honest_failures = _honest_failures(conn)
        metrics = httpx.get(f"{gateway}/metrics", timeout=10).text
        progress("the honest llama-server's capacity, saturated")
        capacity = _capacity(honest_backend, honest_name)
    cost = _cost(loads, loaded_s, challenge_tokens, capacity)
    for row in results:
        row.update(earnings.get(row["node"], {}))
    return {
        "nodes": results,
        "cost": cost,
        "referee_cpu_s": _referee_cpu(metrics),
        "honest_failures": honest_failures,
    }


@contextmanager
def _tempdir() -> Iterator[str]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-verify-") as folder:
        yield folder


@contextmanager
def _agent(
    cli: list[str],
    env: dict[str, str],
    gateway: str,
    key: str,
    backend: str,
    name: str,
    served_name: str,
    logs: Path,
) -> Iterator[None]:
    args = [
        *cli,
        "node",
        "run",
        "--gateway",
        gateway,
        "--token",
        key,
        "--backend",
        backend,
        "--name",
        name,
        "--region",
        "eu-west",
        "--price",
        "0.3",
        "--listen-port",
        str(free_port()),
        "--gpu-model",
        "NVIDIA GeForce RTX 4090",
        "--vram-gb",
        "24",
        "--tflops",
        "165",
    ]
    if served_name != BUILT_MODEL:
        args += ["--model-alias", f"{served_name}={BUILT_MODEL}"]
    with (logs / f"agent-{free_port()}.log").open("ab") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


STATE = """
select n.name, c.state, c.challenges, c.failures, f.least, f.most
from public.model_checks c join public.nodes n on n.id = c.node_id
cross join lateral (select min(e.distance) as least, max(e.distance) as most from public.model_challenges e
                    where e.node_id = c.node_id and not e.passed) f
"""


def _watch(
    conn: psycopg.Connection[Any],
    honest_target: int,
    cheat_cap: int,
    deadline: float | None,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Until the honest nodes have taken `honest_target` challenges between them and every cheat has
    failed or taken `cheat_cap`, or the deadline (time.monotonic()) comes; a cheat at its cap is
    challenged no more."""
    last = 0.0
    while True:
        rows = conn.execute(STATE).fetchall()
        done_cheats = all(r[1] == "failed" or r[2] >= cheat_cap for r in rows if not SERVERS[r[0]][1])
        honest_taken = sum(r[2] for r in rows if SERVERS[r[0]][1])
        for r in rows:
            if not SERVERS[r[0]][1] and r[1] != "failed" and r[2] >= cheat_cap:
                conn.execute(
                    "update model_checks c set next_challenge_at = 'infinity' from nodes n"
                    " where n.id = c.node_id and n.name = %s",
                    (r[0],),
                )
        if time.monotonic() - last > 30:
            last = time.monotonic()
            progress(
                f"honest challenges {honest_taken}/{honest_target}; "
                + ", ".join(f"{r[0]}: {r[1]} {r[3]}/{r[2]}" for r in rows if not SERVERS[r[0]][1])
            )
        if (done_cheats and honest_taken >= honest_target) or (
            deadline is not None and time.monotonic() > deadline
        ):
            break
        time.sleep(1)
    return [
        {
            "node": name,
            "honest": SERVERS[name][1],
            "state": state,
            "challenges": challenges,
            "failed": failures,
            "failed_share": round(failures / challenges, 3) if challenges else None,
            "flagged_after": challenges if state == "failed" else None,
            "distance_of_failures": None if lo is None else [round(lo, 2), round(hi, 2)],
        }
        for name, state, challenges, failures, lo, hi in sorted(rows)
    ]


def _honest_failures(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """What each challenge an honest node failed kept as evidence (what was asked, the answer, each
    token's gap): the cases to score again when honest nodes fail."""
    honest = [name for name, (_, is_honest) in SERVERS.items() if is_honest]
    rows = conn.execute(
        "select n.name, c.detail from public.model_challenges c join public.nodes n on n.id = c.node_id"
        " where not c.passed and n.name = any(%s) order by c.at",
        (honest,),
    ).fetchall()
    return [{"node": name, **detail} for name, detail in rows]


def _earnings(conn: psycopg.Connection[Any]) -> dict[str, dict[str, Any]]:
    rows = conn.execute(
        "select n.name, count(*) filter (where e.forfeited_at is null),"
        " count(*) filter (where e.forfeited_at is not null),"
        " coalesce(sum(e.net_usd) filter (where e.forfeited_at is not null), 0)"
        " from public.earnings e join public.nodes n on n.id = e.node_id group by n.name"
    ).fetchall()
    return {
        name: {"paid_jobs": kept, "forfeited_jobs": lost, "forfeited_usd": float(usd)}
        for name, kept, lost, usd in rows
    }


def _challenge_tokens(conn: psycopg.Connection[Any]) -> tuple[float, float]:
    """Prompt and completion tokens a challenge cost its node, on average, as the ledger has them."""
    row = conn.execute(
        "select avg(j.prompt_tokens), avg(j.completion_tokens) from public.jobs j"
        " where j.api_key_id = private.challenge_key_id() and j.status = 'succeeded'"
    ).fetchone()
    return (float(row[0] or 0), float(row[1] or 0)) if row else (0.0, 0.0)


CAPACITY_S = 20.0  # how long each saturating burst runs
CAPACITY_SLOTS = 4  # the honest llama-server's -np


def _capacity(backend: str, model: str) -> dict[str, float]:
    """The honest llama-server's capacity, saturated (every slot busy, nothing else asking): the
    completion tokens it generates per second (answers of up to 64 tokens to short prompts) and the
    prompt tokens it reads per second (long prompts, one token answered, its prompt cache off)."""
    long_prompt = " ".join(LOAD_PROMPTS) * 40  # some 800 tokens, a long challenge's length
    asks = {
        "completion": {"messages": [{"role": "user", "content": LOAD_PROMPTS[0]}], "max_tokens": 64},
        "prompt": {
            "messages": [{"role": "user", "content": long_prompt}],
            "max_tokens": 1,
            "cache_prompt": False,
        },
    }
    out = {}
    for kind, body in asks.items():
        counted: list[int] = []
        end = time.monotonic() + CAPACITY_S

        def ask(
            body: dict[str, Any] = body, counted: list[int] = counted, kind: str = kind, end: float = end
        ) -> None:
            with httpx.Client(timeout=120) as http:
                while time.monotonic() < end:
                    answer = http.post(backend + "/v1/chat/completions", json={"model": model, **body}).json()
                    counted.append(int(answer["usage"][f"{kind}_tokens"]))

        started = time.monotonic()
        workers = [threading.Thread(target=ask) for _ in range(CAPACITY_SLOTS)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        out[f"{kind}_tokens_per_s"] = round(sum(counted) / (time.monotonic() - started), 2)
    return out


def _cost(
    loads: dict[str, list[int]],
    seconds: float,
    per_challenge: tuple[float, float],
    capacity: dict[str, float],
) -> dict[str, Any]:
    """A verified node's challenges as a share of its capacity: at the default mean of one challenge
    per platform_settings.challenge_verified_s (600 s), the share of the honest llama-server's time
    their prompts and answers take at its saturated rates (_capacity()); and, as before, their tokens
    against what it served under the bench's light load (a floor on its capacity)."""
    prompt, completion = per_challenge
    served_per_s = sum(loads.get("honest llama-server", [])) / seconds if seconds else 0.0
    verified_s, unverified_s = 600.0, 30.0
    busy = prompt / capacity["prompt_tokens_per_s"] + completion / capacity["completion_tokens_per_s"]
    return {
        "tokens_per_challenge": round(prompt + completion, 1),
        "prompt_tokens_per_challenge": round(prompt, 1),
        "completion_tokens_per_challenge": round(completion, 1),
        "capacity": capacity,
        "node_seconds_per_challenge": round(busy, 3),
        "capacity_share_verified": round(busy / verified_s, 5),
        "capacity_share_unverified": round(busy / unverified_s, 5),
        "node_tokens_per_s_served": round(served_per_s, 2),
        "share_verified": round((prompt + completion) / verified_s / served_per_s, 5)
        if served_per_s
        else None,
        "share_unverified": round((prompt + completion) / unverified_s / served_per_s, 5)
        if served_per_s
        else None,
        "long_share": 1 / challenge.LONG_SHARE,
    }


def _referee_cpu(metrics: str) -> dict[str, float] | None:
    """The referee's CPU per scored challenge, from the gateway's histogram of it."""
    found = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name in ("neuralgrid_referee_cpu_seconds_sum", "neuralgrid_referee_cpu_seconds_count"):
            found[name.rsplit("_", 1)[1]] = float(value)
    if not found.get("count"):
        return None
    return {"mean_s": round(found["sum"] / found["count"], 3), "challenges": found["count"]}
