"""Model verification: which (node, model)s are due a challenge, a challenge's job, its outcome, and
what owners and operators read of it; which nodes are due a GPU probe, and its outcome
(supabase/schemas/075_verification.sql)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from uuid import UUID

from psycopg.rows import class_row, scalar_row, tuple_row

from neuralgrid.db.queries.query import Query

__all__ = [
    "ARTIFACTS",
    "CHALLENGE_KEY",
    "CHECK_STATES",
    "DEFER_CHALLENGE",
    "DUE_CHALLENGES",
    "DUE_CROSS_CHECKS",
    "DUE_GPU_PROBES",
    "MY_MODEL_CHECKS",
    "PIN_ARTIFACT",
    "PLACE_CHALLENGE",
    "RECORD_CHALLENGES",
    "RECORD_GPU_PROBE",
    "REQUEST_VERIFICATION",
    "CheckState",
    "Due",
    "DueCrossCheck",
    "DueProbe",
    "ModelCheck",
    "PlacedChallenge",
    "Recorded",
    "Reset",
]


@dataclass(frozen=True)
class Due:
    node_id: UUID
    model_id: str
    sha256: str
    state: str


# (the sha256s of the GGUFs the referee holds, how many at most)
DUE_CHALLENGES = Query("due_challenges", "select * from public.due_challenges(%s, %s)", class_row(Due))


@dataclass(frozen=True)
class DueCrossCheck:
    node_id: UUID
    model_id: str
    state: str
    peers: list[UUID]


# (the sha256s of the GGUFs the referee holds, how many at most): the others' (node, model)s due,
# each with up to two peers to be checked against
DUE_CROSS_CHECKS = Query(
    "due_cross_checks", "select * from public.due_cross_checks(%s, %s)", class_row(DueCrossCheck)
)


# (node, model): a challenge that found no free slot comes again soon, not at its next random time
DEFER_CHALLENGE = Query(
    "defer_challenge",
    "update public.model_checks set next_challenge_at = least(next_challenge_at, now() + interval '5 s')"
    " where node_id = %s and model_id = %s returning node_id",
    scalar_row,
)


@dataclass(frozen=True)
class PlacedChallenge:
    job_id: UUID
    node_id: UUID
    endpoint_url: str
    node_key: bytes | None
    attempt: int
    tokens_per_s: float | None


# (gateway id, node id, model): no row when the node has no free slot
PLACE_CHALLENGE = Query(
    "place_challenge", "select * from public.place_challenge(%s, %s, %s)", class_row(PlacedChallenge)
)
CHALLENGE_KEY = Query("challenge_key", "select private.challenge_key_id()", scalar_row)


# (sha256s): the catalog models pinned to those GGUFs, as (model_id, sha256)
ARTIFACTS = Query(
    "artifacts",
    "select model_id, sha256 from public.model_artifacts where format = 'gguf' and sha256 = any(%s)",
    tuple_row,
)


@dataclass(frozen=True)
class Recorded:
    node_id: UUID
    model_id: str
    state: str
    evidence: float


# (a JSON array of {"node", "model", "job", "passed", "distance", "detail"})
RECORD_CHALLENGES = Query(
    "record_challenges", "select * from public.record_challenges(%s::jsonb)", class_row(Recorded)
)


@dataclass(frozen=True)
class Reset:
    model_id: str
    state: str


REQUEST_VERIFICATION = Query(
    "request_verification",
    "select * from public.request_verification(%s)",
    class_row(Reset),
    subject="node_id",
)


@dataclass(frozen=True)
class ModelCheck:
    node_id: UUID
    node_name: str
    model_id: str
    state: str
    challenges: int
    failures: int
    evidence: float
    state_since: datetime
    last_challenge_at: datetime | None
    last_failure: str | None
    held_usd: Decimal
    forfeited_usd: Decimal


MY_MODEL_CHECKS = Query("my_model_checks", "select * from public.my_model_checks()", class_row(ModelCheck))


@dataclass(frozen=True)
class CheckState:
    state: str
    count: int


# Every (node, model) under verification, by state: a gauge of /metrics.
CHECK_STATES = Query(
    "check_states",
    """
select s.state, count(c.state)::int as count
from unnest(array['unverified', 'verified', 'suspect', 'failed']) s (state)
left join public.model_checks c on c.state = s.state
group by s.state order by s.state
""",
    class_row(CheckState),
)

# (model, sha256): pins a GGUF; a model pinned before is pinned again to the new file
PIN_ARTIFACT = Query(
    "pin_artifact",
    """
insert into public.model_artifacts (model_id, format, sha256) values (%s, 'gguf', %s)
on conflict (model_id) do update set format = 'gguf', sha256 = excluded.sha256,
  repository = null, revision = null, dtype = null
returning model_id
""",
    scalar_row,
)


@dataclass(frozen=True)
class DueProbe:
    node_id: UUID
    endpoint_url: str
    node_key: bytes | None
    gpu_model: str
    gpu_count: int
    vram_gb: float
    free_vram_gb: float | None
    state: str


# (how many at most): online nodes due a GPU probe, each put off as it is taken
DUE_GPU_PROBES = Query("due_gpu_probes", "select * from public.due_gpu_probes(%s)", class_row(DueProbe))

# (node id, outcome, detail as JSON): the proof's state after it
RECORD_GPU_PROBE = Query(
    "record_gpu_probe", "select state from public.record_gpu_probe(%s, %s, %s::jsonb)", scalar_row
)
