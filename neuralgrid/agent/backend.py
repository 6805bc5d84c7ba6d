"""The inference server an agent fronts: what kind it is, what it can do, whether it answers.

Detection reads what each server documents about itself, with GET requests that never touch a
running generation; what each kind documents is in its module (neuralgrid/agent/servers/). What no
endpoint states is verified by small generations before the node takes any work (warmup.py).
The gateway's requests go to the server through Backend.relay (relay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import httpx

from neuralgrid.agent.relay import Relay
from neuralgrid.agent.servers import GENERIC, KINDS
from neuralgrid.agent.servers.base import PROBE_TIMEOUT_S, BackendError, BackendStarting, ServerKind, dig
from neuralgrid.agent.warmup import WarmUp, WarmUpRefusal
from neuralgrid.protocol.routes import DEFAULT_ROUTES, Route, root_url

log = logging.getLogger(__name__)

USAGE_TIMEOUT_S = 10.0  # counting a stream's usage holds its [DONE]: well inside the gateway's read timeout
# Why the agent refuses a pre-load on a server that serves what it started with (the platform records it).
ONE_MODEL = "server serves one model"
# Fields the one-token prompt count must not carry: they would make the server generate or echo more.
ONE_TOKEN_DROPS = ("stream", "stream_options", "n", "max_completion_tokens", "best_of", "logprobs", "echo")

Health = Literal["up", "down", "slow"]


@dataclass(frozen=True)
class ServerInfo:
    """What the agent knows of its server; sent to the platform at registration and on change."""

    kind: str  # llama.cpp, llama-cpp-python, vllm, sglang, tgi, ollama, or openai (unknown kind)
    version: str | None = None
    parallel: int | None = None  # requests it runs at once, when the server says
    usage_in_streams: bool = False  # verified: a stream asked for usage gets it
    continues: bool = False  # verified: continue_final_message goes on with the open message
    echoes: bool = False  # verified: a completion asked to echo starts with its prompt
    tokenize: bool = False  # the agent can count tokens with the server's own tokenizer
    interrupts: bool = False  # any new request cuts a running stream: probe only while idle
    routes: tuple[Route, ...] | None = None  # the OpenAI routes it serves (None: not known yet)

    def as_json(self) -> dict[str, Any]:
        fields = asdict(self)
        if self.routes is not None:  # JSON's arrays, as the protocol's model holds them
            fields["routes"] = list(self.routes)
        return fields

    def serves(self) -> tuple[Route, ...]:
        """The routes the node takes requests for: those found (or the owner's), else the default."""
        return self.routes or DEFAULT_ROUTES


class Backend:
    """One inference server, reached over HTTP. Holds the clients every request to it goes through:
    `http` for the agent's own (probes, warm-ups, counts), `relay` for the gateway's."""

    def __init__(
        self, url: str, http: httpx.AsyncClient | None = None, routes: tuple[Route, ...] | None = None
    ) -> None:
        self.url = root_url(url)
        self.routes_given = routes  # the owner's list (--routes), in place of what detection finds
        # A new connection per request: llama.cpp's server sometimes closes a kept-alive connection
        # after a stream just as the next request goes out on it ("Server disconnected without
        # sending a response", 3 in 40 measured), which would fail a request the server never saw.
        # On loopback or a LAN a connection costs well under a millisecond.
        self.http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(600, connect=5),
            limits=httpx.Limits(max_keepalive_connections=0),
            event_hooks={"request": [self._noting]},
        )
        self.kind: ServerKind = GENERIC
        self.identity: Any = None  # the answer that identified the kind (llama.cpp's /props)
        self.info = ServerInfo(GENERIC.name)
        self.relay = Relay(self.url)  # the gateway's requests: kept-alive connections, a C parser
        self.served: list[str] = []  # its models, as /v1/models last listed them
        self.refusal: WarmUpRefusal | None = None  # the server's last refusal of a warm-up
        self.resident: str | None = None  # see `swaps`: the model it holds now

    async def aclose(self) -> None:
        await self.http.aclose()
        self.relay.close()

    # Reading (GET only: safe while requests run) -------------------------------------------------

    async def get_json(self, path: str) -> Any:
        resp = await self.http.get(self.url + path, timeout=PROBE_TIMEOUT_S)
        if resp.status_code != 200:
            return None
        try:
            return resp.json()
        except ValueError:
            return None

    async def detect(self) -> ServerInfo:
        """The server's kind, version and parallelism, from the endpoints it documents."""
        for kind in KINDS:
            try:
                data = await self.get_json(kind.identify)
            except httpx.HTTPError as err:
                raise BackendStarting(f"the backend at {self.url} is unreachable: {err!r}") from err
            if data is not None and kind.recognise(data):
                self.kind, self.identity = kind, data
                self.info = replace(
                    self.info,
                    kind=kind.name,
                    version=kind.version(data),
                    parallel=kind.parallel(data),
                    interrupts=kind.interrupts,
                )
                return self.info
        self.kind, self.identity = GENERIC, None
        self.info = replace(self.info, kind=GENERIC.name, version=None, parallel=None)
        return self.info

    async def reread_parallel(self) -> None:
        """The server's parallelism again, where its kind says it (a server restarted between two
        beats with another -np). A late, failed or unrecognised answer keeps what was found: a busy
        server must not turn into another kind, nor take its node out."""
        if self.kind is GENERIC:
            return
        try:
            data = await self.get_json(self.kind.identify)
        except httpx.HTTPError:
            return
        parallel = self.kind.parallel(data) if data is not None and self.kind.recognise(data) else None
        if parallel is not None:
            self.info = replace(self.info, parallel=parallel)

    async def models(self) -> list[str]:
        """The models the server serves (its /v1/models), or BackendError saying what is wrong."""
        try:
            resp = await self.http.get(self.url + "/v1/models", timeout=PROBE_TIMEOUT_S * 3)
        except httpx.HTTPError as err:
            raise BackendStarting(f"the backend at {self.url} is unreachable: {err!r}") from err
        if resp.status_code == 503:  # llama-server's answer while it loads its model
            raise BackendStarting(f"the backend at {self.url} is starting: GET /v1/models answered 503")
        try:
            self.served = [str(m["id"]) for m in resp.json()["data"]]
            return self.served
        except (ValueError, KeyError, TypeError) as err:
            status = resp.status_code
            raise BackendError(
                f"the backend at {self.url} is not OpenAI-compatible: GET /v1/models gave HTTP {status}"
            ) from err

    async def health(self) -> Health:
        """The server's health check now (never a generation): up; down (refused, or an error
        status: certain); or slow (no answer in time: a busy server may just be late)."""
        try:
            resp = await self.http.get(self.url + self.kind.health, timeout=PROBE_TIMEOUT_S)
        except httpx.TimeoutException:
            return "slow"
        except httpx.HTTPError:
            return "down"
        return "up" if resp.is_success else "down"

    async def queue_depth(self) -> int | None:
        """Requests the server is running or holding, when its kind says (llama.cpp's /slots, the
        gauges in vLLM's, SGLang's and TGI's /metrics)."""
        try:
            return await self.kind.queue_depth(self)
        except (httpx.HTTPError, ValueError):
            return None

    # Verifying (generations: only while the node takes no work) ----------------------------------

    async def verify(self, models: list[str]) -> tuple[ServerInfo, list[str]]:
        """Find the routes the server serves (unless the owner named them), warm each model up with
        a real request on one of them and verify what the server does; returns the new info and the
        models that answered (the warm ones)."""
        self.refusal = None  # this warm-up's, not an earlier one's (a 503 then would say "starting")
        routes = self.routes_given or await self.kind.routes(
            self, self.identity, self.info.version, next(iter(models), None)
        )
        warm_up = WarmUp(self.http, self.url)
        try:
            warmed = await warm_up.models(models, routes)
        finally:
            self.refusal = warm_up.refusal
        warm = warmed.models
        tokenize = bool(warm) and await self._can_tokenize(warm[0])
        echoes = bool(warm) and "completions" in routes and await warm_up.echoes(warm[0])
        self.info = replace(
            self.info,
            usage_in_streams=warmed.usage_in_streams,
            continues=warmed.continues,
            tokenize=tokenize,
            echoes=echoes,
            routes=routes,
        )
        return self.info, warm

    # Loading models on demand (pre-warm) ----------------------------------------------------------

    @property
    def swaps(self) -> bool:
        """A server that holds one of its models at a time, and loads the one a request names
        (llama-cpp-python serving several, from a config file). Which one it holds is known only
        from the requests it was sent (the agent's own and the gateway's)."""
        return self.kind.swaps(self.served)

    def note_request(self, request: Any) -> None:
        """A request on its way to a server that swaps: it will hold the model named (its first, the
        default, for a name it does not serve)."""
        if self.swaps:
            name = dig(request, "model")
            self.resident = name if name in self.served else self.served[0]

    async def _noting(self, request: httpx.Request) -> None:
        """Every request of the agent's own passes here (an httpx hook)."""
        if request.method == "POST" and self.swaps:
            with contextlib.suppress(ValueError):
                self.note_request(json.loads(request.content))

    async def model_states(self) -> tuple[list[str], list[str]] | None:
        """For a server that loads models on demand: the models it holds loaded and the ones it can
        load (its own names). None for a server that serves what it started with. BackendError when
        it does not say."""
        return await self.kind.model_states(self)

    async def load(self, model: str) -> str | None:
        """Have the server load `model` (its own name for it) before a request needs it: None once it
        holds it, else why not, in a line the platform records."""
        states = await self.model_states()
        if states is None:
            return ONE_MODEL if self.kind is not GENERIC else "the agent cannot load models on this server"
        if model in states[0]:
            return None
        if model not in states[1]:
            return "the server does not have this model"
        return await self.kind.load(self, model)

    # Counting tokens (when a stream carried no usage) --------------------------------------------

    async def _can_tokenize(self, model: str) -> bool:
        try:
            return await self.count_tokens(model, "hello world") is not None
        except Exception:  # an answer of another shape: no tokenizer to use
            return False

    async def count_tokens(self, model: str, text: str) -> int | None:
        """Tokens in `text` by the server's own tokenizer, special tokens not added."""
        return await self.kind.count_tokens(self, model, text)

    async def usage(self, kind: str, request: dict[str, Any], answers: list[str]) -> dict[str, int] | None:
        """Exact usage of a streamed answer the server gave no usage for: its choices' text counted
        by the server's tokenizer, the prompt by the server itself (the same request, not streamed,
        one token long: the server has the prompt cached). None when the server cannot say in time:
        the stream then ends as it came, and the gateway counts what it can."""
        try:
            async with asyncio.timeout(USAGE_TIMEOUT_S):
                return await self._usage(kind, request, answers)
        except Exception as err:  # never let counting break an answer that is already whole
            log.warning("could not count a stream's usage: %r", err)
            return None

    async def completion_tokens(self, model: str, answers: list[str]) -> int | None:
        """The tokens of an answer's choices, each counted by the server's tokenizer (a server may
        report the usage of one choice only: llama-server does for `n` > 1). None when it cannot say
        in time."""
        try:
            async with asyncio.timeout(USAGE_TIMEOUT_S):
                counts = [await self.count_tokens(model, text) for text in answers]
        except Exception as err:
            log.warning("could not count an answer's choices: %r", err)
            return None
        return None if None in counts else sum(c for c in counts if c is not None)

    async def _usage(self, kind: str, request: dict[str, Any], answers: list[str]) -> dict[str, int] | None:
        model = str(request.get("model") or "")
        completion = await self.completion_tokens(model, answers)
        if completion is None:
            return None
        once = {k: v for k, v in request.items() if k not in ONE_TOKEN_DROPS}
        once.update(max_tokens=1, stream=False)
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        resp = await self.http.post(self.url + path, json=once)
        prompt = dig(resp.json(), "usage", "prompt_tokens") if resp.is_success else None
        if type(prompt) is not int:
            return None
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


_ALIAS = re.compile(r"^(?P<served>[^=\s]+)=(?P<catalog>[^=\s]+)$")


def parse_aliases(pairs: list[str]) -> dict[str, str]:
    """`served=catalog` pairs (the name the server reports = the platform's catalog id), as a map
    from served name to catalog id; BackendError naming the first malformed one."""
    aliases: dict[str, str] = {}
    for pair in pairs:
        match = _ALIAS.match(pair.strip())
        if match is None:
            raise BackendError(f"--model-alias {pair!r}: write SERVED=CATALOG, e.g. my-model.gguf=Org/Model")
        aliases[match["served"]] = match["catalog"]
    return aliases
