"""Supabase Edge Functions, tested with Deno against a migrated embedded Postgres (one database per
test file) and against a Supabase-shaped one (where `postgres` is no superuser, as on a project),
lint- and type-checked as the Supabase CLI's functions template does, and the heartbeat body checked
alike by the function and the gateway."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from pydantic import ValidationError

from neuralgrid.db import migrate
from neuralgrid.dev.fakenode import FakeNodeConfig, create_fake_node
from neuralgrid.protocol.nodes import Heartbeat
from neuralgrid.protocol.routes import ROUTES
from neuralgrid.server.app import create_app
from neuralgrid.server.serving import ThreadedServer, free_port
from neuralgrid.server.settings import Settings
from tests.conftest import node_row, running_agent, wait_for
from tests.supabase.shaped import ShapedCluster, shaped_cluster

ROOT = Path(__file__).resolve().parents[2]
DENO = ROOT / "node_modules" / ".bin" / "deno"
FUNCTIONS = ROOT / "supabase" / "functions"
CONFIG = "supabase/functions/deno.json"
TEST_FILES = sorted(str(p.relative_to(ROOT)) for p in FUNCTIONS.rglob("*_test.ts"))


def deno(
    *args: str, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    assert DENO.exists(), "run the README's setup: Deno comes from package.json"
    return subprocess.run(
        [str(DENO), *args],
        cwd=ROOT,
        env={**os.environ, "NO_COLOR": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_function_has_its_tests() -> None:
    functions = sorted(p.parent.name for p in FUNCTIONS.glob("*/index.ts"))
    assert functions == ["heartbeat", "match"]
    tested = {Path(f).parent.name for f in TEST_FILES}
    assert set(functions) | {"_shared"} <= tested


def run_deno_tests(test_file: str, port: int, dbname: str) -> None:
    """The file's Deno tests, connected as `postgres` (as SUPABASE_DB_URL is) over TCP."""
    url = f"postgresql://postgres@127.0.0.1:{port}/{dbname}"
    result = deno(
        "test",
        "--config",
        CONFIG,
        "--allow-env",
        "--allow-net",
        "--allow-read",
        test_file,
        env={"DB_URL": url},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # Every Deno.test in the file ran and passed (none skipped, filtered or left out).
    declared = len(re.findall(r"^Deno\.test\(", (ROOT / test_file).read_text(), flags=re.MULTILINE))
    assert declared > 0
    assert re.search(rf"ok \| {declared} passed \| 0 failed", output), output


@pytest.mark.parametrize("test_file", TEST_FILES)
def test_function(test_file: str, pg_server, db_url: str) -> None:  # type: ignore[no-untyped-def]
    """Each test file on a fresh migrated embedded database (where `postgres` is a superuser)."""
    run_deno_tests(test_file, pg_server.port, str(psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]))


@pytest.fixture(scope="module")
def hosted() -> Iterator[ShapedCluster]:
    """A Supabase-shaped cluster with a database migrated as the non-superuser `postgres`."""
    with shaped_cluster() as cluster:
        _, url = cluster.database("edge_hosted", supautils=True)
        with psycopg.connect(url, autocommit=True) as conn:
            migrate.setup_database(conn)
        yield cluster


