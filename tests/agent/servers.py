"""Real inference servers for the tests: llama.cpp's `llama-server` and llama-cpp-python's OpenAI
server, both serving SmolLM2-135M-Instruct, as scripts/backends.sh built them (`./dev test` runs it).

Each runs in its own process on a free loopback port and is killed when its test ends. Without the
build, these tests are skipped with a line saying how to build; under CI they fail instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from neuralgrid.bench.calibrate import built_root

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its catalog id
KINDS = ("llama.cpp", "llama-cpp-python")


def built() -> Path:
    """The build's folder, or skip (fail under CI) saying how to make it."""
    root = built_root()
    if not (root / "READY").exists():
        message = f"no real inference servers in {root}: `./dev test` (scripts/backends.sh) builds them"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return root


@dataclass
class RealServer:
    kind: str
    port: int
    args: list[str]
    process: subprocess.Popen[bytes] | None = None
    served: str = ""  # the model's name as the server reports it
    log: Path = field(default_factory=Path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> RealServer:
        """Start it (again, on the same port) and wait until its model answers /v1/models."""
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited: {self.log.read_text()[-2000:]}")
            try:
                models = httpx.get(f"{self.url}/v1/models", timeout=2)
                if models.status_code == 200:
                    self.served = models.json()["data"][0]["id"]
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.kind} did not start in {timeout} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """Dead at once, as a crash would leave it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)


def real_server(
    kind: str, port: int, log: Path, *, parallel: int = 2, alias: str | None = None
) -> RealServer:
    """A real server of `kind`, not yet started. `parallel`: llama-server's slots (llama-cpp-python
    has one); `alias`: the model's name on the server (else its file path)."""
    root = built()
    model = str(root / "model.gguf")
    # One thread: llama.cpp's threads spin while they wait for each other, and the suite runs a
    # gateway, an agent and the test beside the server on two cores. With two, a test streaming 800
    # tokens took 29 s beside a pip install; with one, 16.
    if kind == "llama.cpp":
        args = [str(root / "bin" / "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(port)]
        args += ["-c", str(2048 * parallel), "-np", str(parallel), "--threads", "1"]
        args += ["--alias", alias] if alias else []
    elif kind == "llama-cpp-python":
        args = [str(root / "venv" / "bin" / "python"), "-m", "llama_cpp.server", "--model", model]
        args += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "1"]
        args += ["--model_alias", alias] if alias else []
    else:
        raise ValueError(kind)
    return RealServer(kind, port, args, log=log)
