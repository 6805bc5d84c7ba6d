"""Cross-checks against real servers: a gateway with no referee checks the nodes that claim SmolLM2
against each other. Two honest llama-servers of the pinned GGUF agree and pass; a llama-server
of the same model with layers pruned (llama-quantize) disagrees with both where their answers part
(its token far down their lists of candidates), fails, and gets no more traffic. The fake node's
canned answers come without the log-probabilities asked for: they cannot be compared, and fail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.agent.servers import SMOLLM2, built
from tests.agent.test_backends import make_server
from tests.agent.test_verification import World, a_world, llama_server
from tests.conftest import wait_for


@pytest.fixture(scope="module")
def world(pg_server: Any, template_db: str, tmp_path_factory: Any) -> Iterator[World]:
    tmp: Path = tmp_path_factory.mktemp("cross-checks")
    root = built()
    servers = {
        "honest-a": lambda: llama_server(tmp, root / "model.gguf"),
        "honest-b": lambda: llama_server(tmp, root / "model.gguf"),
        "pruned": lambda: llama_server(tmp, root / "model-pruned.gguf"),
        "canned": lambda: make_server("fake", tmp),
    }
    with a_world(pg_server, template_db, tmp, servers, referee=False, NEURALGRID_CROSS_CHECKS=True) as made:
        yield made


def test_nodes_serving_the_same_artifact_are_checked_against_each_other(world: World) -> None:
    def checks() -> dict[str, tuple[str, int, int]]:
        rows = world.conn.execute(
            "select n.name, c.state, c.challenges, c.failures from model_checks c join nodes n on n.id = c.node_id"
        ).fetchall()
        return {name: (state, taken, failed) for name, state, taken, failed in rows}

    def settled() -> bool:
        now = checks()
        honest = [now[name] for name in ("honest-a", "honest-b")]
        cheats = [now[name][0] for name in ("pruned", "canned")]
        return cheats == ["failed", "failed"] and all(taken >= 2 for _, taken, _ in honest)

    try:
        wait_for(settled, 300)
    except AssertionError:
        raise AssertionError(f"checks: {checks()}") from None
    for name in ("honest-a", "honest-b"):  # never the odd one out, and on their way to verified
        state, _, failed = checks()[name]
        assert failed == 0 and state in ("unverified", "verified"), (name, checks()[name])
    reasons = world.conn.execute(
        "select n.name, ch.detail from model_challenges ch join nodes n on n.id = ch.node_id where not ch.passed"
    ).fetchall()
    assert {name for name, _ in reasons} == {"pruned", "canned"}
    why = {name: {detail["reason"] for n, detail in reasons if n == name} for name in ("pruned", "canned")}
    assert all(detail["cross_check"] for _, detail in reasons)
    # The pruned model's tokens where it parts are far down both honest nodes' lists; the fake node
    # sends no log-probabilities, and cannot be compared.
    assert all("parts from two" in reason for reason in why["pruned"]), why
    assert all("without the log-probabilities asked for" in reason for reason in why["canned"]), why
    sdk = openai.OpenAI(base_url=f"{world.gateway}/v1", api_key=world.key, max_retries=3, timeout=60)
    ask: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]
    served = set()
    for _ in range(6):
        raw = sdk.chat.completions.with_raw_response.create(model=SMOLLM2, messages=ask, max_tokens=4)
        served.add(raw.headers["x-neuralgrid-node"])
    assert served <= {str(world.nodes["honest-a"]), str(world.nodes["honest-b"])}
