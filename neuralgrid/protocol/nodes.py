"""Registration and heartbeats: the bodies an agent sends and the gateway validates, one model each."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from neuralgrid.protocol.routes import Route

# Every number has a range a real machine fits in, so nothing out of Postgres's range, or absurd,
# reaches the matcher; a node's specs take the ranges its table's rules do (nodes_check_description).
# Text is a name or a version: printable, no control characters (Postgres cannot even hold NUL).
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
ModelName = Annotated[str, Field(min_length=1, max_length=256, pattern=PRINTABLE)]
# A server may list a model twice (under two routes, say): the node holds it once.
Models = Annotated[
    list[ModelName],
    Field(default_factory=list, max_length=1000),
    AfterValidator(lambda m: list(dict.fromkeys(m))),
]
# The models a server can load on demand (null: the agent does not say), as many as it may list.
AvailableModels = Annotated[
    list[ModelName], Field(max_length=1000), AfterValidator(lambda m: list(dict.fromkeys(m)))
]
VramGb = Annotated[float, Field(gt=0, le=8192)]  # all GPUs together
Tflops = Annotated[float, Field(gt=0, le=100_000)]
Slots = Annotated[int, Field(ge=1, le=1024)]  # requests a node runs at once

# What an agent may say of its node: serving, finishing what it has (SIGTERM), or gone.
AgentStatus = Literal["online", "draining", "offline"]


class BackendInfo(BaseModel):
    """What the agent found of its inference server (see neuralgrid.agent.backend.ServerInfo)."""

    model_config = ConfigDict(extra="forbid")
    kind: str = Field(min_length=1, max_length=32, pattern=PRINTABLE)
    version: str | None = Field(None, max_length=64, pattern=PRINTABLE)
    parallel: Slots | None = None
    usage_in_streams: bool = False
    continues: bool = False
    echoes: bool = False
    tokenize: bool = False
    interrupts: bool = False
    # The OpenAI routes the server serves (None: not said; the node then serves DEFAULT_ROUTES).
    routes: (
        Annotated[
            list[Route],
            Field(min_length=1, max_length=32),
            AfterValidator(lambda r: list(dict.fromkeys(r))),
        ]
        | None
    ) = None


def reachable(url: str) -> str:
    """An http(s) endpoint names a host and, if any, a port from 1 to 65535 (else no request could
    reach it, and every one would fail as the node's fault)."""
    if url.startswith("tunnel:"):
        return url
    try:
        parts = urlsplit(url)  # ValueError for a bracketed host that is not an IPv6 address
        host, port = parts.hostname, parts.port  # ValueError for a port not from 0 to 65535
    except ValueError:
        host, port = None, None
    if not host or port == 0 or (port is None and ":" in parts.netloc.rpartition("@")[2].rpartition("]")[2]):
        raise ValueError("endpoint_url must name a host, and a port from 1 to 65535 if it gives one")
    return url


class NodeRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100, pattern=PRINTABLE)
    gpu_model: str = Field(min_length=1, max_length=100, pattern=PRINTABLE)
    gpu_count: int = Field(1, ge=1, le=64)
    vram_gb: VramGb
    tflops: Tflops
    hourly_rate: float = Field(ge=0, le=10_000)  # USD per hour
    region: str = Field(min_length=1, max_length=64, pattern=PRINTABLE)
    latitude: float | None = Field(None, ge=-90, le=90)
    longitude: float | None = Field(None, ge=-180, le=180)
    endpoint_url: Annotated[str, Field(pattern=r"^(https?://\S+|tunnel:\S*)$"), AfterValidator(reachable)]
    max_concurrency: Slots = 4
    models: Models
    agent_version: str | None = Field(None, max_length=64, pattern=PRINTABLE)
    backend: BackendInfo | None = None


class Specs(BaseModel):
    """A node's machine as it changed since registration: its GPUs, and the requests its server
    runs at once (None: unchanged; a server restarted with another -np changes it)."""

    model_config = ConfigDict(extra="forbid")
    gpu_model: str = Field(min_length=1, max_length=100, pattern=PRINTABLE)
    gpu_count: int = Field(ge=1, le=64)
    vram_gb: VramGb
    tflops: Tflops
    max_concurrency: Slots | None = None


class Refusal(BaseModel):
    """A pre-load the agent did not do, and why (its server serves one model, say)."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName
    reason: str = Field(min_length=1, max_length=200, pattern=PRINTABLE)


class Heartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: AgentStatus = "online"
    queue_depth: int = Field(0, ge=0, le=1_000_000)
    gpu_utilization: float | None = Field(None, ge=0, le=1)
    free_vram_gb: float | None = Field(None, ge=0, le=100_000)
    models: Models
    specs: Specs | None = None  # only when they changed since registration
    backend_up: bool = True  # false: the agent is alive but its inference server does not answer
    backend: BackendInfo | None = None  # only when it changed
    # Pre-warm: the models the server can load on demand but holds unloaded (None: not said), and
    # the answers to the platform's last `load` (the reply's field): loaded, or refused and why.
    available: AvailableModels | None = None
    loaded: list[ModelName] = Field(default_factory=list, max_length=16)
    refused: list[Refusal] = Field(default_factory=list, max_length=16)
