"""`neuralgrid referee`: the referee of model verification, holding the reference GGUFs.

It runs in a Python that has llama-cpp-python (`pip install 'neuralgrid[referee]'`, or any interpreter
that has it: --python), as its own process: scoring is CPU work that must not share the gateway's
event loop. Gateways reach it at NEURALGRID_REFEREE_URL.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from neuralgrid.cli.common import fail

# The package's parent: an interpreter of another environment imports neuralgrid.verify from here
# (the referee needs only the standard library, numpy and llama_cpp).
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def referee(
    models: Annotated[
        list[Path], typer.Option("--model", help="A GGUF file to hold as a reference (repeat for several).")
    ],
    host: Annotated[
        str, typer.Option(help="Where to listen: loopback unless gateways elsewhere need it.")
    ] = ("127.0.0.1"),
    port: Annotated[int, typer.Option(help="Where to listen.")] = 8090,
    python: Annotated[
        str, typer.Option(help="The Python to run it in: one with llama-cpp-python installed.")
    ] = sys.executable,
) -> None:
    """Run the referee that scores challenges against reference GGUFs (NEURALGRID_REFEREE_URL)."""
    for model in models:
        if not model.is_file():
            raise fail(f"no GGUF file at {model}")
    try:
        found = (
            subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, timeout=60).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise fail(f"cannot run {python}: {err}") from None
    if not found:
        raise fail(
            f"{python} has no llama-cpp-python: pip install 'neuralgrid[referee]' there, or name a Python"
            " that has it with --python"
        )
    args = [python, "-m", "neuralgrid.verify.referee", "--host", host, "--port", str(port)]
    for model in models:
        args += ["--model", str(model)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])),
    }
    os.execvpe(python, args, env)
