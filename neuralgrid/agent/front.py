"""The agent's way to its server, for requests from the gateway (direct mode: an HTTP front on a
port, where only requests signed by the gateway get through; tunnel mode: tunnel.py).

Only the routes the node advertises (Backend.info.serves()) reach the server; any other path is
refused here. On the way in, a catalog model id in a JSON body is turned back into the name the
server serves it under (other bodies, a multipart upload, pass unchanged, with their content type).
On the way out, the answer is renamed back and given exact usage where the server sent none
(answers.py): the gateway bills tokens, never events.

The hop is meant to cost next to nothing: the front is a bare ASGI app (Starlette's routing,
middleware and streaming response cost more per request than the relaying itself), the server is
reached through Backend.relay (kept-alive connections, a C parser), and bodies pass through as
bytes: a request is parsed only when it may need renaming or counting, an answer's events only
when they must be renamed or, once the server has not sent usage by its end, counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from neuralgrid.agent.answers import counted_body, json_object, rewritten_body, rewritten_events, text_answers
from neuralgrid.agent.backend import Backend
from neuralgrid.agent.gpu_probe import GpuProbeHost
from neuralgrid.agent.relay import JSON, RelayError, RelayResponse
from neuralgrid.agent.servers.base import CACHE_FIELDS, dig
from neuralgrid.protocol import signing
from neuralgrid.protocol.routes import route_of
from neuralgrid.server.serving import Abort
from neuralgrid.verify import gpu_probe

log = logging.getLogger(__name__)

KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# The largest request the front reads: a gateway's is at most its NEURALGRID_MAX_BODY_BYTES (1 MiB by
# default), or a dropped stream's conversation and its answer so far. Anyone can reach the port.
MAX_REQUEST_BYTES = 16 << 20
UNSIGNED = "requests to this node must be signed by the NeuralGrid gateway"
TOO_LARGE = f"a request to this node is at most {MAX_REQUEST_BYTES >> 20} MiB"


class BackendUnreachable(Exception):
    """The server did not take the request (refused, reset, timed out before answering)."""


class Refused(Exception):
    """A request the agent does not pass on: a route the node does not advertise, a bad header."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# A header value: printable ASCII, no line break (the relay writes it into the server's request).
_HEADER_VALUE = re.compile(r"[\x20-\x7e]{1,256}")


class Answer:
    """The server's answer as it starts: status, media type, length (None: not known ahead), and its
    body's chunks. Whoever takes it must aclose() it, read or not: that ends the request (its slot
    here, its connection there)."""

    def __init__(self, state: FrontState, path: str, upstream: RelayResponse, holds_turn: bool) -> None:
        self.state, self.path, self.upstream, self.holds_turn = state, path, upstream, holds_turn
        self.status = upstream.status
        self.media_type = upstream.content_type.decode("latin-1")
        self.length = upstream.length
        self.chunks: AsyncIterator[bytes] = upstream
        self.closed = False
        self.given_up = False

    def give_up(self, _: object = None) -> None:
        """The gateway hung up: end the server's answer now (the server stops generating)."""
        if not self.closed:
            self.given_up = True
            self.upstream.abort("the gateway hung up")

    def broken(self, err: RelayError) -> None:
        """The server broke this answer off (it died, or fell silent): the owner's log says so in a
        line, as an event on the node, not a fault of the agent's."""
        log.warning("the server broke its answer to %s off: %s", self.path, err)

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.upstream.release()
            self.state.ended(self.holds_turn)


