"""A fuzz of the node tunnel (hardening issue 15): a hostile or broken agent against a real gateway.

Each example registers a fresh node with a tunnel endpoint whose tunnel is this test's socket, asks
the gateway a real chat completion (plain or streamed), and answers the request it forwards with
frames Hypothesis wrote: the protocol's frames in any order and with any values (statuses, content
types, bodies, ids of other requests, huge ids), frames of the wrong types, JSON that is no frame,
text that is no JSON, binary frames, and frames before any request. For every example:

- the client gets a valid HTTP answer, never a 500, and within a bound that the first-byte timeout
  sets (NEURALGRID_FIRST_BYTE_TIMEOUT_S is 0.3 s here);
- the answer is the agent's only if its frames made one: the status of its `start` and the `data`
  up to its `end` (a 200 only then; a stream, events that end with [DONE]); anything else is a 502,
  503 or 504 with an OpenAI-shaped error;
- the gateway never closes the agent's socket with 1011 (internal error), logs no error, and
  /healthz and /readyz answer afterwards.

What the frames should make is worked out with the protocol's own parser (agent_frame), frame by
frame, as the gateway reads them. A server exception fails an example as `Server<ExceptionName>`, so
Hypothesis reports each kind apart. NEURALGRID_FUZZ_EXAMPLES sets the examples per test (default 60).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import httpx
import psycopg
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from neuralgrid.protocol.tunnel import Data, End, Err, Req, Start, agent_frame, gateway_frame
from tests.conftest import LLAMA8, register_tunnel_node, tunnel_url
from tests.fuzzing import EXAMPLES, LIVE_SERVER, server_error

# The gateway runs in this process: its threads may use `random` while Hypothesis draws an example,
# which Hypothesis takes for a strategy doing so.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
FIRST_BYTE_S = 0.3
# The first byte's wait, once more for a node the job may be moved to, and room for a busy machine.
ANSWER_WITHIN_S = 3 * FIRST_BYTE_S + 2.0
UPSTREAM_ERRORS = (502, 503, 504)
COMPLETION = json.dumps(
    {
        "id": "chatcmpl-fuzz",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)
CHUNK = 'data: {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
DONE = "data: [DONE]\n\n"


@pytest.fixture
def gateway_settings() -> dict[str, Any]:
    return {"NEURALGRID_KEY_CACHE_TTL_S": 30, "NEURALGRID_FIRST_BYTE_TIMEOUT_S": FIRST_BYTE_S}


def say(text: str) -> None:
    """A note in Hypothesis's report of a failing example (printed when run outside Hypothesis)."""
    if currently_in_test_context():
        note(text)
    else:
        print(text)


# -- what the server logged -----------------------------------------------------------------------


# -- frames ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rid:
    """The id of the request the gateway forwarded, plus `offset` (known once it has)."""

    offset: int = 0

    def __repr__(self) -> str:
        return "RID" if not self.offset else f"RID{self.offset:+d}"


@dataclass(frozen=True)
class Out:
    """A frame the agent sends: a JSON value (ids may be Rid), text that is no JSON, or bytes."""

    value: Any = None
    text: str | None = None
    data: bytes | None = None
    ascii_only: bool = True

    def render(self, rid: int) -> str | bytes:
        if self.data is not None:
            return self.data
        if self.text is not None:
            return self.text
        value = self.value
        if isinstance(value, dict) and isinstance(value.get("id"), Rid):
            value = {**value, "id": rid + value["id"].offset}
        text = json.dumps(value, ensure_ascii=self.ascii_only)
        try:
            text.encode()
        except UnicodeEncodeError:  # lone surrogates travel escaped
            text = json.dumps(value)
        return text

    def __repr__(self) -> str:
        shown = repr(
            self.data if self.data is not None else self.text if self.text is not None else self.value
        )
        return shown if len(shown) < 300 else f"{shown[:300]}... ({len(shown)} characters)"


AgentFrame = Start | Data | End | Err


def parsed(frame: str | bytes) -> AgentFrame | None:
    """The frame as the gateway reads it, or None: a frame that closes the tunnel."""
    if isinstance(frame, bytes):
        return None  # the protocol's frames are text
    try:
        return agent_frame(frame)
    except ValueError:
        return None


