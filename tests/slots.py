"""What a node's slots are held by, and when the ledger has every job, as tests read them. A lease's
slots count in nodes.inflight (so no claim can overbook them), and a job served from a lease holds
no slot of its own: the slots held by jobs placed in SQL are a node's inflight less what leases
hold. A leased job is written behind: the gateway's journal_pending gauge says what is still to go."""

import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from tests.conftest import LLAMA8, wait_for

JOB_SLOTS = (
    "(n.inflight - coalesce((select sum(l.slots) from private.slot_leases l where l.node_id = n.id), 0))::int"
)


def written_behind(gateway: str, timeout: float = 10.0) -> None:
    """Wait until the gateway has written every job it served to Postgres."""

    def empty() -> bool:
        text = httpx.get(f"{gateway}/metrics", timeout=5).text
        found = re.search(r"^neuralgrid_journal_pending (\S+)$", text, re.M)
        return found is None or float(found.group(1)) == 0

    wait_for(empty, timeout=timeout)


def metric(gateway: str, name: str) -> float:
    """A gateway's metric, summed over its labels (0 when it has none yet)."""
    text = httpx.get(f"{gateway}/metrics", timeout=5).text
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in found)


def record(
    job: uuid.UUID,
    node: uuid.UUID,
    key: uuid.UUID | None = None,
    end: dict[str, Any] | None = None,
    hold: str = "0",
    age_s: float = 2,
    **extra: Any,
) -> dict[str, Any]:
    """A job's record as a gateway's journal writes it (JobRecord.as_json()), started `age_s` ago."""
    return {
        "id": str(job),
        "key": None if key is None else str(key),
        "model": LLAMA8,
        "policy": "balanced",
        "region": None,
        "stream": True,
        "node": str(node),
        "started_at": (datetime.now(UTC) - timedelta(seconds=age_s)).isoformat(),
        "hold_usd": hold,
        "end_user": "end-user-7",
        "end": end,
        **extra,
    }


# A whole answer's end in a record.
ENDED = {
    "status": "succeeded",
    "prompt_tokens": 1000,
    "completion_tokens": 90,
    "ttft_ms": 100,
    "latency_ms": 1000,
    "error": None,
}
