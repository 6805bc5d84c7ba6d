"""The agent's life: check the backend, register, heartbeat, and drain on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pynvml

from neuralgrid import __version__
from neuralgrid.agent import gpu
from neuralgrid.agent.backend import Backend, ServerInfo
from neuralgrid.agent.front import FrontState, create_front
from neuralgrid.agent.servers.base import BackendError, BackendStarting
from neuralgrid.agent.tunnel import TunnelClient
from neuralgrid.protocol import signing
from neuralgrid.protocol.nodes import AgentStatus, BackendInfo, Heartbeat, NodeRegistration
from neuralgrid.protocol.regions import located
from neuralgrid.protocol.routes import Route, root_url
from neuralgrid.server.serving import CannotListen, make_server, running

log = logging.getLogger(__name__)
REPROBE_EVERY = 6  # heartbeats between looks at the backend's models
# An idle connection to the gateway is kept past a heartbeat interval (5 s by default: at httpx's
# 5 s each beat opened a new one), and let go before the gateway lets go of it (its KEEPALIVE_S),
# so that no beat is sent on a connection the gateway is closing.
HEARTBEAT_KEEPALIVE_S = 10.0
DEFAULT_CONCURRENCY = 4  # when neither the server nor the owner says
STARTUP_WAIT_S = 300  # how long a server that is starting may take (a big model loads for minutes)
STARTUP_RETRY_S = 2.0


class AgentError(Exception):
    """Something the owner must fix before the node can join; the message says what."""


@dataclass(frozen=True)
class AgentConfig:
    gateway_url: str  # one gateway's URL, or several separated by commas (tried in turn)
    token: str
    backend_url: str
    name: str
    region: str
    price_usd_per_hour: float
    max_concurrency: int | None = None  # None: what the server runs at once (else 4)
    listen_host: str = "127.0.0.1"
    listen_port: int = 8001
    public_url: str | None = None
    gpu_model: str | None = None
    vram_gb: float | None = None
    tflops: float | None = None
    latitude: float | None = None
    longitude: float | None = None
    drain_timeout_s: float = 60.0
    tunnel: bool = False  # dial out to the gateway instead of listening (for nodes behind NAT)
    model_aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # served name -> catalog id
    routes: tuple[Route, ...] | None = None  # the owner's list of routes served (None: detected)
    # Heartbeats to this URL instead of the gateways (the `heartbeat` Edge Function of a Supabase
    # project, which takes the gateway's heartbeat path): a direct-mode node stays alive through
    # Supabase alone once registered.
    heartbeat_url: str | None = None


@dataclass(frozen=True)
class Specs:
    """The node's machine: its GPUs, and the requests its server runs at once (once it is found)."""

    gpu_model: str
    gpu_count: int
    vram_gb: float
    tflops: float
    max_concurrency: int | None = None


def resolve_specs(config: AgentConfig) -> Specs:
    """The GPU as NVML reports it (flags override); without a GPU, only explicit flags."""
    try:
        found = gpu.detect()
    except gpu.NoGpu as err:
        if config.gpu_model and config.vram_gb and config.tflops:
            return Specs(config.gpu_model, 1, config.vram_gb, config.tflops)
        raise AgentError(f"{err}; describe this machine with --gpu-model, --vram-gb and --tflops") from err
    tflops = config.tflops or found.tflops
    if tflops is None:
        raise AgentError(f"no TFLOPS figure for {found.model}: pass --tflops (dense FP16)")
    return Specs(config.gpu_model or found.model, found.count, config.vram_gb or found.vram_total_gb, tflops)