@dataclass
class FrontState:
    backend: Backend
    served_names: dict[str, str] = field(default_factory=dict)  # catalog id -> the server's name
    key: bytes | None = None  # set once registered
    signatures: signing.Verifier = field(default_factory=signing.Verifier)  # remembers nonces
    gpu: GpuProbeHost | None = None  # answers the gateway's GPU probe (None: not yet detected)
    inflight: int = 0
    draining: bool = False
    served: int = 0
    # A server that ends a running stream for any new request (Backend.info.interrupts) gets one
    # request at a time from this agent, the gateway's or the agent's own: the others wait their turn.
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def fragile(self) -> bool:
        return self.backend.info.interrupts

    def busy(self) -> bool:
        """A fragile server is running (or about to run) someone's request: do not look at it now."""
        return self.fragile and (self.inflight > 0 or self.turn.locked())

    @contextlib.asynccontextmanager
    async def own_turn(self) -> AsyncIterator[None]:
        """For the agent's own requests to the server (probes, warm-ups, loads): on a fragile
        server, taken between the gateway's requests, which wait meanwhile."""
        if not self.fragile:
            yield
            return
        async with self.turn:
            yield

    def ended(self, held_turn: bool) -> None:
        """A request of the gateway's has ended here."""
        self.inflight -= 1
        if held_turn:
            self.turn.release()

    async def probe(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """The gateway's GPU probe (gpu_probe.PATH): answered by the agent, never by the server."""
        if self.gpu is None:
            self.gpu = await asyncio.to_thread(GpuProbeHost.detect)
        return await self.gpu.answer(body)

    def check(self, path: str, content_type: str) -> None:
        """Refused unless `path` is a route the node advertises and the content type is a header."""
        route = route_of(path)
        if route is None or route not in self.backend.info.serves():
            raise Refused(404, f"this node does not serve {path[:100]}")
        if not _HEADER_VALUE.fullmatch(content_type):
            raise Refused(400, "the request's content type is not a valid header value")

    async def forward(self, path: str, body: bytes, content_type: str = JSON) -> Answer:
        """Send a gateway's request to the server. The caller must aclose() the answer. Refused
        for a route the node does not advertise."""
        self.check(path, content_type)
        request: dict[str, Any] | None = None
        renamed: tuple[str, str] | None = None
        kind = self.backend.kind
        # Only a request with an alias to resolve or a cache field its server does not take is read.
        foreign = [f for f, named in _CACHE_FIELDS if f not in kind.cache_fields and named in body]
        defaults = kind.openai_defaults if path in GENERATES else {}
        if (self.served_names or foreign or defaults) and content_type == JSON:
            request = json_object(body)
        if request is not None:
            dropped = [field for field in foreign if field in request]
            catalog_id = request.get("model")
            served = self.served_names.get(catalog_id) if isinstance(catalog_id, str) else None
            undone = {k: v for k, v in defaults.items() if k not in request}
            if dropped or served is not None or undone:
                request = {k: v for k, v in request.items() if k not in dropped} | undone
                if served is not None:
                    request["model"] = served
                    renamed = (served, str(catalog_id)) if served != catalog_id else None
                body = json.dumps(request).encode()
        if path == "/v1/completions" and not self.backend.info.echoes and b'"echo"' in body:
            request = request if request is not None else json_object(body)
            if request is not None and request.get("echo") is True:
                raise Refused(400, f"this node's server ({self.backend.info.kind}) does not echo prompts")
        if self.backend.swaps and content_type == JSON:  # it loads the model a request names: now warm
            self.backend.note_request(request if request is not None else json_object(body))
        takes_turn = self.fragile
        if takes_turn:
            await self.turn.acquire()
        self.inflight += 1
        try:
            upstream = await self.backend.relay.post(path, body, content_type)
        except BaseException as err:  # cancelled too: the request never started here
            self.ended(takes_turn)
            if isinstance(err, OSError | RelayError):
                raise BackendUnreachable(f"the backend is unreachable: {err or type(err).__name__}") from err
            raise
        self.served += 1
        answer = Answer(self, path, upstream, takes_turn)
        sse = answer.status == 200 and answer.media_type.startswith("text/event-stream")
        # The gateway writes its bodies with json.dumps, so a body without these bytes has no such
        # field, and need not be read. Several choices are counted here, each by the server's
        # tokenizer: a server may report the usage of one (llama-server does).
        several = False
        if path in KINDS and b'"n"' in body and self.backend.info.tokenize:
            request = request if request is not None else json_object(body)
            n = request.get("n") if request is not None else None
            several = type(n) is int and n > 1 and text_answers(request or {})
        count = False  # usage is counted only for streams that asked for it
        if sse and path in KINDS and b'"include_usage"' in body:
            request = request if request is not None else json_object(body)
            count = (
                request is not None
                and dig(request, "stream_options", "include_usage") is True
                and text_answers(request)
                and (several or request.get("n") in (None, 1))
            )
        private = not kind.isolates_cache and answer.status == 200  # keys share its cache
        if sse and (count or renamed or private):
            answer.chunks = rewritten_events(
                self.backend, KINDS.get(path, ""), request or {}, upstream, count, renamed, several, private
            )
            answer.length = None
        elif answer.media_type.startswith("application/json") and answer.status == 200 and several:
            answer.chunks = counted_body(self.backend, request or {}, upstream, renamed, private)
            answer.length = None
        elif private and answer.media_type.startswith("application/json"):
            # Read whole now (a whole answer is small), so that its length is known once rewritten.
            try:
                whole = b"".join([chunk async for chunk in rewritten_body(upstream, renamed, private)])
            except BaseException as err:
                await answer.aclose()  # the caller has no answer to close
                if isinstance(err, RelayError):  # broken off before a byte went on: the gateway's 502
                    raise BackendUnreachable(f"the backend broke its answer off: {err}") from err
                raise
            answer.chunks, answer.length = _once(whole), len(whole)
        elif renamed and answer.media_type.startswith("application/json"):
            answer.chunks = rewritten_body(upstream, renamed, private)
            answer.length = None
        return answer


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


_SIGNATURE = signing.HEADER.encode()
_CACHE_FIELDS = [(field, f'"{field}"'.encode()) for field in CACHE_FIELDS]  # as JSON names them
GENERATES = frozenset({"/v1/chat/completions", "/v1/completions"})  # where openai_defaults apply


class Front:
    """The signed front as a bare ASGI app: POST /v1/… relayed to the server once its signature
    checks out; GET /healthz says whether the node drains and how many requests are in flight."""

    def __init__(self, state: FrontState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            if path.startswith("/v1/"):
                if method == "POST":
                    await self._forward(scope, receive, send)
                else:
                    await _plain(send, 405, b"Method Not Allowed", (b"allow", b"POST"))
            elif path == "/healthz":
                if method in ("GET", "HEAD"):
                    state = self.state
                    health = {"status": "draining" if state.draining else "ok", "inflight": state.inflight}
                    await _json(send, 200, health)
                else:
                    await _plain(send, 405, b"Method Not Allowed", (b"allow", b"GET, HEAD"))
            else:
                await _plain(send, 404, b"Not Found")
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)
            self.state.backend.relay.close()  # the server is done: so are its connections
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000})

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        headers = dict(scope["headers"])
        signature = headers.get(_SIGNATURE)
        # Refused before the body is read, where the headers already tell: a security review sent
        # 512 MiB unsigned, all of it held in memory (1 GiB) to be found unsigned at its end.
        if state.key is None or signature is None:
            return await _error(send, 401, UNSIGNED)
        if int(headers.get(b"content-length", b"0") or b"0") > MAX_REQUEST_BYTES:
            return await _error(send, 413, TOO_LARGE)
        message = await receive()
        body = message.get("body", b"")
        if message.get("more_body"):
            parts, size = [body], len(body)
            while message.get("more_body"):
                message = await receive()
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > MAX_REQUEST_BYTES:
                    return await _error(send, 413, TOO_LARGE)
            body = b"".join(parts)
        if message["type"] == "http.disconnect":
            return
        path = scope["path"]
        if not state.signatures.verify(state.key, signature.decode("latin-1"), path, body):
            return await _error(send, 401, UNSIGNED)
        if path == gpu_probe.PATH:
            return await _json(send, *await state.probe(body))
        if state.draining:
            return await _error(send, 503, "this node is draining: it takes no new work")
        # The gateway may hang up before the answer's end (its client left, or it died): the
        # server's work ends then too, not when it has generated an answer nobody reads (a whole
        # answer comes at its end: a review saw one go on for minutes, its slot taken).
        watching = asyncio.ensure_future(receive())
        content_type = headers.get(b"content-type", b"").decode("latin-1") or JSON
        forwarding = asyncio.ensure_future(state.forward(path, body, content_type))

        def hung_up(_: object) -> None:
            forwarding.cancel()

        watching.add_done_callback(hung_up)
        try:
            answer = await forwarding
        except BaseException as err:
            watching.remove_done_callback(hung_up)
            gone = watching.done()  # the gateway hung up (and so the forward was cancelled)
            watching.cancel()
            if isinstance(err, Refused):
                return await _error(send, err.status, err.message)
            if isinstance(err, BackendUnreachable):
                return await _error(send, 502, str(err))
            if isinstance(err, asyncio.CancelledError) and gone:
                return None  # nobody to answer
            raise
        watching.remove_done_callback(hung_up)
        await _relay(answer, watching, send)


