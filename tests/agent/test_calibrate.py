"""`neuralgrid bench calibrate` against the real llama.cpp server (tests/agent/servers.py): the JSON the
simulator's batching model reads, the built server it can start itself, and its one-line errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from neuralgrid.bench.calibrate import BUILT_MODEL
from neuralgrid.cli import app
from tests.agent.servers import RealServer, built, real_server
from tests.conftest import free_port

SMALL = ("--prompt-tokens", "64", "--output-tokens", "8", "--rounds", "2")


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["bench", "calibrate", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def llama_server(tmp_path: Path) -> Iterator[RealServer]:
    server = real_server("llama.cpp", free_port(), tmp_path / "llama-server.log", parallel=2).start()
    try:
        yield server
    finally:
        server.kill()


def check_shape(result: dict[str, Any], parallel: list[int]) -> None:
    assert result.keys() == {
        "measured_on",
        "server",
        "model",
        "parallel",
        "per_stream_rel",
        "aggregate_rel",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "raw",
    }
    assert result["parallel"] == parallel
    assert len(result["per_stream_rel"]) == len(result["aggregate_rel"]) == len(parallel)
    assert result["per_stream_rel"][0] == result["aggregate_rel"][0] == 1.0
    assert all(rel > 0 for rel in result["per_stream_rel"] + result["aggregate_rel"])
    assert result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert "llama.cpp" in result["measured_on"] and "cores" in result["measured_on"]
    levels = result["raw"]["by_parallel"]
    assert [level["parallel"] for level in levels] == parallel
    for level in levels:
        assert level["aggregate_tokens_per_s"] > 0 and level["per_stream_tokens_per_s"] > 0
        assert level["streams"] == level["parallel"] * result["raw"]["rounds"]
        assert level["completion_tokens"] == result["raw"]["output_tokens"]  # ignore_eos held
        # llama.cpp's own count of its decode speed agrees with the one timed from the stream
        assert level["server_reported_tokens_per_s"] == pytest.approx(
            level["per_stream_tokens_per_s"], rel=0.5
        )


def test_calibrate_measures_a_real_llama_server(llama_server: RealServer, tmp_path: Path) -> None:
    out_file = tmp_path / "batching.json"
    code, out, err = run("--url", llama_server.url, "--parallel", "2", *SMALL, "--out", str(out_file))
    assert code == 0, err
    result = json.loads(out_file.read_text())
    check_shape(result, [1, 2])  # p=1, the baseline, is always measured
    assert result["model"] == llama_server.served
    assert result["server"] == {
        "kind": "llama.cpp",
        "version": result["server"]["version"],
        "slots": 2,
        "context_per_slot": 2048,  # servers.py's -c 4096 split between -np 2
    }
    assert abs(result["raw"]["prompt_tokens"] - 64) <= 8  # sized from the server's own count
    assert "aggregate tok/s" in out and f"wrote {out_file}" in out

    # More requests at once than the server has slots would measure its queue, not its batching.
    code, _, err = run("--url", llama_server.url, "--parallel", "1,4", *SMALL, "--out", str(out_file))
    assert code == 1 and "more than the server's 2 slots" in err and err.count("\n") == 1
    code, _, err = run("--url", llama_server.url, "--prompt-tokens", "3000", "--parallel", "2")
    assert code == 1 and "context per slot is 2048 tokens" in err and err.count("\n") == 1


def test_calibrate_serves_the_built_llama_server_itself(tmp_path: Path) -> None:
    built()  # skip (fail under CI) without the build
    out_file = tmp_path / "batching.json"
    code, _, err = run("--serve-built", "--parallel", "1", *SMALL, "--out", str(out_file))
    assert code == 0, err
    result = json.loads(out_file.read_text())
    check_shape(result, [1])
    assert result["model"] == BUILT_MODEL and result["server"]["slots"] == 1
    assert result["raw"]["by_parallel"][0]["server_cpu_cores"] > 0


def test_calibrate_bad_input_gets_one_line_and_a_nonzero_exit() -> None:
    unused = f"http://127.0.0.1:{free_port()}"
    for args, message in [
        (["--url", unused, "--parallel", "0,x"], "--parallel takes comma-separated integers"),
        (["--url", unused, "--parallel", "0,2"], "--parallel: every value must be positive"),
        ([], "give --url or --serve-built"),
        (["--url", unused, "--serve-built"], "give --url or --serve-built"),
        (["--url", unused], f"cannot reach {unused}"),
    ]:
        code, _, err = run(*args)
        assert code == 1 and err.startswith("error:") and message in err and err.count("\n") == 1, err
