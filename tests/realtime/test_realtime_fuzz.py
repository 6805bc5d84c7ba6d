"""A fuzz of the embedded Realtime server (hardening issue 15): hostile clients against a real gateway.

Hypothesis writes what a broken or malicious client could send on /realtime/v1/websocket: any JSON,
Phoenix messages with a wrong type in each position, deep and big payloads, joins with garbage
config, access_token events (and apikeys) with garbage tokens, binary frames of any bytes, text that
is not UTF-8. Each example runs on a fresh socket and stays far below the per-socket rate limits, so
no documented limit applies to it. For every example:

- the server never closes the socket (no 1011, no close after an exception of its own, no TCP drop);
  only text that is not UTF-8 is closed, with 1007, as RFC 6455 says;
- every frame it sends is JSON as JSON.parse reads it (no NaN), in the socket's vsn shape; every
  phx_reply has status ok or error and an object response, and a push gets at most one reply;
- a heartbeat afterwards is answered, on that socket and on a canary socket that lives for the whole
  test; /healthz and /readyz answer; the server logged no error.

Some tests check more: a broadcast comes back as sent; the size limits count the bytes sent; a
handshake is refused with a 403, not a 500; a token signed with garbage claims is refused.

A server exception fails the example as `Server<ExceptionName>`, so Hypothesis reports distinct bugs
apart. NEURALGRID_FUZZ_EXAMPLES sets the examples per test (default 60).
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import math
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
import jwt
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from neuralgrid.realtime.limits import Limits
from neuralgrid.realtime.protocol import V1, V2, Message, decode
from neuralgrid.server.settings import PLACEHOLDER_SECRET
from neuralgrid.server.stack import api_key
from tests.fuzzing import LIVE_SERVER, server_error

# The gateway runs in this process: its threads may use `random` while Hypothesis draws an example,
# which Hypothesis takes for a strategy doing so.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
ANON = api_key(PLACEHOLDER_SECRET, "anon")
SERVICE = api_key(PLACEHOLDER_SECRET, "service_role")
RECV_TIMEOUT_S = 10.0
LIMITS = Limits()


def say(text: str) -> None:
    """A note in Hypothesis's report of a failing example (printed when run outside Hypothesis)."""
    if currently_in_test_context():
        note(text)
    else:
        print(text)


# -- what the server says, and how it failed ------------------------------------------------------


def raise_logged(errors: list[logging.LogRecord], wait_s: float = 0.0, tolerated: str | None = None) -> None:
    """Fails with the first error the server logged (waiting up to `wait_s` for one to appear)."""
    deadline = time.monotonic() + wait_s
    while True:
        if tolerated is not None:
            errors[:] = [r for r in errors if not r.getMessage().startswith(tolerated)]
        if errors or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if errors:
        raise server_error(errors[0])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (JSON.parse in realtime-js would throw)")


