"""Schemathesis against the gateway's own OpenAPI document, over real HTTP: whatever it sends, the
answer is never a 500, and every error is OpenAI-shaped JSON.

NEURALGRID_FUZZ_EXAMPLES sets the examples per operation (17 operations): 40 in the suite (tests/fuzzing.py), 7,000 for
the 57,000-case run in docs/benchmarks.md. NEURALGRID_FUZZ_REPORT names a JSON file that gets the
cases sent and the statuses answered, per operation.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.fuzzing import EXAMPLES

ANSWERS: defaultdict[str, Counter[int]] = defaultdict(Counter)  # operation -> status -> cases


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    if path := os.environ.get("NEURALGRID_FUZZ_REPORT"):
        total = sum(sum(statuses.values()) for statuses in ANSWERS.values())
        by_operation = {op: dict(sorted(statuses.items())) for op, statuses in sorted(ANSWERS.items())}
        Path(path).write_text(json.dumps({"cases": total, "operations": by_operation}, indent=2))
        print(f"\nfuzz: {total} cases, {sum(s[500] for s in ANSWERS.values())} answered 500")


@pytest.fixture
def api(gateway: str, fake_nodes: Any) -> Any:
    fake_nodes()  # a node online, so well-formed requests go all the way through
    return schemathesis.openapi.from_url(f"{gateway}/openapi.json")


schema = schemathesis.pytest.from_fixture("api")


@schemathesis.check
def openai_shaped_errors(ctx: Any, response: Any, case: Any) -> None:
    """No 500 at all; any other error is JSON with an `error` object carrying a message."""
    if response.status_code == 500:
        raise AssertionError(f"500: {response.text[:300]}")
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body.get("error"), dict) and body["error"].get("message"), response.text[:300]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_no_input_makes_a_server_error(case: Any, api_key: str) -> None:
    response = case.call(headers={"authorization": f"Bearer {api_key}"}, timeout=30)
    ANSWERS[f"{case.method} {case.path}"][response.status_code] += 1
    case.validate_response(response, checks=[openai_shaped_errors])