async def _relay(answer: Answer, watching: asyncio.Future[Message], send: Send) -> None:
    """Send the answer to the gateway as it comes, then end the request; `watching` completes when
    the gateway hangs up, which ends the server's answer at once."""
    headers = [(b"content-type", answer.media_type.encode("latin-1"))]
    watching.add_done_callback(answer.give_up)
    try:
        if answer.length is not None:  # a whole answer, its size known: its last chunk ends it
            headers.append((b"content-length", b"%d" % answer.length))
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            left = answer.length
            if not left:
                await send({"type": "http.response.body", "body": b""})
            async for chunk in answer.chunks:
                left -= len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
            return
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        async for chunk in answer.chunks:
            if answer.upstream.finished():  # the last chunk: it ends the response (one write less)
                watching.remove_done_callback(answer.give_up)
                await send({"type": "http.response.body", "body": chunk})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        watching.remove_done_callback(answer.give_up)
        await send({"type": "http.response.body", "body": b""})
    except RelayError as err:
        if not answer.given_up:  # the gateway must see the body cut short, not ended
            answer.broken(err)
            raise Abort(str(err)) from None
    finally:
        watching.remove_done_callback(answer.give_up)
        watching.cancel()
        await answer.aclose()


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _plain(send: Send, status: int, text: bytes, *extra: tuple[bytes, bytes]) -> None:
    await _whole(send, status, text, b"text/plain; charset=utf-8", *extra)


async def _json(send: Send, status: int, content: dict[str, Any]) -> None:
    # As Starlette's JSONResponse wrote it.
    body = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    await _whole(send, status, body, b"application/json")


async def _whole(
    send: Send, status: int, body: bytes, media_type: bytes, *extra: tuple[bytes, bytes]
) -> None:
    headers = [(b"content-type", media_type), (b"content-length", b"%d" % len(body)), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _error(send: Send, status: int, message: str) -> None:
    await _json(
        send, status, {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    )


def create_front(state: FrontState) -> Front:
    return Front(state)