def strict_json(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


@dataclass(frozen=True)
class BadText:
    """Bytes sent as a text frame: not UTF-8."""

    data: bytes


@dataclass(frozen=True)
class Deep:
    """JSON too deep for this test's stack to decode (it runs deeper than the server's): the ref the
    server reads in it, if it can read it at all, is given."""

    text: str
    ref: str


Frame = str | bytes | BadText | Deep


def abbreviate(frame: Frame, keep: int = 300) -> str:
    text = repr(frame)
    return text if len(text) <= keep else f"{text[:keep]}... ({len(text)} characters)"


class Client:
    """One socket: sends frames, counts its pushes by ref, and checks everything the server says."""

    def __init__(self, gateway: str, vsn: str, token: str = ANON) -> None:
        url = f"{gateway.replace('http://', 'ws://')}/realtime/v1/websocket?apikey={token}&vsn={vsn}"
        self.vsn = vsn
        self.ws: ClientConnection = connect(url, max_size=None, open_timeout=10, close_timeout=5)
        self.pushes: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()
        self.received: list[Message] = []
        self._beats = itertools.count()

    def close(self) -> None:
        self.ws.close()

    def send(self, frame: Frame) -> None:
        if isinstance(frame, BadText):
            self.ws.send(frame.data, text=True)
            return
        if isinstance(frame, Deep):
            self.ws.send(frame.text)
            self.pushes[frame.ref] += 1
            return
        self.ws.send(frame)
        try:  # the refs the server reads, as it reads them (what it cannot read gets no reply)
            ref = decode(frame, self.vsn).ref
        except Exception:
            return
        if ref is not None:
            self.pushes[ref] += 1

    def push(self, topic: str, event: str, payload: Any, ref: str | None) -> None:
        self.send(encode(self.vsn, topic, event, payload, ref))

    def receive(self) -> Message:
        data = self.ws.recv(timeout=RECV_TIMEOUT_S)
        assert isinstance(data, str), f"the server sent a binary frame: {data[:200]!r}"
        try:
            value = strict_json(data)
        except RecursionError:  # valid or not, too deep for this test's stack: an echo of a Deep
            return Message("", "", None)
        except ValueError as err:
            raise AssertionError(f"the server sent a frame that is not JSON ({err}): {data[:300]}") from None
        shape = f"not a vsn {self.vsn} message: {data[:300]}"
        if self.vsn == V2:
            assert isinstance(value, list) and len(value) == 5, shape
            join_ref, ref, topic, event, payload = value
        else:
            assert isinstance(value, dict) and {"topic", "event", "payload", "ref"} <= value.keys(), shape
            join_ref, ref, topic, event, payload = (
                value.get("join_ref"),
                value["ref"],
                value["topic"],
                value["event"],
                value["payload"],
            )
        assert isinstance(topic, str) and isinstance(event, str), shape
        assert ref is None or isinstance(ref, str), shape
        assert join_ref is None or isinstance(join_ref, str), shape
        message = Message(topic, event, payload, ref, join_ref)
        if event == "phx_reply":
            assert isinstance(payload, dict), f"a reply without a payload object: {data[:300]}"
            assert payload.get("status") in ("ok", "error"), f"a reply neither ok nor error: {data[:300]}"
            assert isinstance(payload.get("response"), dict), f"a reply without a response: {data[:300]}"
            if ref is not None:
                self.replies[ref] += 1
                assert self.replies[ref] <= self.pushes[ref], (
                    f"{self.replies[ref]} replies to {self.pushes[ref]} push(es) with ref {ref!r}:"
                    f" {[m for m in self.received if m.ref == ref] + [message]}"
                )
        self.received.append(message)
        return message

    def reply(self, ref: str) -> Message:
        """Reads until the reply to `ref`, checking what comes before it."""
        while True:
            message = self.receive()
            if message.event == "phx_reply" and message.ref == ref:
                return message

    def heartbeat(self) -> None:
        ref = f"hb-{next(self._beats)}"
        self.push("phoenix", "heartbeat", {}, ref)
        answer = self.reply(ref)
        assert answer.payload["status"] == "ok", answer


def message(vsn: str, topic: Any, event: Any, payload: Any, ref: Any, join_ref: Any = None) -> Any:
    """A message as vsn `vsn` lays it out (a JSON object or a five-element array)."""
    if vsn == V2:
        return [join_ref, ref, topic, event, payload]
    return {"topic": topic, "event": event, "payload": payload, "ref": ref, "join_ref": join_ref}


def encode(vsn: str, topic: Any, event: Any, payload: Any, ref: Any, join_ref: Any = None) -> str:
    return dumps(message(vsn, topic, event, payload, ref, join_ref))


def dumps(value: Any, ascii_only: bool = True) -> str:
    """JSON text the socket can carry (lone surrogates only escaped: they are not UTF-8)."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


@dataclass
class Fuzzed:
    """The gateway, its canary socket and its error log, shared by a test's examples."""

    gateway: str
    canary: Client
    errors: list[logging.LogRecord]
    http: httpx.Client

    def exchange(
        self, vsn: str, frames: list[Frame], *, closes_with: int | None = None, tolerated: str | None = None
    ) -> Client:
        """Sends `frames` on a fresh socket, then a heartbeat: the socket stays open (or, with
        `closes_with`, is closed with that code), and the server healthy. `tolerated`: the start of
        an error log line that is expected (uvicorn's own, for a frame it refuses)."""
        say(f"vsn {vsn}; frames: [{', '.join(abbreviate(f) for f in frames)}]")
        self.errors.clear()
        client = Client(self.gateway, vsn)
        closed: ConnectionClosed | None = None
        try:
            for frame in frames:
                client.send(frame)
            client.heartbeat()
        except ConnectionClosed as err:
            closed = err
        finally:
            client.close()
        # Checked out of the except block: Hypothesis tells bugs apart by where they were raised,
        # and from within it by the ConnectionClosed (raised by send or recv) too.
        code = closed.rcvd.code if closed and closed.rcvd else None
        if closed is not None and (closes_with is None or code != closes_with):
            raise_logged(self.errors, wait_s=1.0, tolerated=tolerated)
            raise AssertionError(
                f"the server closed the socket ({closed.rcvd or 'with no close frame'}), expected "
                f"{closes_with or 'it to stay open'}; it had said {client.received}"
            )
        if closes_with is not None:
            assert code == closes_with, f"the socket was not closed with {closes_with}: {client.received}"
        self.check_health(tolerated)
        return client

    def check_health(self, tolerated: str | None = None) -> None:
        try:
            self.canary.heartbeat()
        except ConnectionClosed as closed:
            raise AssertionError(f"the canary socket was closed: {closed}") from None
        for path in ("/healthz", "/readyz"):
            answer = self.http.get(f"{self.gateway}{path}")
            assert answer.status_code == 200, (path, answer.status_code, answer.text)
        raise_logged(self.errors, tolerated=tolerated)


@pytest.fixture
def fuzzed(gateway: str, server_errors: list[logging.LogRecord]) -> Iterator[Fuzzed]:
    canary = Client(gateway, V1)
    canary.push("realtime:canary", "phx_join", {"config": {"broadcast": {"self": True}}}, "join")
    assert canary.reply("join").payload["status"] == "ok"
    with httpx.Client(timeout=10) as http:
        yield Fuzzed(gateway, canary, server_errors, http)
    canary.close()


# -- strategies -----------------------------------------------------------------------------------

# Any character, lone surrogates included, and more often the ones parsers and databases trip on.
AWKWARD = ["\x00", "\ud800", "\udfff", "\r", "\n", '"', "\\", "é", "€", "\U0001f600", "\u2028", "\ufeff"]
CHARS = st.characters(exclude_categories=()) | st.sampled_from(AWKWARD)


def texts(max_size: int = 16) -> st.SearchStrategy[str]:
    return st.text(CHARS, max_size=max_size)


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.sampled_from([math.nan, math.inf, -math.inf])  # Python's json writes and reads them
    | texts()
)
JSON: st.SearchStrategy[Any] = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts(8), inner, max_size=4),
    max_leaves=12,
)
VSNS = st.sampled_from([V1, V2])
TOPICS = (
    st.sampled_from(
        ["phoenix", "realtime:fuzz", "realtime:node-map", "realtime:", "realtime:canary", "node-map", ""]
    )
    | texts(24).map(lambda t: f"realtime:{t}")
    | st.integers(250, 270).map(lambda n: "realtime:" + "t" * n)
    | texts()
)
KNOWN_EVENTS = [
    "phx_join",
    "phx_leave",
    "heartbeat",
    "broadcast",
    "presence",
    "access_token",
    "phx_reply",
    "phx_close",
    "phx_error",
    "postgres_changes",
    "system",
]
EVENTS = st.sampled_from(KNOWN_EVENTS) | texts(12)
REFS = st.text("abc123", min_size=1, max_size=4) | st.integers(-5, 5) | JSON