@pytest.mark.parametrize("test_file", [f for f in TEST_FILES if not f.endswith("auth_test.ts")])
def test_function_on_a_supabase_shaped_database(test_file: str, hosted: ShapedCluster) -> None:
    """As on a project: the function's `postgres` is no superuser, only a member of the API roles."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(hosted.server.url(), autocommit=True) as conn:
        conn.execute(f"create database {name} template edge_hosted")
    try:
        with psycopg.connect(hosted.server.url(name), autocommit=True) as conn:
            superuser = conn.execute("select rolsuper from pg_roles where rolname = 'postgres'").fetchone()
        assert superuser == (False,)
        run_deno_tests(test_file, hosted.server.port, name)
    finally:
        with psycopg.connect(hosted.server.url(), autocommit=True) as conn:
            conn.execute(f"drop database {name} with (force)")


def test_functions_are_lint_clean() -> None:
    """`deno lint` as the Supabase CLI's functions template runs it (dependencies in deno.json)."""
    result = deno("lint", "--config", CONFIG, "supabase/functions/", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_functions_type_check() -> None:
    result = deno("check", "--config", CONFIG, "supabase/functions/", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# The heartbeat body: the function checks it as the gateway does -----------------------------------

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SPECS = {"gpu_model": "NVIDIA L4", "gpu_count": 1, "vram_gb": 24, "tflops": 121}
BODIES: list[Any] = [
    {},
    {"status": "draining", "queue_depth": 2, "models": [MODEL, MODEL]},
    {"status": "offline", "gpu_utilization": 0, "free_vram_gb": 0},
    {"gpu_utilization": None, "free_vram_gb": None, "specs": None, "backend": None, "available": None},
    {"models": [MODEL], "specs": SPECS, "backend_up": False},
    {"backend": {"kind": "vllm", "version": None, "parallel": 4, "routes": ["embeddings", "embeddings"]}},
    {"backend": {"kind": "llama.cpp", "usage_in_streams": True, "continues": True, "tokenize": True}},
    {
        "available": [MODEL, "a" * 256],
        "loaded": [MODEL],
        "refused": [{"model": MODEL, "reason": "one model"}],
    },
    {"queue_depth": 1_000_000, "gpu_utilization": 1, "free_vram_gb": 100_000},
    {"specs": {**SPECS, "gpu_count": 64, "vram_gb": 8192, "tflops": 100_000}},
    {"specs": {**SPECS, "max_concurrency": 1024}},
    {"specs": {**SPECS, "max_concurrency": None}},
    {"models": ["é" * 256]},  # 256 characters, 512 bytes
    # Refused by both:
    [],
    None,
    "online",
    {"nope": 1},
    {"status": "busy"},
    {"status": None},
    {"queue_depth": -1},
    {"queue_depth": 1_000_001},
    {"queue_depth": 1.5},
    {"queue_depth": None},
    {"gpu_utilization": 1.01},
    {"free_vram_gb": -0.1},
    {"models": None},
    {"models": [""]},
    {"models": ["a" * 257]},
    {"models": ["é" * 257]},
    {"models": ["tab\there"]},
    {"models": ["del\x7f"]},
    {"models": [f"m{i}" for i in range(1001)]},
    {"specs": {**SPECS, "extra": 1}},
    {"specs": {**SPECS, "gpu_count": 0}},
    {"specs": {**SPECS, "gpu_count": 65}},
    {"specs": {**SPECS, "vram_gb": 0}},
    {"specs": {**SPECS, "vram_gb": 8192.5}},
    {"specs": {**SPECS, "tflops": 100_001}},
    {"specs": {"gpu_model": "L4", "gpu_count": 1, "vram_gb": 24}},
    {"specs": {**SPECS, "gpu_model": ""}},
    {"specs": {**SPECS, "max_concurrency": 0}},
    {"specs": {**SPECS, "max_concurrency": 1025}},
    {"specs": {**SPECS, "max_concurrency": 2.5}},
    {"specs": {"max_concurrency": 8}},
    {"backend_up": None},
    {"backend": {}},
    {"backend": {"kind": ""}},
    {"backend": {"kind": "k" * 33}},
    {"backend": {"kind": "vllm", "parallel": 0}},
    {"backend": {"kind": "vllm", "parallel": 1025}},
    {"backend": {"kind": "vllm", "routes": []}},
    {"backend": {"kind": "vllm", "routes": ["v1/chat/completions"]}},
    {"backend": {"kind": "vllm", "routes": ["chat/completions"] * 33}},
    {"backend": {"kind": "vllm", "tokenize": None}},
    {"backend": {"kind": "vllm", "other": 1}},
    {"available": [""]},
    {"loaded": [MODEL] * 17},
    {"loaded": None},
    {"refused": [{"model": MODEL}]},
    {"refused": [{"model": MODEL, "reason": ""}]},
    {"refused": [{"model": MODEL, "reason": "r" * 201}]},
    {"refused": [{"model": MODEL, "reason": "why", "more": 1}]},
    {"refused": [{"model": MODEL, "reason": "why"}] * 17},
]


def gateway_reads(body: Any) -> Any:
    """The gateway's reading of a body: what it stores, with its defaults; None when refused."""
    if not isinstance(body, dict):
        return None  # the gateway refuses anything but an object before pydantic sees it
    try:
        return Heartbeat.model_validate(body).model_dump(mode="json")
    except ValidationError:
        return None


def test_the_function_reads_heartbeats_as_the_gateway_does(tmp_path: Path) -> None:
    bodies = tmp_path / "bodies.json"
    bodies.write_text(json.dumps(BODIES))
    script = tmp_path / "read.ts"
    body_ts = (FUNCTIONS / "heartbeat" / "body.ts").as_uri()
    script.write_text(
        f'import {{ HEARTBEAT_FIELDS, parseHeartbeat, ROUTES }} from "{body_ts}";\n'
        f"const bodies = JSON.parse(Deno.readTextFileSync({json.dumps(str(bodies))}));\n"
        "const read = bodies.map((b: unknown) => { try { return parseHeartbeat(b); } catch { return null; } });\n"
        "console.log(JSON.stringify({ routes: ROUTES, fields: HEARTBEAT_FIELDS, read }));\n"
    )
    result = deno("run", "--config", CONFIG, "--allow-read", str(script), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    answer = json.loads(result.stdout)
    assert answer["routes"] == list(ROUTES)
    assert answer["fields"] == list(Heartbeat.model_fields)
    for body, read in zip(BODIES, answer["read"], strict=True):
        assert read == gateway_reads(body), json.dumps(body)[:200]
    assert sum(r is not None for r in answer["read"]) == 13, "the first thirteen bodies are valid"


# A node agent that heartbeats through the function ------------------------------------------------


def test_an_agent_stays_alive_through_the_heartbeat_function_alone(
    conn: psycopg.Connection, db_url: str, pg_server: Any, operator_key: str
) -> None:
    """Registered with a gateway that then goes away, a direct-mode agent given --heartbeat-url keeps
    its node alive through the function (served by Deno on loopback, as Supabase runs it), and its
    drain reaches the platform the same way."""
    conn.execute("update platform_settings set heartbeat_interval_s = 0.3")
    dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    port = free_port()
    function = subprocess.Popen(
        [
            str(DENO),
            "run",
            "--config",
            CONFIG,
            "--allow-env",
            "--allow-net",
            "supabase/functions/heartbeat/index.ts",
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "NO_COLOR": "1",
            "PORT": str(port),
            "SUPABASE_DB_URL": f"postgresql://postgres@127.0.0.1:{pg_server.port}/{dbname}",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    function_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(function_url), timeout=30)
        with (
            ThreadedServer(create_fake_node(FakeNodeConfig(models=(MODEL,)))) as backend,
            contextlib.ExitStack() as gateway_up,
        ):
            gateway = gateway_up.enter_context(
                ThreadedServer(create_app(Settings(NEURALGRID_FIRST_BYTE_TIMEOUT_S=5), db_url, sweep=False))
            )
            extra = ("--heartbeat-url", function_url)
            with running_agent(conn, gateway.url, operator_key, backend.url, "edge-box", 24, *extra) as agent:
                gateway_up.close()  # from now on, only the function hears from the node
                before = node_row(conn, "edge-box")[4]
                wait_for(lambda: node_row(conn, "edge-box")[4] > before, timeout=5)
                assert node_row(conn, "edge-box")[1] == "online"
                agent.terminate()
                agent.communicate(timeout=30)
            assert node_row(conn, "edge-box")[1] == "offline"  # its drain's last heartbeat
    finally:
        function.terminate()
        function.communicate(timeout=10)


def _answers(url: str) -> bool:
    try:
        return httpx.post(url, json={}).status_code == 404  # no node id in the path: it is up
    except httpx.HTTPError:
        return False