@dataclass
class Expect:
    """What the frames make of the request: the agent's answer, a stream, an upstream error, or a
    request still waiting for frames (which the gateway must not wait for forever)."""

    kind: Literal["answer", "stream", "error", "waiting", "no start"]
    status: int = 0
    body: str = ""
    media_type: str = ""
    reason: str = ""


def header_value(text: str) -> bool:
    """Whether `text` can be an HTTP header value as it is (RFC 9110: no controls, Latin-1)."""
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return not any((ord(c) < 32 and c != "\t") or c == "\x7f" for c in text)


def retryable(status: int) -> bool:
    """Statuses after which the gateway moves the job on (send.py): 429, 3xx, 5xx but 501."""
    return status == 429 or (status >= 500 and status != 501) or 300 <= status < 400


def expect(
    before: list[str | bytes], after: list[str | bytes], rid: int, stream: bool, hung_up: bool
) -> Expect:
    """What the gateway makes of the frames sent `before` and `after` it forwarded request `rid`, read
    in order (tunnel.py, send.py), the agent hanging up after them or not."""
    if any(parsed(frame) is None for frame in before):
        return Expect("error", reason="the tunnel closed before the request")
    queue: list[AgentFrame] = []
    for frame in after:
        read = parsed(frame)
        if read is None:
            hung_up = True  # the gateway closes the tunnel
            break
        if read.id == rid:
            queue.append(read)
    if hung_up:
        queue.append(Err(id=rid, message="the tunnel closed"))
    if not queue:
        return Expect("no start")
    first, rest = queue[0], iter(queue[1:])
    if not isinstance(first, Start):
        return Expect("error", reason="no status line first")
    status = first.status
    if stream and not retryable(status) and status < 400:
        nxt = next(rest, None)
        if nxt is None:
            return Expect("waiting", reason="a stream's first chunk")
        if not isinstance(nxt, Data):
            return Expect("error", reason="no first chunk")
        return Expect("stream")
    body: list[str] = []
    for item in rest:
        if isinstance(item, Data):
            body.append(item.b)
        elif isinstance(item, End):
            break
        else:
            return Expect("error", reason="the body failed")
    else:
        return Expect("waiting", reason="the end of the body")
    if retryable(status):
        return Expect("error", status=status, reason="a status the gateway fails over on")
    if status < 200:
        return Expect("error", status=status, reason="1xx is no final status: a node cannot answer with it")
    return Expect("answer", status=status, body="".join(body), media_type=first.type)


# -- the agent ------------------------------------------------------------------------------------


@dataclass
class Agent:
    """A registered node whose tunnel is this test's socket."""

    name: str
    ws: ClientConnection
    closed_by_gateway: int | None = None
    sent: list[str | bytes] = field(default_factory=list)

    def send(self, frame: str | bytes) -> bool:
        """Sends a frame; False once the gateway has closed the socket."""
        try:
            self.ws.send(frame)
        except ConnectionClosed:
            return False
        self.sent.append(frame)
        return True

    def request(self, wait_s: float, answered: Future[Any]) -> Req | None:
        """The request the gateway forwards; None when it closes the socket, or answers the client,
        or `wait_s` passes first."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not answered.done():
            try:
                return cast(Req, gateway_frame(self.ws.recv(timeout=0.05)))
            except TimeoutError:
                continue
            except ConnectionClosed as closed:
                self.closed_by_gateway = closed.rcvd.code if closed.rcvd else None
                return None
        return None

    def hang_up(self) -> None:
        """Closes the socket, noting the gateway's close code if it closed first."""
        self.ws.close()
        protocol = self.ws.protocol
        if protocol.close_rcvd is not None and protocol.close_rcvd_then_sent:
            self.closed_by_gateway = protocol.close_rcvd.code