def gateway_urls(value: str) -> list[str]:
    """The gateways an agent may talk to: `--gateway` holds one URL or several, comma-separated."""
    urls = [root_url(url) for url in value.split(",") if url.strip()]
    if not urls:
        raise AgentError("--gateway names no gateway")
    return urls


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.gateways = gateway_urls(config.gateway_url)
        self._gateway = 0  # the gateway that answered last: asked first next time
        self.backend = Backend(config.backend_url, routes=config.routes)
        self.front = FrontState(self.backend, {v: k for k, v in config.model_aliases.items()})
        self.node_id: str | None = None
        self._beats_failing = False  # the last heartbeat did not reach a gateway: say when one does
        self.secret: str | None = None
        self.interval_s = 5.0
        self._tunnel_task: asyncio.Task[None] | None = None
        # Pre-warm: the models a server that loads on demand can load (catalog names; None for one that
        # serves what it started with), the load under way (one at a time), and the answers the next
        # heartbeat carries.
        self.available: list[str] | None = None
        self._loading: asyncio.Task[None] | None = None
        self._loaded: list[str] = []
        self._refused: list[dict[str, str]] = []
        self._prewarm_heard = False  # the gateway has answered with `load`: it takes the answers
        self.beat_refused = False  # the gateway refused the last heartbeat as wrong (a 4xx)

    @property
    def endpoint_url(self) -> str:
        if self.config.tunnel:
            return f"tunnel:{self.config.name}"
        return self.config.public_url or f"http://{self.config.listen_host}:{self.config.listen_port}"

    async def run(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(keepalive_expiry=HEARTBEAT_KEEPALIVE_S)
        async with httpx.AsyncClient(timeout=10, limits=limits) as http:
            await self._check_gateway(http)  # before a warm-up that may load a model for minutes
            try:
                models = await self._first_ready(stop)
            except (BackendError, httpx.HTTPError, ValueError) as err:
                await self.backend.aclose()
                raise AgentError(str(err)) from err
            specs = dataclasses.replace(resolve_specs(self.config), max_concurrency=self._concurrency())
            async with self._reachable():
                await self._register(http, specs, models)
                tunnel = self._start_tunnel() if self.config.tunnel else None
                log.info(
                    "node %s registered as %s (%s, %d at once); heartbeat every %ss",
                    self.config.name,
                    self.node_id,
                    self.backend.info.kind,
                    specs.max_concurrency,
                    self.interval_s,
                )
                models = await self._beat(http, stop, models, specs)
                await self._drain(http, models)
                if tunnel is not None and self._tunnel_task is not None:
                    tunnel.close.set()
                    await self._tunnel_task

    async def _first_ready(self, stop: asyncio.Event) -> list[str]:
        """_ready(), once the server is up: an agent started with its server, or before it, waits up
        to STARTUP_WAIT_S for it to listen and load its model (llama-server answers 503 meanwhile)."""
        deadline = time.monotonic() + STARTUP_WAIT_S
        while True:
            try:
                return await self._ready()
            except BackendStarting as err:
                if time.monotonic() > deadline or stop.is_set():
                    raise
                log.warning("%s: waiting for it (up to %d s in all)", err, STARTUP_WAIT_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=STARTUP_RETRY_S)

    async def _ready(self) -> list[str]:
        """Detect the server, warm its models up and verify what it does; the warm models, under
        their catalog names. BackendError when it cannot serve at all."""
        info = await self.backend.detect()
        served = await self.backend.models()
        paths = [m for m in served if m not in self.config.model_aliases and _is_file_path(m)]
        if paths:  # llama-server names a model by the path it loaded it from, unless given an alias
            raise BackendError(
                f"the backend names its model by its file path ({paths[0]}), which every developer would"
                f" see in /v1/models: give --model-alias {paths[0]}=ORG/MODEL, the catalog's name for it"
            )
        states = await self.backend.model_states()
        # A server that loads models on demand is warmed up on what it holds (else its first model):
        # warming every model up would load them all.
        info, warm = await self.backend.verify(served if states is None else states[0] or served[:1])
        if not warm:
            refusal = self.backend.refusal
            # llama-server lists its model while it loads it, and answers 503 until then.
            if refusal is not None and refusal.status == 503:
                raise BackendStarting(f"the backend at {self.config.backend_url} is starting: {refusal}")
            said = f"; the server's answer: {refusal}" if refusal else ""
            raise BackendError(
                f"the backend at {self.config.backend_url} serves {served} but none answered{said}"
            )
        log.info("backend: %s; warm: %s", info, warm)
        self.available = None if states is None else self._catalog([m for m in served if m not in warm])
        return self._catalog(warm)

    def _catalog(self, served: list[str]) -> list[str]:
        """The server's names for models, as the catalog's ids."""
        return [self.config.model_aliases.get(m, m) for m in served]

    async def _beat(
        self, http: httpx.AsyncClient, stop: asyncio.Event, models: list[str], specs: Specs
    ) -> list[str]:
        """Heartbeat until told to stop; returns the warm models last reported. Each beat checks the
        server's health first: a server that refuses or errs takes the node out within that beat, one
        that stays silent within two. Back up, it is detected and warmed up again (once nothing of ours
        runs on it) before it takes work. Nothing the server answers can stop the beats."""
        beats, up, slow, reported, changed = 0, True, False, None, None
        while not stop.is_set():
            try:
                health = await self.backend.health()
                if health == "down" or (health == "slow" and slow):
                    if up:
                        log.warning("the backend stopped answering: the node takes no work until it is back")
                    up = False
                elif health == "up" and not up and not self.front.inflight:
                    async with self.front.own_turn():  # its warm-up is requests too
                        models, up = await self._ready(), True
                    log.info("the backend is back: the node takes work again")
                    changed = self._specs_if_changed(specs)  # restarted with another -np, say
                elif health == "up" and beats % REPROBE_EVERY == 0 and beats and not self.front.busy():
                    async with self.front.own_turn():
                        await self.backend.reread_parallel()  # back within a beat with another -np
                        models = await self._models_or(models)
                    changed = self._specs_if_changed(specs)
                if up and self.available is not None:  # it loads and lets go of models itself: every beat
                    models = await self._states(models)
                slow = health == "slow"
            except Exception as err:  # a server answering nonsense is a server that is not ready
                log.warning("the backend is not ready: %r", err)
                up = False
            backend = self.backend.info if self.backend.info != reported else None
            sent = changed  # the slots only when they changed: a gateway before they could refuses them
            if changed is not None and changed.max_concurrency == specs.max_concurrency:
                sent = dataclasses.replace(changed, max_concurrency=None)
            load = await self._heartbeat(http, "online", models, sent, up=up, backend=backend)
            # Said once the gateway has them, so a lost beat says them again; not after a refusal (an
            # older gateway may not know a field: said every beat, refused every beat, the node out).
            if load is not None or self.beat_refused:
                reported, specs, changed = self.backend.info, changed or specs, None
            if load is not None and up:
                self._prewarm(load, models)
            beats += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
        return models

    async def _states(self, previous: list[str]) -> list[str]:
        """What a server that loads on demand holds now: its loaded models (returned) and the ones it
        can load (self.available), as catalog ids; the previous figures if it cannot say."""
        try:
            states = await self.backend.model_states()
        except (BackendError, httpx.HTTPError) as err:
            log.warning("%s; keeping the models reported before", err)
            return previous
        if states is None:
            return previous
        self.available = self._catalog(states[1])
        return self._catalog(states[0])

    def _prewarm(self, load: list[str], models: list[str]) -> None:
        """Start loading what the platform asked for, as a task (heartbeats go on meanwhile). One
        load at a time: the platform says it again in every reply until the answer reaches it."""
        if not load or (self._loading is not None and not self._loading.done()):
            return
        model = load[0]
        if model in self._loaded or any(r["model"] == model for r in self._refused):
            return  # answered already: the next heartbeat says so
        if model in models:
            self._loaded.append(model)
        elif not self.front.busy():  # else asked again next beat, when it may be idle
            self._loading = asyncio.create_task(self._load(model))

    async def _load(self, model: str) -> None:
        served = self.front.served_names.get(model, model)
        try:
            async with self.front.own_turn():  # a load is a request: it would cut a running stream
                why = await self.backend.load(served)
        except Exception as err:  # whatever went wrong, the platform hears of it and stops asking
            why = f"the load failed: {err!r}"[:200]
        if why is None:
            log.info("pre-warm: %s is loaded, as the platform asked", model)
            self._loaded.append(model)
        else:
            log.info("pre-warm: %s not loaded: %s", model, why)
            self._refused.append({"model": model, "reason": why})

    def _concurrency(self) -> int:
        """Requests at once: what the server runs at once, capped by the owner's --max-concurrency."""
        parallel, asked = self.backend.info.parallel, self.config.max_concurrency
        if parallel is None:
            return asked or DEFAULT_CONCURRENCY
        return min(parallel, asked) if asked else parallel

    def _start_tunnel(self) -> TunnelClient:
        assert self.node_id is not None and self.secret is not None
        tunnel = TunnelClient(self.gateways, self.node_id, self.secret, self.front)
        self._tunnel_task = asyncio.create_task(tunnel.run())
        return tunnel

    @contextlib.asynccontextmanager
    async def _reachable(self) -> AsyncIterator[None]:
        """Direct mode: serve the signed front on a port. Tunnel mode: nothing to listen on."""
        if self.config.tunnel:
            try:
                yield
            finally:
                await self.backend.aclose()
            return
        # The front trusts signatures, not addresses: no X-Forwarded-* headers to read per request.
        server = make_server(
            create_front(self.front), self.config.listen_host, self.config.listen_port, proxy_headers=False
        )
        try:
            async with running(server):
                yield
        except CannotListen as err:
            raise AgentError(str(err)) from err
        finally:
            await self.backend.aclose()

    async def _check_gateway(self, http: httpx.AsyncClient) -> None:
        """A gateway answers and takes the key, or AgentError says which is wrong."""
        try:
            resp = await self._ask(http, "GET", "/v1/models", self.config.token)
        except httpx.HTTPError as err:
            raise AgentError(f"the gateway at {self.config.gateway_url} is unreachable: {err!r}") from err
        if resp.status_code in (401, 403):
            raise AgentError(f"the gateway refused the key: {_message(resp)}")
        if resp.status_code != 200 or not _is_gateways_model_list(resp):
            raise AgentError(
                f"{resp.url.copy_with(path='/')} is not a NeuralGrid gateway"
                f" (GET /v1/models answered {resp.status_code}): check --gateway"
            )

    async def _register(self, http: httpx.AsyncClient, specs: Specs, models: list[str]) -> None:
        parallel = self.backend.info.parallel
        if parallel is not None and self.config.max_concurrency and self.config.max_concurrency > parallel:
            log.warning(
                "--max-concurrency %d is more than the %d requests the %s server runs at once: using %d",
                self.config.max_concurrency,
                parallel,
                self.backend.info.kind,
                parallel,
            )
        latitude, longitude, where = located(self.config.region, self.config.latitude, self.config.longitude)
        log.info("%s", where)
        # The gateway's own model of a registration, unvalidated here: the gateway judges it.
        body = NodeRegistration.model_construct(
            name=self.config.name,
            gpu_model=specs.gpu_model,
            gpu_count=specs.gpu_count,
            vram_gb=specs.vram_gb,
            tflops=specs.tflops,
            hourly_rate=self.config.price_usd_per_hour,
            region=self.config.region,
            latitude=latitude,
            longitude=longitude,
            endpoint_url=self.endpoint_url,
            max_concurrency=self._concurrency(),
            models=models,
            agent_version=__version__,
            backend=BackendInfo.model_construct(**self.backend.info.as_json()),
        ).model_dump()
        try:
            resp = await self._ask(http, "POST", "/v1/nodes", self.config.token, body)
        except httpx.HTTPError as err:
            raise AgentError(f"the gateway at {self.config.gateway_url} is unreachable: {err!r}") from err
        if resp.status_code != 201:
            raise AgentError(f"the gateway refused the registration: {_message(resp)}")
        answer = resp.json()
        self.node_id, self.secret = answer["node_id"], answer["node_secret"]
        self.interval_s = float(answer["heartbeat_interval_s"])
        # The key the gateways sign this node's requests with (a gateway before it signed with the
        # secret's hash, which its database holds).
        key = answer.get("request_key")
        self.front.key = (
            bytes.fromhex(key) if isinstance(key, str) else signing.node_key(answer["node_secret"])
        )

    def _specs_if_changed(self, current: Specs) -> Specs | None:
        """The node's specs when they differ from `current` (the ones the platform has): its GPUs as
        NVML sees them now, and the requests its server runs at once as last found."""
        try:
            gpus = resolve_specs(self.config)
        except (AgentError, pynvml.NVMLError):  # a failing GPU must not stop the heartbeats
            gpus = current
        now = dataclasses.replace(gpus, max_concurrency=self._concurrency())
        if now.max_concurrency != current.max_concurrency:
            slots = now.max_concurrency
            log.info(
                "the %s server now runs %d request%s at once (it ran %s): the node takes as many",
                self.backend.info.kind,
                slots,
                "" if slots == 1 else "s",
                current.max_concurrency,
            )
        return None if now == current else now

    async def _heartbeat(
        self,
        http: httpx.AsyncClient,
        status: AgentStatus,
        models: list[str],
        specs: Specs | None = None,
        *,
        up: bool = True,
        backend: ServerInfo | None = None,
    ) -> list[str] | None:
        """Send one heartbeat; None when the gateway did not take it (beat_refused: it refused what
        the beat said), else the models it asks the node to pre-load (none or one)."""
        self.beat_refused = False
        load = gpu.load()
        queued = await self.backend.queue_depth() if up else None
        beat = Heartbeat.model_construct(
            status=status,
            queue_depth=max(self.front.inflight, queued or 0),
            models=models if up else [],
            gpu_utilization=load[0] if load else None,
            free_vram_gb=load[1] if load else None,
            backend_up=up,
        )
        body = beat.model_dump(exclude={"specs", "backend", "available", "loaded", "refused"})
        if specs is not None:  # only when they changed since registration
            body["specs"] = {k: v for k, v in dataclasses.asdict(specs).items() if v is not None}
        if backend is not None:  # only when it changed
            body["backend"] = BackendInfo.model_construct(**backend.as_json()).model_dump()
        # Pre-warm's fields go only to a gateway that knows them (it answered with `load`): an older
        # one refuses fields it does not know.
        loaded, refused = self._loaded[:16], self._refused[:16]
        if self._prewarm_heard:
            if up:  # a server that serves what it started with can load nothing: its old models go
                body["available"] = self.available if self.available is not None else []
            body.update({"loaded": loaded, "refused": refused} if loaded or refused else {})
        assert self.secret is not None
        path = f"/v1/nodes/{self.node_id}/heartbeat"
        try:
            if self.config.heartbeat_url:
                auth = {"authorization": f"Bearer {self.secret}"}
                resp = await http.post(self.config.heartbeat_url.rstrip("/") + path, json=body, headers=auth)
            else:
                resp = await self._ask(http, "POST", path, self.secret, body)
        except httpx.HTTPError as err:  # every gateway is away for a moment: try again next beat
            log.warning("heartbeat failed: %r", err)
            self._beats_failing = True
            return None
        if self._beats_failing:
            self._beats_failing = False
            log.info("heartbeat: the gateway answers again")
        # Its secret is no longer the node's: another agent registered it (403 from a gateway, 401
        # from the heartbeat Edge Function).
        if resp.status_code in (401, 403):
            raise AgentError(
                f"node {self.config.name} was registered again by another agent (its secret is not this"
                " agent's any more): this one stops"
            )
        self.beat_refused = 400 <= resp.status_code < 500  # what it said is wrong: not to be said again
        if resp.status_code != 200:
            log.warning("heartbeat refused: %s", _message(resp))
            return None
        if self._prewarm_heard:  # the answers reached the platform
            del self._loaded[: len(loaded)], self._refused[: len(refused)]
        return self._load_asked(resp)

    def _load_asked(self, resp: httpx.Response) -> list[str]:
        """The models a heartbeat's reply asks the node to pre-load (`load`; absent from older gateways)."""
        try:
            load = resp.json().get("load")
        except (ValueError, AttributeError):
            return []
        self._prewarm_heard = self._prewarm_heard or isinstance(load, list)
        return [m for m in load if isinstance(m, str)] if isinstance(load, list) else []

    async def _ask(
        self, http: httpx.AsyncClient, method: str, path: str, token: str, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        """Ask the gateway that answered last, else the next that answers (any gateway will do:
        they share the database); raises the last one's error when none answers."""
        count = len(self.gateways)
        for turn in range(count):
            index = (self._gateway + turn) % count
            try:
                resp = await http.request(
                    method,
                    self.gateways[index] + path,
                    json=body,
                    headers={"authorization": f"Bearer {token}"},
                )
            except httpx.HTTPError:
                if turn < count - 1:
                    continue
                raise
            self._gateway = index
            return resp
        raise AgentError("no gateway to ask")  # gateway_urls() gives at least one

    async def _models_or(self, previous: list[str]) -> list[str]:
        """The server's models now, under catalog names; the previous list if it cannot say."""
        before = set(self.backend.served)
        try:
            served = await self.backend.models()
        except BackendError as err:
            log.warning("%s; keeping the models reported before", err)
            return previous
        if set(served) != before:  # restarted with other models between two beats: as a new server
            log.info("the backend now serves %s (it served %s): detecting it again", served, sorted(before))
            return await self._ready()
        # Only models that have answered are warm.
        return [m for m in (self.config.model_aliases.get(s, s) for s in served) if m in previous]

    async def _drain(self, http: httpx.AsyncClient, models: list[str]) -> None:
        """Take no new work, finish what is running, then go offline."""
        self.front.draining = True
        if self._loading is not None:  # a pre-load is no use to a node on its way out
            self._loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loading
        await self._heartbeat(http, "draining", models)
        deadline = asyncio.get_running_loop().time() + self.config.drain_timeout_s
        while self.front.inflight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        # Offline, nothing is warm: its server may well be stopped next (found: a drained node kept
        # listing its models warm).
        if await self._heartbeat(http, "offline", []) is not None:
            log.info("node %s drained and offline", self.config.name)
        else:
            log.warning("node %s drained; the gateway did not take its last heartbeat", self.config.name)


def _is_gateways_model_list(resp: httpx.Response) -> bool:
    """A gateway's GET /v1/models: OpenAI's list, each model saying whether the catalog has it (an
    inference server's own list, a URL mistaken for the gateway's, does not)."""
    try:
        models = resp.json()["data"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(models, list) and all(isinstance(m, dict) and "in_catalog" in m for m in models)


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}"


def _is_file_path(name: str) -> bool:
    """A model name that is where its file lies (llama-server's default), not what the model is (a
    repository's file, `org/X-GGUF/x.Q4_K_M.gguf`, is a name)."""
    return name.startswith(("/", "~", "./", "../")) or "\\" in name
