"""The inference server an agent fronts: what kind it is, what it can do, whether it answers.

Detection reads what each server documents about itself, with GET requests that never touch a
running generation. What no endpoint states is verified by small generations before the node
takes any work (at start, and again after the server comes back): that the model answers (only then
is it reported warm), whether the server puts usage in streams, and whether it goes on with an open
assistant message (`continue_final_message`). A dropped stream is resumed only on a node whose
server passed that test, so a server that starts a new answer instead can never splice two.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import ssl
import urllib.parse
import wave
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, cast

import httptools
import httpx

from neuralgrid.agent.routes import detect_routes
from neuralgrid.protocol.routes import DEFAULT_ROUTES, Route, path, root_url
from neuralgrid.protocol.sse import SseEvents

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0  # GETs: a server too slow to answer these is not healthy
WARMUP_TIMEOUT_S = 120.0  # the first generation may load weights
USAGE_TIMEOUT_S = 10.0  # counting a stream's usage holds its [DONE]: well inside the gateway's read timeout
LOAD_POLL_S = 0.25  # how often a loading model's state is read (llama.cpp's router)
# Why the agent refuses a pre-load on a server that serves what it started with (the platform records it).
ONE_MODEL = "server serves one model"
# Fields the one-token prompt count must not carry: they would make the server generate or echo more.
ONE_TOKEN_DROPS = ("stream", "stream_options", "n", "max_completion_tokens", "best_of", "logprobs", "echo")
# A prompt small models answer with confidence: greedy decoding then gives the same words whether
# the answer is generated in one go or continued from a prefix (floating-point noise between the
# two paths cannot flip a confident choice), which is what the continuation check compares.
PROBE_PROMPT = [
    {
        "role": "user",
        "content": "Repeat exactly these words: one two three four five six seven eight nine ten",
    }
]

# The completion that checks whether the server echoes: its answer must start with this.
ECHO_PROBE = "One two three"

Health = Literal["up", "down", "slow"]


class BackendError(Exception):
    """The server cannot be used; the message says what is wrong, for the owner."""


class BackendStarting(BackendError):
    """The server is not up yet: nothing listens, or it answers 503 while it loads its model."""


@dataclass(frozen=True)
class WarmUpRefusal:
    """A server's refusal of a warm-up request: its status, and what it said, in its own words."""

    status: int
    request: str  # which request: "a streamed chat", "POST /v1/embeddings"
    said: str

    def __str__(self) -> str:
        return f"{self.request} gave HTTP {self.status}: {self.said}"


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


@dataclass(frozen=True)
class _Kind:
    """How to recognise one kind of server and where its facts are."""

    name: str
    identify: str  # a GET whose JSON answer says "this is me"
    recognise: Callable[[Any], bool]
    version: Callable[[Any], str | None]
    parallel: Callable[[Any], int | None]
    health: str  # a GET that answers 2xx while the server can serve, and disturbs nothing
    interrupts: bool = False
    queue: tuple[str, ...] = ()  # the gauges in its /metrics that add up to requests running or waiting