@dataclass
class Tunnels:
    """Fresh nodes with tunnel endpoints on one gateway, and the checks every example ends with."""

    gateway: str
    api_key: str
    conn: psycopg.Connection
    errors: list[logging.LogRecord]
    pool: ThreadPoolExecutor
    http: httpx.Client  # this thread's
    asker: httpx.Client  # the client's, asking from the pool

    def wait_for_status(self, name: str, status: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.status(name) != status:
            assert time.monotonic() < deadline, f"node {name} is {self.status(name)}, not {status}"
            time.sleep(0.005)

    def status(self, name: str) -> str | None:
        row = self.conn.execute("select status from nodes where name = %s", (name,)).fetchone()
        return None if row is None else str(row[0])

    def agent(self) -> Agent:
        """A new node (its own name: no reputation or cooldown carried over), online on this socket."""
        name = f"fuzz-{uuid.uuid4().hex[:10]}"
        node = register_tunnel_node(self.gateway, self.api_key, name, self.http)
        secret = {"authorization": f"Bearer {node['node_secret']}"}
        url = tunnel_url(self.gateway, node)
        ws = connect(url, additional_headers=secret, open_timeout=10, close_timeout=5, max_size=None)
        self.wait_for_status(name, "online")
        return Agent(name, ws)

    def ask(self, stream: bool) -> httpx.Response:
        body = {
            "model": LLAMA8,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream": stream,
        }
        return self.asker.post(
            f"{self.gateway}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {self.api_key}"},
            timeout=ANSWER_WITHIN_S + 30,
        )

    def exchange(
        self, stream: bool, answer: list[Out], before: Sequence[Out] = (), hang_up: bool = True
    ) -> None:
        """Frames `before` any request, a request, `answer` to it, and (with `hang_up`) the agent
        hangs up; then every check."""
        say(f"stream={stream}; before the request: {list(before)}; in answer: {answer}; hang up: {hang_up}")
        self.errors.clear()
        agent = self.agent()
        first = [frame.render(0) for frame in before]
        rest: list[str | bytes] = []
        broken: httpx.HTTPError | None = None
        response: httpx.Response | None = None
        try:
            for text in first:
                agent.send(text)
            if before:
                time.sleep(0.05)  # read by the gateway before the request they do not belong to
            started = time.monotonic()
            asked = self.pool.submit(self.ask, stream)
            request = agent.request(FIRST_BYTE_S + 5, asked)
            if request is not None:
                rest = [frame.render(request.id) for frame in answer]
                for text in rest:
                    agent.send(text)
                if hang_up:
                    agent.hang_up()
            try:
                response = asked.result(timeout=max(0.0, started + ANSWER_WITHIN_S - time.monotonic()))
            except FutureTimeout:
                pass
            except httpx.HTTPError as err:
                broken = err
            elapsed = time.monotonic() - started
        finally:
            agent.hang_up()
        self.wait_for_status(agent.name, "offline")
        time.sleep(0.03)  # an exception the gateway's tunnel ended with is logged just after
        if self.errors:  # an exception in the app says more than the status it made
            raise server_error(self.errors[0])
        if broken is not None:
            raise AssertionError(f"the client got no valid HTTP response: {broken!r}")
        if response is None:
            late = asked.exception(timeout=30)  # the tunnel is closed now: the request ends
            then = repr(late) if late else str(asked.result())
            raise AssertionError(
                f"no answer within {ANSWER_WITHIN_S} s (the first-byte timeout is {FIRST_BYTE_S} s);"
                f" once the agent hung up: {then}"
            )
        if request is None:
            expected = Expect("error", reason="the tunnel closed before the request")
        else:
            assert request.path == "/v1/chat/completions" and json.loads(request.body)["model"] == LLAMA8
            expected = expect(first, rest, request.id, stream, hang_up)
        self.check_answer(expected, response, elapsed)
        assert agent.closed_by_gateway != 1011, "the gateway closed the tunnel with 1011 (internal error)"
        for path in ("/healthz", "/readyz"):
            health = self.http.get(f"{self.gateway}{path}")
            assert health.status_code == 200, (path, health.status_code, health.text)

    def check_answer(self, expected: Expect, response: httpx.Response, elapsed: float) -> None:
        status, text = response.status_code, response.text
        say(f"expected: {expected}; the client got {status} after {elapsed:.2f} s: {text[:500]!r}")
        assert status != 500, f"HTTP 500: {text[:500]}"
        if status == 504 and elapsed >= FIRST_BYTE_S:
            expected = Expect("error", reason="timed out (frames late on a busy machine, or none)")
        if expected.kind == "answer" and not (
            status in UPSTREAM_ERRORS and not header_value(expected.media_type)
        ):
            # The agent's answer, as it sent it (a content type that cannot be a header may be refused).
            assert status == expected.status, f"the agent answered {expected.status}, the client got {status}"
            if status >= 400 and text != expected.body:
                # A refusal not in OpenAI's shape reaches the client in it (errors.from_node).
                error = response.json()["error"]
                assert error["message"].startswith("the node answered"), (
                    f"not the agent's refusal: {text[:300]}"
                )
            else:
                assert text == expected.body or (status == 204 and text == ""), "the body is not the agent's"
            return
        if expected.kind == "stream" and status == 200:
            assert response.headers["content-type"].startswith("text/event-stream"), response.headers
            assert text.endswith(DONE), f"a stream that does not end with [DONE]: {text[-300:]!r}"
            return
        # No answer from the agent: the gateway says so, the OpenAI way.
        assert status in UPSTREAM_ERRORS, (
            f"expected an upstream error ({expected}), got {status}: {text[:300]}"
        )
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"] == "server_error", error


