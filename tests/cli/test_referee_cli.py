"""`neuralgrid referee`: a bad file or a Python without llama-cpp-python is one line and a non-zero
exit; with llama-cpp-python's venv (scripts/backends.sh builds one) it serves the GGUF it was given,
by its sha256."""

from __future__ import annotations

import hashlib
import subprocess
import time
from pathlib import Path

import httpx

from tests.agent.servers import built
from tests.conftest import free_port

NEURALGRID = str(Path(".venv/bin/neuralgrid").resolve())


def test_a_missing_file_or_a_python_without_llama_cpp_is_one_line_and_an_exit(tmp_path: Path) -> None:
    missing = subprocess.run(
        [NEURALGRID, "referee", "--model", str(tmp_path / "x.gguf")], capture_output=True, text=True
    )
    assert missing.returncode == 1 and missing.stderr.strip().endswith("x.gguf")
    assert missing.stderr.count("\n") == 1 and "no GGUF file at" in missing.stderr
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    without = subprocess.run([NEURALGRID, "referee", "--model", str(model)], capture_output=True, text=True)
    assert without.returncode == 1 and "has no llama-cpp-python" in without.stderr
    assert without.stderr.count("\n") == 1


def test_the_referee_serves_its_gguf_by_sha256(tmp_path: Path) -> None:
    root = built()
    port = free_port()
    args = [NEURALGRID, "referee", "--model", str(root / "model.gguf"), "--port", str(port)]
    log = tmp_path / "referee.log"
    with log.open("wb") as out:
        process = subprocess.Popen([*args, "--python", str(root / "venv" / "bin" / "python")], stderr=out)
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the referee did not start"
            time.sleep(0.2)
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/artifacts", timeout=10).json()["artifacts"]
        with (root / "model.gguf").open("rb") as gguf:
            sha256 = hashlib.file_digest(gguf, "sha256").hexdigest()
        assert [a["sha256"] for a in listed] == [sha256]
    finally:
        process.kill()
        process.wait(timeout=10)