def dig(data: Any, *path: str) -> Any:
    """data[path[0]][path[1]]…, or None where a level is missing or not an object."""
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _int(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _str(value: Any) -> str | None:
    return str(value)[:64] if isinstance(value, str | int | float) and value != "" else None


def _sglang_parallel(d: Any) -> int | None:
    """--max-running-requests when given; else what each data-parallel rank settled on, times ranks."""
    states = dig(d, "internal_states")
    first = states[0] if isinstance(states, list) and states else None
    per_rank = _int(dig(first, "effective_max_running_requests_per_dp"))
    if _int(dig(d, "max_running_requests")) is not None or per_rank is None:
        return _int(dig(d, "max_running_requests"))
    return per_rank * (_int(dig(d, "dp_size")) or 1)


# In the order tried: each identifying path is one the others answer 404 (or without the field).
KINDS = (
    _Kind(
        "llama.cpp",
        "/props",
        lambda d: _int(dig(d, "total_slots")) is not None,
        lambda d: _str(dig(d, "build_info")),
        lambda d: _int(dig(d, "total_slots")),
        "/health",
    ),
    _Kind(
        # llama-server started without a model (router mode): it loads the models of a folder or a
        # preset on demand, each in a server of its own, and says which are loaded (GET /models).
        "llama.cpp-router",
        "/props",
        lambda d: dig(d, "role") == "router",
        lambda d: _str(dig(d, "build_info")),
        lambda d: None,  # each model's server has its own slots: the owner says
        "/health",
    ),
    _Kind(
        # Its server takes one request at a time, and by default a new request ends a running
        # stream early (interrupt_requests), even a GET /v1/models.
        "llama-cpp-python",
        "/openapi.json",
        lambda d: "llama.cpp Python" in str(dig(d, "info", "title")),
        lambda d: _str(dig(d, "info", "version")),
        lambda d: 1,
        "/openapi.json",
        interrupts=True,
    ),
    _Kind(
        "sglang",
        "/get_server_info",
        lambda d: isinstance(d, dict) and "model_path" in d,
        lambda d: _str(dig(d, "version")),
        _sglang_parallel,
        "/health",
        queue=("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    ),
    _Kind(
        "tgi",
        "/info",
        lambda d: _int(dig(d, "max_concurrent_requests")) is not None and "model_id" in d,
        lambda d: _str(dig(d, "version")),
        lambda d: _int(dig(d, "max_concurrent_requests")),
        "/health",
        queue=("tgi_queue_size", "tgi_batch_current_size"),
    ),
    _Kind(
        "ollama",
        "/api/version",
        lambda d: isinstance(dig(d, "version"), str),
        lambda d: _str(dig(d, "version")),
        lambda d: None,  # OLLAMA_NUM_PARALLEL is not published: the owner says
        "/api/version",
    ),
    _Kind(
        "vllm",
        "/version",
        lambda d: isinstance(dig(d, "version"), str),
        lambda d: _str(dig(d, "version")),
        lambda d: None,  # max_num_seqs is not published: the owner says
        "/health",
        queue=("vllm:num_requests_running", "vllm:num_requests_waiting"),
    ),
)
GENERIC = _Kind("openai", "/v1/models", lambda d: True, lambda d: None, lambda d: None, "/v1/models")


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
        self.kind = GENERIC
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

    async def _json(self, path: str) -> Any:
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
                data = await self._json(kind.identify)
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
            data = await self._json(self.kind.identify)
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
        """Requests the server is running or holding, when it says: llama.cpp's /slots, or the
        gauges in vLLM's, SGLang's and TGI's /metrics."""
        try:
            if self.kind.name == "llama.cpp":
                slots = await self._json("/slots")
                if isinstance(slots, list):
                    return sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))
            elif self.kind.queue:
                resp = await self.http.get(self.url + "/metrics", timeout=PROBE_TIMEOUT_S)
                if resp.is_success:
                    return _gauges(resp.text, self.kind.queue)
        except (httpx.HTTPError, ValueError):
            pass
        return None

    # Verifying (generations: only while the node takes no work) ----------------------------------

    async def verify(self, models: list[str]) -> tuple[ServerInfo, list[str]]:
        """Find the routes the server serves (unless the owner named them), warm each model up with
        a real request on one of them and verify what the server does; returns the new info and the
        models that answered (the warm ones)."""
        self.refusal = None  # this warm-up's, not an earlier one's (a 503 then would say "starting")
        routes = self.routes_given or await detect_routes(
            self.http, self.url, self.kind.name, self.identity, self.info.version, next(iter(models), None)
        )
        warm, usage_in_streams, continues = [], False, False
        for model in models:
            try:
                answered = await self._warm_up(model, routes)
            except Exception as err:  # whatever the server sent, it is not a warm model
                log.warning("model %s did not answer its warm-up (%r): not reported warm", model, err)
                continue
            if answered is None:
                log.warning(
                    "model %s did not answer its warm-up (%s): not reported warm", model, self.refusal
                )
                continue
            warm.append(model)
            text, streamed_usage = answered
            if text is not None:  # a chat model: what its server does with streams and prefills
                usage_in_streams = usage_in_streams or streamed_usage
                continues = continues or await self._continues(model, text)
        tokenize = bool(warm) and await self._can_tokenize(warm[0])
        echoes = bool(warm) and "completions" in routes and await self._echoes(warm[0])
        self.info = replace(
            self.info,
            usage_in_streams=usage_in_streams,
            continues=continues,
            tokenize=tokenize,
            echoes=echoes,
            routes=routes,
        )
        return self.info, warm

    async def _warm_up(self, model: str, routes: tuple[Route, ...]) -> tuple[str | None, bool] | None:
        """A first request to the model on a route the server serves: a streamed chat (its text and
        whether usage came), else a completion, an embedding, a rerank, a score, a transcription of
        a moment of silence or a line of speech (no text). None when the model answers none."""
        if "chat/completions" in routes:
            chat = {"model": model, "messages": PROBE_PROMPT, "max_tokens": 24, "temperature": 0}
            streamed = await self._stream(chat)
            if streamed is not None:
                return streamed
        for route, request in _warm_ups(model):
            if route in routes:
                resp = await self.http.post(self.url + path(route), timeout=WARMUP_TIMEOUT_S, **request)
                if resp.is_success:
                    return None, False
                self.refusal = WarmUpRefusal(resp.status_code, f"POST /v1/{route}", resp.text[:200])
        return None

    async def _continues(self, model: str, text: str) -> bool:
        """Whether the server goes on with an open assistant message, in a stream as a resume asks:
        cut its own greedy answer after two words and ask it to continue; a server that does streams
        the rest of that answer (not the cut part again, not a new answer)."""
        cut = re.match(r"\s*\S+\s+\S+", text)
        rest = text[cut.end() :] if cut else ""
        if cut is None or len(rest.split()) < 2:
            log.info("continue_final_message: not checked (the warm-up answer %r is too short)", text)
            return False
        head = cut.group(0)
        body = {
            "model": model,
            "messages": [*PROBE_PROMPT, {"role": "assistant", "content": head}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 4,
            "temperature": 0,
        }
        for _ in range(2):  # a second look, so that one unlucky answer does not cost the capability
            try:
                streamed = await self._stream(body)
            except (httpx.HTTPError, ValueError) as err:
                log.info("continue_final_message: the check failed (%r)", err)
                continue
            said = " ".join((streamed or ("", False))[0].split())
            verified = bool(said) and " ".join(rest.split()).startswith(said)
            log.info("continue_final_message: %s (asked to go on after %r, said %r)", verified, head, said)
            if verified:
                return True
        return False

    async def _echoes(self, model: str) -> bool:
        """Whether the server honours a completion's `echo` (llama-server ignores it: the answer
        would come without the prompt a client asked to see, and nothing would say so)."""
        body = {"model": model, "prompt": ECHO_PROBE, "max_tokens": 1, "temperature": 0, "echo": True}
        try:
            resp = await self.http.post(self.url + "/v1/completions", json=body, timeout=WARMUP_TIMEOUT_S)
            text = dig(resp.json(), "choices")[0]["text"] if resp.is_success else None
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as err:
            log.info("echo: the check failed (%r)", err)
            return False
        echoes = isinstance(text, str) and text.startswith(ECHO_PROBE)
        log.info("echo: %s (asked to echo %r, said %r)", echoes, ECHO_PROBE, text)
        return echoes

    async def _stream(self, chat: dict[str, Any]) -> tuple[str, bool] | None:
        """A streamed chat request asking for usage: its text and whether usage came; None when refused."""
        body = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        url = self.url + "/v1/chat/completions"
        async with self.http.stream("POST", url, json=body, timeout=WARMUP_TIMEOUT_S) as resp:
            if not resp.is_success:
                await resp.aread()
                self.refusal = WarmUpRefusal(resp.status_code, "a streamed chat", resp.text[:200])
                log.info("%s", self.refusal)
                return None
            events = SseEvents(keep_usage_event=True)  # read as the gateway reads a node's stream
            async for raw in resp.aiter_raw():
                events.feed(raw)
            return "".join(events.text), events.usage is not None

    # Loading models on demand (pre-warm) ----------------------------------------------------------

    @property
    def swaps(self) -> bool:
        """llama-cpp-python serving several models (a config file): it holds one at a time, and a
        request naming another unloads it and loads that one. Which one it holds is known only from
        the requests it was sent (the agent's own and the gateway's)."""
        return self.kind.name == "llama-cpp-python" and len(self.served) > 1

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
        if self.kind.name == "ollama":
            every, running = _names(await self._json("/api/tags")), _names(await self._json("/api/ps"))
            if every is None or running is None:
                raise BackendError(f"the backend at {self.url} did not list its models (/api/tags, /api/ps)")
            return [m for m in every if m in running], [m for m in every if m not in running]
        if self.kind.name == "llama.cpp-router":
            states = _router_states(await self._json("/models"))
            if states is None:
                raise BackendError(f"the backend at {self.url} did not list its models (/models)")
            return [m for m, state in states.items() if state == "loaded"], [
                m for m, state in states.items() if state != "loaded"
            ]
        if self.swaps:
            held = self.resident if self.resident in self.served else self.served[0]
            return [held], [m for m in self.served if m != held]
        return None

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
        named = {"model": model}
        if self.kind.name == "ollama":  # a generate request naming only the model loads it
            resp = await self.http.post(self.url + "/api/generate", json=named, timeout=WARMUP_TIMEOUT_S)
        elif self.kind.name == "llama.cpp-router":  # starts the model's server, then loads in the background
            resp = await self.http.post(self.url + "/models/load", json=named, timeout=PROBE_TIMEOUT_S)
            # Refused as "already running" when a request loaded it meanwhile: then it is on its way.
            state = dig(_router_entry(await self._json("/models"), model), "status", "value")
            if resp.is_success or state in ("loading", "loaded"):
                return await self._loaded_by_router(model)
        else:  # llama-cpp-python loads the model a request names: one token of it
            body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
            resp = await self.http.post(self.url + "/v1/completions", json=body, timeout=WARMUP_TIMEOUT_S)
        return None if resp.is_success else _refusal(resp)

    async def _loaded_by_router(self, model: str) -> str | None:
        """Wait until the router has started the model's server (it loads in the background)."""
        deadline = asyncio.get_running_loop().time() + WARMUP_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            entry = _router_entry(await self._json("/models"), model)
            state = dig(entry, "status", "value")
            if state == "loaded":
                return None
            if state == "unloaded" and dig(entry, "status", "failed"):
                return f"the server failed to load it (exit code {dig(entry, 'status', 'exit_code')})"
            await asyncio.sleep(LOAD_POLL_S)
        return f"the server did not load it within {WARMUP_TIMEOUT_S:g} s"

    # Counting tokens (when a stream carried no usage) --------------------------------------------

    async def _can_tokenize(self, model: str) -> bool:
        try:
            return await self._count(model, "hello world") is not None
        except Exception:  # an answer of another shape: no tokenizer to use
            return False

    async def _count(self, model: str, text: str) -> int | None:
        """Tokens in `text` by the server's own tokenizer, special tokens not added."""
        if self.kind.name == "llama.cpp":
            resp = await self.http.post(self.url + "/tokenize", json={"content": text, "add_special": False})
            tokens = dig(resp.json(), "tokens") if resp.is_success else None
            return len(tokens) if isinstance(tokens, list) else None
        if self.kind.name == "llama-cpp-python":
            # It always adds the model's special tokens (a BOS, say): count them once and take them off.
            counts: list[int] = []
            for piece in (text, ""):
                resp = await self.http.post(
                    self.url + "/extras/tokenize/count", json={"input": piece, "model": model}
                )
                count = dig(resp.json(), "count") if resp.is_success else None
                if type(count) is not int:
                    return None
                counts.append(count)
            return max(counts[0] - counts[1], 0)
        if self.kind.name == "tgi":  # a list of tokens, the start-of-text one (empty, at 0) first
            resp = await self.http.post(self.url + "/tokenize", json={"inputs": text})
            tokens = resp.json() if resp.is_success else None
            if not isinstance(tokens, list):
                return None
            return sum(
                1 for t in tokens if not (isinstance(t, dict) and t.get("text") == "" and not t.get("stop"))
            )
        if self.kind.name in ("vllm", "sglang"):
            body = {"model": model, "prompt": text, "add_special_tokens": False}
            resp = await self.http.post(self.url + "/tokenize", json=body)
            count = dig(resp.json(), "count") if resp.is_success else None
            return count if type(count) is int else None
        return None

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
                counts = [await self._count(model, text) for text in answers]
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


# Relaying the gateway's requests ---------------------------------------------------------------


JSON = "application/json"
_JSON_TYPE = b"Content-Type: application/json\r\n"
_HEADER_VALUE = re.compile(r"[\x20-\x7e]{1,256}")


def _content_type(value: str) -> bytes:
    """The Content-Type header line; ValueError for a value no header may hold (a line break)."""
    if value == JSON:
        return _JSON_TYPE
    if not _HEADER_VALUE.fullmatch(value):
        raise ValueError(f"not a content type: {value[:80]!r}")
    return b"Content-Type: " + value.encode("ascii") + b"\r\n"


class RelayError(Exception):
    """The server broke an answer off: closed the connection, wrote what is not HTTP, fell silent."""


class _Dropped(RelayError):
    """The connection closed before the first byte of an answer."""


class Relay:
    """POSTs to one server over kept-alive HTTP/1.1 connections; an answer's body is passed on as
    it comes (chunked transfer decoded, nothing else touched).

    Written on asyncio and httptools (the C parser uvicorn serves with, in the agent's install)
    rather than httpx, whose layers cost about 1 ms of CPU a request: most of what the agent's hop
    added. Timeouts as the agent's own client: 5 s to connect, 600 s between bytes."""

    HIGH_WATER = 1 << 18  # bytes held for a slow reader before the server is asked to wait

    def __init__(
        self, url: str, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0, keepalive_s: float = 4
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.ssl else 80)
        self.base = parts.path.rstrip("/")
        self.host_header = b"Host: " + parts.netloc.rpartition("@")[2].encode("idna") + b"\r\n"
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        # Idle connections are let go before the 5 s after which uvicorn (vLLM, SGLang) and
        # llama.cpp's server close theirs, so that few close under a request going out.
        self.keepalive_s = keepalive_s
        self.idle: deque[tuple[_Connection, float]] = deque()  # the most recently used last
        self.connections: set[_Connection] = set()
        self._lines: dict[str, bytes] = {}

    async def post(self, path: str, body: bytes, content_type: str = JSON) -> RelayResponse:
        """The server's answer once its status and headers are in. OSError when it cannot be
        reached, RelayError when it does not answer. `content_type`: the body's, passed on as the
        gateway gave it (a multipart upload's names its boundary)."""
        head = self._line(path) + _content_type(content_type) + b"Content-Length: %d\r\n\r\n" % len(body)
        conn = self._take()
        if conn is not None:
            try:
                return await conn.request(head + body)
            except _Dropped:
                # A server may close a kept-alive connection just as a request goes out on it
                # (llama.cpp's does after some streams): it never read the request, so it is sent
                # once more, on a new connection. A new connection that drops one is an error.
                pass
        conn = await self._connect()
        return await conn.request(head + body)

    def close(self) -> None:
        for conn in list(self.connections):
            conn.abort()
        self.idle.clear()

    def _line(self, path: str) -> bytes:
        line = self._lines.get(path)
        if line is None:
            if len(self._lines) > 64:  # paths come from the gateway: a handful
                self._lines.clear()
            target = urllib.parse.quote(self.base + path, safe="/:@!$&'()*+,;=-._~%").encode()
            line = self._lines[path] = b"POST " + target + b" HTTP/1.1\r\n" + self.host_header
        return line

    def _take(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self.idle:
            conn, since = self.idle.pop()
            if conn.open() and now - since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    def _give_back(self, conn: _Connection) -> None:
        now = asyncio.get_running_loop().time()
        self.idle.append((conn, now))
        while self.idle and not (self.idle[0][0].open() and now - self.idle[0][1] < self.keepalive_s):
            self.idle.popleft()[0].abort()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                lambda: _Connection(self, loop), self.host, self.port, ssl=self.ssl
            )
        return conn


class RelayResponse:
    """One answer: status, content type, length (None: not known ahead), and the body's chunks
    (async iteration, as they arrive). release() once done with it, read whole or not."""

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.content_type = conn.content_type
        self.length = conn.length

    def __aiter__(self) -> RelayResponse:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise StopAsyncIteration
        while not conn.buffer:
            if conn.complete:
                raise StopAsyncIteration
            if conn.error is not None:
                raise RelayError(*conn.error.args)
            await conn.wait()
        return conn.take()

    def finished(self) -> bool:
        """Whole and read: no chunk follows the last one taken."""
        return self._conn is None or (self._conn.complete and not self._conn.buffer)

    def abort(self, why: str) -> None:
        """Break the answer off now: the server sees its connection close, a reader gets RelayError."""
        if self._conn is not None:
            self._conn.fail(RelayError(why))
            self._conn.abort()

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()


class _Connection(asyncio.Protocol):
    """One connection to the server, parsing its answers as they come (httptools calls the on_*)."""

    def __init__(self, relay: Relay, loop: asyncio.AbstractEventLoop) -> None:
        self.relay, self.loop = relay, loop
        self.transport: asyncio.Transport | None = None
        self.buffer: list[bytes] = []  # the body's pieces not read yet
        # The parser hands each piece of body straight to the list: no Python call per piece
        # (a stream's every event is one).
        self.on_body: Callable[[bytes], None] = self.buffer.append
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False  # a request is out on it
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = b"application/json"
        self.length: int | None = None
        self.framed = False  # its end is marked (a length or chunks), not the connection's close
        self.head = self.complete = self.received = self.informational = False
        self.keep_alive = False
        self.error: RelayError | None = None
        self.buffer.clear()
        self.size = 0  # bytes received since the reader last took some (a watermark)
        self.last = self.loop.time()

    # Requests ---------------------------------------------------------------------------------

    def open(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    async def request(self, data: bytes) -> RelayResponse:
        assert self.transport is not None
        self._reset()
        self.busy = True
        self.timer = self.loop.call_at(self.last + self.relay.read_timeout_s, self._check_silence)
        self.transport.write(data)
        try:
            while not self.head:
                if self.error is not None:
                    raise self.error
                await self.wait()
        except BaseException:  # cancelled too: the server sees the request go away
            self.abort()
            raise
        return RelayResponse(self)

    async def wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take(self) -> bytes:
        data = self.buffer[0] if len(self.buffer) == 1 else b"".join(self.buffer)
        self.buffer.clear()
        self.size = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def finish(self) -> None:
        """The request is over: the connection goes back to the pool if its answer ended cleanly."""
        self.busy = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.buffer.clear()
        if self.complete and self.keep_alive and self.error is None and self.open():
            if self.paused and self.transport is not None:
                self.paused = False
                self.transport.resume_reading()
            self.relay._give_back(self)
        else:
            self.abort()

    def fail(self, error: RelayError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self._wake()

    def abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _check_silence(self) -> None:
        self.timer = None
        if not self.busy or self.complete or self.error is not None:
            return
        now, due = self.loop.time(), self.last + self.relay.read_timeout_s
        if self.paused:  # the reader is slow, not the server
            self.timer = self.loop.call_at(now + self.relay.read_timeout_s, self._check_silence)
            return
        if now < due:
            self.timer = self.loop.call_at(due, self._check_silence)
            return
        self.fail(RelayError(f"the server sent nothing for {self.relay.read_timeout_s:g} s"))
        self.abort()

    # asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without the class
        self.relay.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes no request asked for: this connection cannot be trusted again
            self.abort()
            return
        self.received = True
        self.last = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self.fail(RelayError(f"the server's answer is not HTTP: {err}"))
            self.abort()
            return
        if self.buffer:
            self.size += len(data)
            if self.size > Relay.HIGH_WATER and not self.paused and self.transport is not None:
                self.paused = True  # the reader is slow: let the server wait rather than hold it all
                self.transport.pause_reading()
            self._wake()

    def eof_received(self) -> bool | None:
        return None  # close: HTTP/1.1 has no half-closed connections worth keeping

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.relay.connections.discard(self)
        if self.busy and not self.complete:
            if self.head and not self.framed:  # an answer that ends with its connection
                self.complete = True
            else:
                why = f" ({exc})" if exc else ""
                if not self.received:
                    self.fail(_Dropped(f"the server closed the connection without answering{why}"))
                else:
                    self.fail(RelayError(f"the server closed the connection mid-answer{why}"))
        self._wake()

    # httptools ---------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value
        elif name == b"content-length":
            self.length = int(value)  # the parser has checked it is digits
        elif name == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the answer is still to come
            self.informational = True
            self.content_type, self.length, self.framed = b"application/json", None, False
            return
        self.status = status
        self.head = True
        self.framed = self.framed or self.length is not None
        self._wake()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._wake()


def _gauges(metrics: str, names: tuple[str, ...]) -> int | None:
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


def _names(listing: Any) -> list[str] | None:
    """The model names in Ollama's /api/tags or /api/ps answer; None when it is not one."""
    models = dig(listing, "models")
    if not isinstance(models, list):
        return None
    return [str(m["name"]) for m in models if isinstance(m, dict) and isinstance(m.get("name"), str)]


def _router_states(listing: Any) -> dict[str, str] | None:
    """Each model's state in llama.cpp's router's GET /models (loaded, loading, unloaded, sleeping,
    downloading); None when the answer is not one."""
    data = dig(listing, "data")
    if not isinstance(data, list):
        return None
    return {
        str(m["id"]): str(dig(m, "status", "value"))
        for m in data
        if isinstance(m, dict) and isinstance(m.get("id"), str)
    }


def _router_entry(listing: Any, model: str) -> Any:
    data = dig(listing, "data")
    return next((m for m in data if dig(m, "id") == model), None) if isinstance(data, list) else None


def _refusal(resp: httpx.Response) -> str:
    """Why the server did not load a model, from its error answer: one printable line of 200 at most."""
    try:
        said = dig(resp.json(), "error")
        said = dig(said, "message") if isinstance(said, dict) else said
    except ValueError:
        said = None
    why = f"the server did not load it: HTTP {resp.status_code}"
    why += f" {said}" if isinstance(said, str) else ""
    return re.sub(r"[\x00-\x1f\x7f]+", " ", why)[:200]


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


def _silence(seconds: float = 0.25, rate: int = 16_000) -> bytes:
    """A WAV file of silence: what a transcription model is warmed up on."""
    out = io.BytesIO()
    with wave.open(out, "wb") as audio:
        audio.setnchannels(1)
        audio.setsampwidth(2)
        audio.setframerate(rate)
        audio.writeframes(b"\0\0" * int(seconds * rate))
    return out.getvalue()


SILENCE = _silence()


def _warm_ups(model: str) -> list[tuple[Route, dict[str, Any]]]:
    """A small request on each route but chat (the warm-up's first choice), as httpx's arguments."""
    return [
        ("completions", {"json": {"model": model, "prompt": "One, two,", "max_tokens": 4, "temperature": 0}}),
        ("embeddings", {"json": {"model": model, "input": "warm-up"}}),
        ("rerank", {"json": {"model": model, "query": "warm-up", "documents": ["warm-up"]}}),
        ("score", {"json": {"model": model, "text_1": "warm-up", "text_2": "warm-up"}}),
        (
            "audio/transcriptions",
            {"files": {"file": ("warm-up.wav", SILENCE, "audio/wav")}, "data": {"model": model}},
        ),
        ("audio/speech", {"json": {"model": model, "input": "Warm-up."}}),
    ]
