"""What every kind of inference server is to the agent: how it is recognised, where its facts are,
and what it can do beyond OpenAI's API (count tokens, load models on demand). The defaults are what
a plain OpenAI-compatible server offers; each kind's module overrides what its server does more.

A kind never holds state: what the agent knows of one server (its URL, its models) is the
`Server` passed in, so that one kind serves any number of servers.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

import httpx

from neuralgrid.agent.routes import openapi_routes, ordered
from neuralgrid.protocol.routes import DEFAULT_ROUTES, Route

PROBE_TIMEOUT_S = 3.0  # GETs: a server too slow to answer these is not healthy
WARMUP_TIMEOUT_S = 120.0  # the first generation may load weights


# What the gateway says of the prompt cache in a generation request (gateway/prompt_cache.py): the
# key's salt (vLLM's and SGLang's field) and, when the operator turned the shared cache off,
# `cache_prompt: false` (llama-server's).
CACHE_FIELDS = ("cache_salt", "cache_prompt")


class BackendError(Exception):
    """The server cannot be used; the message says what is wrong, for the owner."""


class BackendStarting(BackendError):
    """The server is not up yet: nothing listens, or it answers 503 while it loads its model."""


class Server(Protocol):
    """One server as a kind's code reaches it (the agent's Backend)."""

    url: str
    http: httpx.AsyncClient  # the agent's own client: probes, warm-ups, counts
    served: list[str]  # its models, as /v1/models last listed them
    resident: str | None  # the model a server that swaps holds now

    async def get_json(self, path: str) -> Any:
        """A GET's JSON answer; None unless it is a 200 with JSON."""
        ...


class ServerKind(ABC):
    """How to recognise one kind of server, and what it says and does that others do not."""

    name: str  # reported to the platform as the node's backend kind
    identify: str  # a GET whose JSON answer says "this is me"
    health: str = "/health"  # a GET that answers 2xx while the server can serve, and disturbs nothing
    # Any new request cuts a running stream: the agent probes only while it is idle.
    interrupts: bool = False
    queue: tuple[str, ...] = ()  # the gauges in its /metrics that add up to requests running or waiting
    # Which of the gateway's prompt-cache fields (CACHE_FIELDS) its server takes; the agent drops the
    # others. A server that takes no `cache_salt` cannot keep keys' caches apart: the agent strips
    # the cache counts from its answers.
    cache_fields: frozenset[str] = frozenset()
    # What its server does by default that OpenAI's API does not, undone in each text-generation
    # request that does not say otherwise: OpenAI semantics (and model verification's greedy
    # challenges, which expect the model's own most likely token) hold on every node.
    openai_defaults: Mapping[str, Any] = MappingProxyType({})

    @property
    def isolates_cache(self) -> bool:
        return "cache_salt" in self.cache_fields

    @abstractmethod
    def recognise(self, identity: Any) -> bool:
        """Whether the answer to GET `identify` is this kind's."""

    def version(self, identity: Any) -> str | None:
        return None

    def parallel(self, identity: Any) -> int | None:
        """The requests it runs at once, when it says (else the owner does)."""
        return None

    async def routes(
        self, server: Server, identity: Any, version: str | None, model: str | None
    ) -> tuple[Route, ...]:
        """The OpenAI routes it serves, never more than it can answer. `identity`: its answer to
        GET `identify`; `model`: one it serves, for a probe that must name one. By default the POST
        paths its OpenAPI document lists (FastAPI servers publish one), else DEFAULT_ROUTES."""
        listed = await openapi_routes(server.http, server.url)
        return ordered(listed or set()) or DEFAULT_ROUTES

    async def queue_depth(self, server: Server) -> int | None:
        """Requests it is running or holding, when it says: by default its /metrics gauges."""
        if not self.queue:
            return None
        resp = await server.http.get(server.url + "/metrics", timeout=PROBE_TIMEOUT_S)
        return gauges(resp.text, self.queue) if resp.is_success else None

    async def count_tokens(self, server: Server, model: str, text: str) -> int | None:
        """Tokens in `text` by the server's own tokenizer, special tokens not added; None when it
        has no tokenizer to reach."""
        return None

    def swaps(self, served: list[str]) -> bool:
        """Whether it holds one of the models it serves at a time, loading the one a request names."""
        return False

    async def model_states(self, server: Server) -> tuple[list[str], list[str]] | None:
        """For a server that loads models on demand: the models it holds loaded and the ones it can
        load (its own names). None for a server that serves what it started with. Raises
        BackendError when it does not say."""
        return None

    async def load(self, server: Server, model: str) -> str | None:
        """Have it load `model`, one of those it can load (model_states): None once it holds it,
        else why not, in a line the platform records."""
        raise NotImplementedError(f"{self.name} serves what it started with")


def dig(data: Any, *path: str) -> Any:
    """data[path[0]][path[1]]…, or None where a level is missing or not an object."""
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def positive_int(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def short_str(value: Any) -> str | None:
    """A version, as a line of 64 characters at most (a number is one too)."""
    return str(value)[:64] if isinstance(value, str | int | float) and value != "" else None


def gauges(metrics: str, names: tuple[str, ...]) -> int | None:
    """The sum of the named gauges in Prometheus text (over all their label sets); None if absent.
    TGI publishes its gauges only once they have a value: absent then means nothing queued."""
    total, seen = 0.0, False
    for line in metrics.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            total, seen = total + float(line.rsplit(" ", 1)[1]), True
    return round(total) if seen else None


def load_refused(resp: httpx.Response) -> str:
    """Why the server did not load a model, from its error answer: one printable line of 200 at most."""
    try:
        said = dig(resp.json(), "error")
        said = dig(said, "message") if isinstance(said, dict) else said
    except ValueError:
        said = None
    why = f"the server did not load it: HTTP {resp.status_code}"
    why += f" {said}" if isinstance(said, str) else ""
    return re.sub(r"[\x00-\x1f\x7f]+", " ", why)[:200]
