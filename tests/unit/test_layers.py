"""The gateway's and the server's modules import one another in layers, never in a cycle.

The layers are pyproject.toml's `[tool.importlinter]` contract: core (the gateway's parts, the
server's settings and helpers), the services the app assembles, the FastAPI dependencies (deps), the
routes, the app. Type-only imports (under TYPE_CHECKING) count: a cycle closed by one still ties its
modules together, and comes back at run time the day the import is needed for more than a type.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import grimp
import pytest
from importlinter import configuration
from importlinter.application.use_cases import lint_imports

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
PACKAGES = ("neuralgrid.gateway", "neuralgrid.server")
CONTRACT = "gateway-server-layers"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # No cache: a stale graph would pass what the code no longer keeps to.
    return grimp.build_graph("neuralgrid", exclude_type_checking_imports=False, cache_dir=None)


def _ours(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PACKAGES)


def test_no_module_of_the_gateway_or_the_server_is_in_an_import_cycle(graph: grimp.ImportGraph) -> None:
    """A module is in a cycle when something it imports leads back to it, through any package."""
    cycles = []
    for module in sorted(filter(_ours, graph.modules)):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append(" -> ".join((module, *back)))
                break
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _contract() -> dict[str, Any]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    (contract,) = (c for c in config["contracts"] if c["id"] == CONTRACT)
    return dict(contract)


def test_the_layers_contract_counts_type_only_imports() -> None:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    assert not config.get("exclude_type_checking_imports", False)
    assert _contract()["type"] == "layers"


def test_every_module_of_the_gateway_and_the_server_has_a_layer(graph: grimp.ImportGraph) -> None:
    """A new module is placed in a layer (pyproject.toml's contract), or the contract would not see it."""
    declared = {
        module.strip() for layer in _contract()["layers"] for module in layer.replace("|", ":").split(":")
    }
    children = set().union(*(graph.find_children(package) for package in PACKAGES))
    assert sorted(children - declared) == []
    assert sorted(declared - children) == []  # a layer named after a module that is gone


def test_the_layers_hold(capsys: pytest.CaptureFixture[str]) -> None:
    """core <- services <- deps <- routes <- app (import-linter's report says which import breaks it)."""
    configuration.configure()  # what the lint-imports command does first: its readers, its graph builder
    kept = lint_imports(str(PYPROJECT), limit_to_contracts=(CONTRACT,), cache_dir=None, no_logo=True)
    assert kept, capsys.readouterr().out