def sometimes_garbage(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the right kind of value, sometimes any JSON at all."""
    return st.one_of(strategy, strategy, JSON)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


ROLES = st.sampled_from(["anon", "authenticated", "service_role", "postgres", ""])
EXPIRIES = st.floats() | st.integers(0, 2**40) | st.sampled_from([time.time() + 3600, 10**400, -(10**400)])
OTHER_CLAIMS = {"sub": JSON, "iat": JSON, "nbf": JSON, "aud": JSON, "email": JSON}
CLAIMS = st.one_of(
    st.fixed_dictionaries({}, optional={"role": ROLES | JSON, "exp": EXPIRIES | JSON, **OTHER_CLAIMS}),
    # role and exp there (PyJWT itself checks iat, nbf and sub), one of them or both of any type
    st.fixed_dictionaries({"role": sometimes_garbage(ROLES), "exp": sometimes_garbage(EXPIRIES)}),
)
OTHER_SECRET = "not-the-secret-of-this-stack-but-long-enough-for-hs256"
with warnings.catch_warnings():  # our secret is short for HS512: the server accepts only HS256 anyway
    warnings.simplefilter("ignore", jwt.warnings.InsecureKeyLengthWarning)
    HS512 = jwt.encode({"role": "anon", "exp": 9e9}, PLACEHOLDER_SECRET, algorithm="HS512")
UNSIGNED_TOKENS = st.one_of(
    texts(40),
    JSON,
    st.integers() | st.floats() | st.lists(texts(8), min_size=1, max_size=2) | st.just({"token": ANON}),
    st.sampled_from(["", ANON, SERVICE, "sb_publishable_x", "a.b.c", "..", "Bearer " + ANON]),
    texts().map(lambda t: f"sb_{t}"),
    st.tuples(JSON, JSON, st.binary(max_size=40)).map(
        lambda parts: f"{b64(dumps(parts[0]).encode())}.{b64(dumps(parts[1]).encode())}.{b64(parts[2])}"
    ),
    CLAIMS.map(lambda claims: jwt.encode(claims, OTHER_SECRET, algorithm="HS256")),
    st.just(jwt.encode({"role": "anon", "exp": 1}, PLACEHOLDER_SECRET, algorithm="HS256")),  # expired
    st.just(HS512),
)
# Tokens signed with the stack's own secret whose claims are garbage: only the operator (or whoever
# holds the JWT secret) can make these, but the server must still refuse them, not crash on them.
SIGNED_TOKENS = CLAIMS.map(lambda claims: jwt.encode(claims, PLACEHOLDER_SECRET, algorithm="HS256"))

FILTERS = st.one_of(
    texts(30),
    st.builds(
        lambda column, op, value, more: f"{column}={op}.{value}{more}",
        st.sampled_from(["id", "status", "name", " ", "", "a=b", "(", "é"]) | texts(6),
        st.sampled_from(["eq", "neq", "lt", "lte", "gt", "gte", "in", "like", "EQ", ""]),
        st.sampled_from(["1", "(1,2)", '("a","b")', "(", ")", "", "((,))", "\x00"]) | texts(10),
        st.sampled_from(["", ",", ",id=eq.1", ",,", ",(", ")"]),
    ),
)
BINDINGS = st.fixed_dictionaries(
    {},
    optional={
        "event": sometimes_garbage(st.sampled_from(["*", "INSERT", "update", "DELETE", "TRUNCATE", ""])),
        "schema": sometimes_garbage(
            st.sampled_from(["public", "*", "auth", "realtime", "", "pg_catalog"]) | texts(8)
        ),
        "table": sometimes_garbage(
            st.sampled_from(["nodes", "*", "jobs", "api_keys", "nope", ""]) | texts(8)
        ),
        "filter": sometimes_garbage(FILTERS),
    },
)
CONFIGS = st.fixed_dictionaries(
    {},
    optional={
        "postgres_changes": st.one_of(st.lists(sometimes_garbage(BINDINGS), max_size=4), JSON),
        "broadcast": sometimes_garbage(
            st.fixed_dictionaries({}, optional={"self": sometimes_garbage(st.booleans()), "ack": JSON})
        ),
        "presence": sometimes_garbage(
            st.fixed_dictionaries(
                {},
                optional={
                    "key": sometimes_garbage(texts(20) | st.integers(250, 300).map(lambda n: "k" * n)),
                    "enabled": JSON,
                },
            )
        ),
        "private": sometimes_garbage(st.booleans()),
    },
)
JOIN_PAYLOADS = st.fixed_dictionaries(
    {}, optional={"config": sometimes_garbage(CONFIGS), "access_token": UNSIGNED_TOKENS}
)
BROADCAST_PAYLOADS = st.fixed_dictionaries(
    {"event": sometimes_garbage(texts(12))},
    optional={"type": sometimes_garbage(st.just("broadcast")), "payload": JSON, "meta": JSON},
)
PRESENCE_PAYLOADS = st.fixed_dictionaries(
    {},
    optional={
        "event": sometimes_garbage(st.sampled_from(["track", "untrack", "sync", ""])),
        "payload": sometimes_garbage(st.dictionaries(texts(8), JSON, max_size=4)),
    },
)
PAYLOADS = st.one_of(
    JOIN_PAYLOADS,
    BROADCAST_PAYLOADS,
    PRESENCE_PAYLOADS,
    st.fixed_dictionaries({"access_token": UNSIGNED_TOKENS}),
    st.dictionaries(texts(8), JSON, max_size=4),
)


@st.composite
def phoenix_messages(draw: st.DrawFn, vsn: str) -> str:
    """A Phoenix message, each position of it right or (now and then) any JSON, or missing."""
    fields: dict[str, Any] = {
        "topic": draw(sometimes_garbage(TOPICS)),
        "event": draw(sometimes_garbage(EVENTS)),
        "payload": draw(sometimes_garbage(PAYLOADS)),
        "ref": draw(REFS),
        "join_ref": draw(REFS),
    }
    shape = draw(st.sampled_from(["own", "own", "own", "other", "short"]))
    if (vsn == V2) == (shape != "other"):
        array = [fields["join_ref"], fields["ref"], fields["topic"], fields["event"], fields["payload"]]
        if shape == "short":
            array = array[: draw(st.integers(0, 4))]
        return dumps(array, draw(st.booleans()))
    if shape == "short":
        for name in draw(st.sets(st.sampled_from(sorted(fields)))):
            del fields[name]
    return dumps(fields, draw(st.booleans()))


def big_payload_message(vsn: str, size: int, char: str) -> str:
    """A broadcast carrying `size` copies of `char`, sent as UTF-8 (not escaped)."""
    payload = {"type": "broadcast", "event": "big", "payload": char * size}
    return dumps(message(vsn, "realtime:fuzz", "broadcast", payload, "big"), ascii_only=False)


@st.composite
def any_frames(draw: st.DrawFn, vsn: str) -> Frame:
    kind = draw(st.sampled_from(["json", "text", "phoenix", "phoenix", "phoenix", "join", "big"]))
    if kind == "json":
        return dumps(draw(JSON), draw(st.booleans()))
    if kind == "text":
        return draw(texts(40)).encode(errors="replace").decode()  # any text, most of it not JSON
    if kind == "join":
        return encode(vsn, "realtime:fuzz", "phx_join", {"config": {"broadcast": {"self": True}}}, "join")
    if kind == "big":
        size = draw(st.integers(0, 60_000))
        return big_payload_message(vsn, size // 4, draw(st.sampled_from(["x", "é", "€", "\U0001f600"])))
    return draw(phoenix_messages(vsn))


@st.composite
def binary_frames(draw: st.DrawFn) -> bytes:
    """realtime-js's User Broadcast Push layout (kind, five lengths, encoding, fields, payload),
    with any bytes in any place; or any bytes at all."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=100))
    kind = draw(st.sampled_from([3, 3, 3, 0, 1, 2, 4, 255]))
    fields = [
        draw(st.sampled_from([b"", b"j", b"1"]) | st.binary(max_size=8)),
        draw(st.sampled_from([b"", b"r1", b"2"]) | st.binary(max_size=8)),
        draw(
            st.sampled_from([b"realtime:fuzz", b"realtime:node-map", b"", b"phoenix"])
            | st.binary(max_size=16)
        ),
        draw(st.sampled_from([b"e", b""]) | texts(8).map(lambda t: t.encode(errors="surrogatepass"))),
        draw(
            st.sampled_from([b"", b"{}", b'{"id": 1}', b"[", b"null"])
            | JSON.map(lambda v: dumps(v).encode())
            | st.binary(max_size=12)
        ),
    ]
    fields = [f[:255] for f in fields]  # a length is one byte
    lengths = [len(f) for f in fields]
    if draw(st.integers(0, 4)) == 0:  # lengths that do not match what follows
        lengths = draw(st.lists(st.integers(0, 255), min_size=5, max_size=5))
    encoding = draw(st.sampled_from([1, 1, 1, 0, 2, 255]))
    payload = draw(
        JSON.map(lambda v: dumps(v, ascii_only=False).encode(errors="surrogatepass")) | st.binary(max_size=40)
    )
    return bytes([kind, *lengths, encoding]) + b"".join(fields) + payload


# -- the tests ------------------------------------------------------------------------------------


@LIVE_SERVER
@given(vsn=VSNS, frames=st.data())
def test_frames_of_any_shape(fuzzed: Fuzzed, vsn: str, frames: st.DataObject) -> None:
    """Any JSON, any text, Phoenix messages with wrong types, big payloads: replies or silence."""
    batch = frames.draw(st.lists(any_frames(vsn), max_size=12), label="frames")
    fuzzed.exchange(vsn, batch)


@LIVE_SERVER
@given(vsn=VSNS, event=texts(12), payload=JSON, ascii_only=st.booleans())
def test_broadcasts_come_back_as_sent(
    fuzzed: Fuzzed, vsn: str, event: str, payload: Any, ascii_only: bool
) -> None:
    """A broadcast of any JSON payload on a channel joined with self and ack is acknowledged and
    echoed as JSON that JSON.parse reads (no NaN or Infinity, which realtime-js cannot parse) and
    equal to what was sent; or refused."""
    join = encode(
        vsn, "realtime:echo", "phx_join", {"config": {"broadcast": {"self": True, "ack": True}}}, "j"
    )
    body = {"type": "broadcast", "event": event, "payload": payload}
    sent = dumps(message(vsn, "realtime:echo", "broadcast", body, "b", "j"), ascii_only)
    client = fuzzed.exchange(vsn, [join, sent])
    replies = [m.payload for m in client.received if m.event == "phx_reply" and m.ref == "b"]
    echoes = [m.payload for m in client.received if m.event == "broadcast"]
    if replies and replies[0]["status"] == "ok":
        assert len(echoes) == 1, echoes
        assert echoes[0]["event"] == event and echoes[0]["payload"] == payload, (echoes[0], payload)
    elif not replies:  # not read as a message (silence is the answer to what is no message)
        assert not echoes, echoes


def deep_frames(vsn: str, depth: int, opener: str, where: str) -> list[Frame]:
    """A join with self-broadcast, then JSON nested `depth` deep: the whole message, a join's payload
    or a broadcast's (which the server echoes, so it encodes it again)."""
    closer = "]" if opener == "[" else "}"
    deep = opener * depth + ("0" if opener != "[" else "") + closer * depth
    join = encode(
        vsn, "realtime:fuzz", "phx_join", {"config": {"broadcast": {"self": True, "ack": True}}}, "j"
    )
    if where == "envelope":
        return [join, deep]
    if where == "payload":
        text = encode(vsn, "realtime:fuzz", "phx_join", {"x": "DEEP"}, "deep")
    else:
        body = {"type": "broadcast", "event": "e", "payload": "DEEP"}
        text = encode(vsn, "realtime:fuzz", "broadcast", body, "deep")
    return [join, Deep(text.replace('"DEEP"', deep), "deep")]


OPENERS = st.sampled_from(["[", '{"a":'])
WHERE = st.sampled_from(["payload", "broadcast", "envelope"])


@LIVE_SERVER
@given(
    vsn=VSNS,
    # Not the band around the interpreter's recursion limit: while a test runs, Hypothesis raises
    # that limit, which is the server thread's too, so there the outcome would depend on Hypothesis.
    # test_json_nested_up_to_the_recursion_limit covers that band, at the limit the server runs with.
    depth=st.integers(1, 400) | st.integers(5_000, 30_000),
    opener=OPENERS,
    where=WHERE,
)
def test_deeply_nested_json(fuzzed: Fuzzed, vsn: str, depth: int, opener: str, where: str) -> None:
    """JSON nested `depth` deep (within the 1 MiB frame the server decodes) is refused or handled."""
    fuzzed.exchange(vsn, deep_frames(vsn, depth, opener, where))


def test_json_nested_up_to_the_recursion_limit(fuzzed: Fuzzed) -> None:
    """Every depth just below the recursion limit (some 50 levels of it are the server's own stack):
    json.loads may take a broadcast that json.dumps, deeper in the stack when the server echoes it,
    cannot write again. Not Hypothesis: it would move the limit (see above)."""
    limit = sys.getrecursionlimit()
    for depth in range(limit - 70, limit + 3):
        fuzzed.exchange(V1, deep_frames(V1, depth, "[", "broadcast"))


@LIVE_SERVER
@given(vsn=VSNS, join_first=st.booleans(), frames=st.lists(binary_frames(), min_size=1, max_size=8))
def test_binary_frames(fuzzed: Fuzzed, vsn: str, join_first: bool, frames: list[bytes]) -> None:
    """Binary frames of any bytes, shaped like realtime-js's broadcast pushes or not."""
    join = encode(
        vsn, "realtime:fuzz", "phx_join", {"config": {"broadcast": {"self": True, "ack": True}}}, "j"
    )
    fuzzed.exchange(vsn, [join, *frames] if join_first else list(frames))


@st.composite
def channel_actions(draw: st.DrawFn, vsn: str, topic: str) -> str:
    """What a client does on a channel it joined, with garbage where it can put some."""
    event = draw(st.sampled_from(["broadcast", "presence", "access_token", "phx_leave", "phx_join"]) | EVENTS)
    payload = {
        "broadcast": BROADCAST_PAYLOADS,
        "presence": PRESENCE_PAYLOADS,
        "access_token": st.fixed_dictionaries({"access_token": UNSIGNED_TOKENS}),
        "phx_join": JOIN_PAYLOADS,
    }.get(event, st.dictionaries(texts(8), JSON, max_size=3))
    ref = draw(st.text("abc123", min_size=1, max_size=3) | st.none())
    return encode(vsn, topic, event, draw(sometimes_garbage(payload)), ref, "j")


@LIVE_SERVER
@given(vsn=VSNS, data=st.data())
def test_joins_with_garbage_config(fuzzed: Fuzzed, vsn: str, data: st.DataObject) -> None:
    """phx_join with any config (postgres_changes filters, broadcast and presence settings of the
    wrong types, odd private flags and tokens), then what a client does on the channel."""
    topic = data.draw(
        st.sampled_from(["realtime:fuzz", "realtime:node-map", "realtime:a"]) | TOPICS, label="topic"
    )
    frames: list[Frame] = []
    for n in range(data.draw(st.integers(1, 3), label="joins")):
        payload = data.draw(JOIN_PAYLOADS, label="join payload")
        frames.append(encode(vsn, topic, "phx_join", payload, f"join{n}", "j"))
        frames += data.draw(st.lists(channel_actions(vsn, topic), max_size=4), label="actions")
    fuzzed.exchange(vsn, frames)


@LIVE_SERVER
@given(
    vsn=VSNS,
    private=st.booleans(),
    tokens=st.lists(UNSIGNED_TOKENS, min_size=1, max_size=4),
    in_join=st.booleans(),
)
def test_garbage_access_tokens(
    fuzzed: Fuzzed, vsn: str, private: bool, tokens: list[Any], in_join: bool
) -> None:
    """access_token events (and joins) with tokens that are not ours: text, JSON of any type, JWT-shaped
    nonsense, other secrets, other algorithms, expired ones. Refused, the socket stays."""
    frames = fuzz_tokens(vsn, private, tokens, in_join)
    fuzzed.exchange(vsn, frames)


def acceptable(claims: dict[str, Any]) -> bool | None:
    """Whether a token with these claims (role and exp, nothing else) must be taken: an API role and
    an exp that is a finite number in the future. None: other claims (PyJWT has its own rules for
    iat, nbf, sub...), or an exp too close to now to tell."""
    if not set(claims) <= {"role", "exp"}:
        return None
    exp = claims.get("exp")
    if isinstance(exp, int) and not isinstance(exp, bool) and abs(exp) > 2**1000:
        return None  # beyond a float: never expiring or refused, either will do (but no crash)
    if not isinstance(exp, int | float) or isinstance(exp, bool) or not math.isfinite(exp):
        return False
    if abs(exp - time.time()) < 60:
        return None
    return claims.get("role") in ("anon", "authenticated", "service_role") and exp > time.time()


@LIVE_SERVER
@given(vsn=VSNS, claims=st.lists(CLAIMS, min_size=1, max_size=3), in_join=st.booleans())
def test_signed_tokens_with_hostile_claims(
    fuzzed: Fuzzed, vsn: str, claims: list[dict[str, Any]], in_join: bool
) -> None:
    """Tokens signed with the stack's own secret whose claims are garbage (role or exp of any type,
    NaN, infinite, missing): only a holder of the JWT secret can make them, and they too are refused
    (a join with one is refused; one with an API role and a finite exp in the future is taken)."""
    tokens = [jwt.encode(c, PLACEHOLDER_SECRET, algorithm="HS256") for c in claims]
    client = fuzzed.exchange(vsn, fuzz_tokens(vsn, False, tokens, in_join))
    for n, claim in enumerate(claims):
        must = acceptable(claim)
        if in_join and must is not None:
            [reply] = [m for m in client.received if m.event == "phx_reply" and m.ref == f"join{n}"]
            taken = reply.payload["status"] == "ok"
            assert taken == must, f"a join with claims {claim} was {'taken' if taken else 'refused'}: {reply}"


def fuzz_tokens(vsn: str, private: bool, tokens: list[Any], in_join: bool) -> list[Frame]:
    config = {"private": private, "broadcast": {"self": True, "ack": True}}
    frames: list[Frame] = [encode(vsn, "realtime:tok", "phx_join", {"config": config}, "join", "j")]
    for n, token in enumerate(tokens):
        if in_join:
            payload = {"config": config, "access_token": token}
            frames.append(encode(vsn, "realtime:tok", "phx_join", payload, f"join{n}", "j"))
        frames.append(encode(vsn, "realtime:tok", "access_token", {"access_token": token}, f"tok{n}", "j"))
        body = {"type": "broadcast", "event": "after", "payload": {"n": n}}
        frames.append(encode(vsn, "realtime:tok", "broadcast", body, f"b{n}", "j"))
    return frames


@LIVE_SERVER
@given(
    vsn=st.sampled_from([V1, V2, V1, V2, "", "3.0.0", "1.0.0\x00"]) | texts(8),
    signed=st.booleans(),
    unsigned_key=UNSIGNED_TOKENS,
    signed_key=SIGNED_TOKENS,
)
def test_connecting_with_any_apikey_and_vsn(
    fuzzed: Fuzzed, vsn: str, signed: bool, unsigned_key: Any, signed_key: str
) -> None:
    """The handshake with any apikey (signed with our secret or not) and any vsn is refused (HTTP 403,
    as Supabase refuses it) or makes a socket that works; never an HTTP 500."""
    apikey = signed_key if signed else unsigned_key
    say(f"vsn {vsn!r}, apikey {apikey!r}")
    fuzzed.errors.clear()
    key = apikey if isinstance(apikey, str) else dumps(apikey)
    # Lone surrogates go as the bytes they would be (percent-escaped, not UTF-8).
    query = urlencode(
        {"apikey": key.encode(errors="surrogatepass"), "vsn": vsn.encode(errors="surrogatepass")}
    )
    url = f"{fuzzed.gateway.replace('http://', 'ws://')}/realtime/v1/websocket?{query}"
    try:
        ws = connect(url, open_timeout=10)
    except InvalidStatus as refused:
        status = refused.response.status_code
        raise_logged(fuzzed.errors, wait_s=0.2 if status >= 500 else 0.0)
        assert status == 403, f"the handshake was answered {status}"
    else:
        speaks = vsn or V1  # no vsn (or an empty one) is 1.0.0, as on Supabase
        ws.send(encode(speaks, "phoenix", "heartbeat", {}, "hb"))
        data = ws.recv(timeout=RECV_TIMEOUT_S)
        ws.close()
        assert isinstance(data, str), data
        answer = strict_json(data)
        assert speaks in (V1, V2), f"vsn {vsn!r} was accepted"
        assert answer == message(speaks, "phoenix", "phx_reply", {"status": "ok", "response": {}}, "hb"), (
            answer
        )
    fuzzed.check_health()


@LIVE_SERVER
@given(
    vsn=VSNS, before=st.lists(st.sampled_from(["heartbeat", "join"]), max_size=2), data=st.binary(min_size=1)
)
def test_text_that_is_not_utf8_is_closed_with_1007(
    fuzzed: Fuzzed, vsn: str, before: list[str], data: bytes
) -> None:
    """A text frame that is not UTF-8 breaks RFC 6455: the socket is closed with 1007 (invalid
    frame payload data), never with an internal error, and the server stays up for everyone else."""
    try:
        data.decode()
    except UnicodeDecodeError:
        pass
    else:
        data += b"\xff"
    frames: list[Frame] = [
        encode(vsn, "phoenix", "heartbeat", {}, "h")
        if step == "heartbeat"
        else encode(vsn, "realtime:fuzz", "phx_join", {}, "j")
        for step in before
    ]
    # uvicorn logs each such frame as an error of its own (with a traceback): tolerated here.
    uvicorn_log = "Invalid UTF-8 sequence received from client"
    fuzzed.exchange(vsn, [*frames, BadText(data)], closes_with=1007, tolerated=uvicorn_log)


@LIVE_SERVER
@given(
    vsn=VSNS,
    char=st.sampled_from(["x", "é", "€", "\U0001f600"]),
    size=st.integers(0, 70_000),
    presence=st.booleans(),
)
def test_size_limits_count_the_bytes_sent(
    fuzzed: Fuzzed, vsn: str, char: str, size: int, presence: bool
) -> None:
    """A message is refused (PayloadSizeExceeded) exactly when its frame, as sent, is over the limit:
    64 KiB a message, 8 KiB a presence track, counted in bytes, whatever the characters."""
    copies = size // len(char.encode())
    if presence:
        payload = {"event": "track", "payload": {"bio": char * copies}}
        frame = dumps(message(vsn, "realtime:fuzz", "presence", payload, "big"), ascii_only=False)
    else:
        frame = big_payload_message(vsn, copies, char)
    sent = len(frame.encode())
    join = encode(vsn, "realtime:fuzz", "phx_join", {"config": {"broadcast": {"ack": True}}}, "j")
    client = fuzzed.exchange(vsn, [join, frame])
    [reply] = [m for m in client.received if m.ref == "big"]
    limit = LIMITS.max_message_bytes
    if presence and sent <= LIMITS.max_message_bytes:
        limit = LIMITS.max_presence_bytes
    if sent <= limit:
        assert reply.payload["status"] == "ok", (sent, limit, reply.payload)
    else:
        assert reply.payload["status"] == "error", f"a {sent}-byte frame passed the {limit}-byte limit"
        assert reply.payload["response"]["reason"] == (
            f"PayloadSizeExceeded: the message is {sent} bytes; the limit is {limit}"
        )