@pytest.fixture
def tunnels(
    gateway: str, api_key: str, conn: psycopg.Connection, server_errors: list[logging.LogRecord]
) -> Iterator[Tunnels]:
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=10) as http, httpx.Client() as asker:
        yield Tunnels(gateway, api_key, conn, server_errors, pool, http, asker)


# -- strategies -----------------------------------------------------------------------------------

AWKWARD = ["\x00", "\ud800", "\r", "\n", '"', "é", "€", "\U0001f600", "\x7f", ";", ","]
CHARS = st.characters(exclude_categories=()) | st.sampled_from(AWKWARD)


def texts(max_size: int = 16) -> st.SearchStrategy[str]:
    return st.text(CHARS, max_size=max_size)


JSON: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts(6), inner, max_size=3),
    max_leaves=8,
)
OTHER_IDS = st.sampled_from([0, -1, 2, 2**31, 2**63, 10**30, -(10**30)]) | st.integers()
# Ids of no request yet: a fresh tunnel's first request is 1, and a frame for it sent before it is
# forwarded could arrive either side of it.
NOT_YET = OTHER_IDS.filter(lambda i: i != 1)
IDS = st.one_of(st.just(Rid()), st.just(Rid()), st.just(Rid()), st.just(Rid(1)), OTHER_IDS)
STATUSES = st.sampled_from(
    [200, 200, 200, 201, 204, 206, 400, 404, 422, 429, 500, 501, 502, 503, 301, 304, 100, 101, 199]
) | st.integers(100, 599)
TYPES = (
    st.sampled_from(
        ["application/json", "text/event-stream", "text/plain; charset=utf-8", "", "x/y\r\nx-injected: 1"]
    )
    | texts()
)
BODIES = st.sampled_from([COMPLETION, CHUNK, DONE, CHUNK + DONE, "", "{", "data: [DONE]"]) | texts(40)


@st.composite
def frames(draw: st.DrawFn, ids: st.SearchStrategy[Any] = IDS) -> Out:
    """One of the protocol's frames, right in every field."""
    kind = draw(st.sampled_from(["start", "data", "data", "end", "err"]))
    value: dict[str, Any] = {"t": kind, "id": draw(ids)}
    if kind == "start":
        value["status"] = draw(STATUSES)
        if draw(st.booleans()):
            value["type"] = draw(TYPES)
    elif kind == "data":
        value["b"] = draw(BODIES)
    elif kind == "err":
        value["message"] = draw(texts(20))
    return Out(value, ascii_only=draw(st.booleans()))


@st.composite
def garbage(draw: st.DrawFn, ids: st.SearchStrategy[Any] = IDS) -> Out:
    """A frame that is not the protocol's: a field of the wrong type or missing, another `t`, JSON
    that is no frame, text that is no JSON, bytes."""
    kind = draw(st.sampled_from(["wrong type", "missing", "unknown t", "json", "text", "binary"]))
    if kind == "json":
        return Out(draw(JSON))
    if kind == "text":
        return Out(
            text=draw(texts(30)).encode(errors="replace").decode() + draw(st.sampled_from(["", "{", "}"]))
        )
    if kind == "binary":
        return Out(data=draw(st.binary(max_size=40) | st.just(b'{"t": "end", "id": 1}')))
    value = dict(draw(frames(ids)).value)
    if kind == "unknown t":
        value["t"] = draw(st.sampled_from(["req", "cancel", "START", "", "ping"]) | texts(6))
    else:
        key = draw(st.sampled_from(sorted(value)))
        if kind == "missing":
            del value[key]
        else:
            value[key] = draw(JSON | st.sampled_from(["1", "200", 1.5, True, [1], {"id": 1}]))
    return Out(value)


@st.composite
def answers(draw: st.DrawFn, end: bool | None = None) -> list[Out]:
    """Frames for a request: mostly an answer's (a status line, data, maybe an end) with other
    frames slipped in anywhere; sometimes any frames at all."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.lists(frames(), max_size=6))
    start: dict[str, Any] = {"t": "start", "id": Rid(), "status": draw(STATUSES)}
    if draw(st.booleans()):
        start["type"] = draw(TYPES)
    out = [Out(start), *(Out({"t": "data", "id": Rid(), "b": b}) for b in draw(st.lists(BODIES, max_size=3)))]
    if draw(st.booleans()) if end is None else end:
        out.append(Out({"t": "end", "id": Rid()}))
    for frame in draw(st.lists(frames(), max_size=3)):
        out.insert(draw(st.integers(0, len(out))), frame)
    return out


def terminators() -> st.SearchStrategy[list[Out]]:
    """What makes the request's fate certain: its end, its error, a frame that closes the tunnel."""
    return st.one_of(
        st.just([Out({"t": "end", "id": Rid()})]),
        st.just([Out({"t": "err", "id": Rid(), "message": "the backend failed"})]),
        garbage(st.just(Rid())).map(lambda frame: [frame]),
    )


# -- the tests ------------------------------------------------------------------------------------


@LIVE_SERVER
@given(stream=st.booleans(), answer=answers(), end=terminators())
def test_protocol_frames_in_any_order(
    tunnels: Tunnels, stream: bool, answer: list[Out], end: list[Out]
) -> None:
    """start, data, end and err frames in any order, for this request or others, with any status,
    content type and body, then a frame that settles the request: the client gets the agent's answer
    if the frames made one, else an upstream error; never a 500 or a broken response."""
    tunnels.exchange(stream, [*answer, *end])


# A quarter of the examples: each waits out the first-byte timeout, and the shapes that stop short
# are few (no start, a start and no end, a stream cut), where the other tests vary whole answers.
@settings(LIVE_SERVER, max_examples=max(EXAMPLES // 4, 1))
@given(stream=st.booleans(), answer=answers(end=False))
def test_an_agent_that_stops_answering_never_holds_the_client(
    tunnels: Tunnels, stream: bool, answer: list[Out]
) -> None:
    """Frames that leave the request unsettled (no status line, a status line and no end, a stream
    cut short) and then silence, the tunnel still up: the client is answered all the same, within
    the bound the first-byte timeout sets, not left waiting for as long as the tunnel lives."""
    tunnels.exchange(stream, answer, hang_up=False)


@LIVE_SERVER
@given(stream=st.booleans(), answer=answers(), bad=garbage(), where=st.integers(0, 10), end=terminators())
def test_malformed_frames(
    tunnels: Tunnels, stream: bool, answer: list[Out], bad: Out, where: int, end: list[Out]
) -> None:
    """A frame of the wrong types, JSON that is no frame, text that is no JSON or a binary frame,
    anywhere in an answer: the gateway closes the tunnel (not with 1011), the client gets an upstream
    error unless the answer was complete before it."""
    tunnels.exchange(stream, [*answer[:where], bad, *answer[where:], *end])


@LIVE_SERVER
@given(
    stream=st.booleans(),
    before=st.lists(frames(NOT_YET) | garbage(NOT_YET), min_size=1, max_size=5),
)
def test_frames_before_any_request(tunnels: Tunnels, stream: bool, before: list[Out]) -> None:
    """Frames for requests that do not exist (data before any start, ends, errors, garbage) as soon
    as the tunnel is up: ignored if they are the protocol's, else the tunnel closes and the request
    that follows goes nowhere; never a 500, never a hang."""
    body = [CHUNK, DONE] if stream else [COMPLETION]
    answer = [
        Out({"t": "start", "id": Rid(), "status": 200}),
        *(Out({"t": "data", "id": Rid(), "b": b}) for b in body),
        Out({"t": "end", "id": Rid()}),
    ]
    tunnels.exchange(stream, answer, before)
