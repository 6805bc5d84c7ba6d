"""The agent's hop, in one process: its relay to the server (kept-alive connections, a C parser) and
its signed front (a bare ASGI app), against the fake node and against raw sockets that misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from neuralgrid.agent import answers
from neuralgrid.agent.backend import Backend
from neuralgrid.agent.front import MAX_REQUEST_BYTES, BackendUnreachable, FrontState, create_front
from neuralgrid.agent.relay import Relay, RelayError
from neuralgrid.dev.fakenode import FakeNodeConfig, create_fake_node
from neuralgrid.protocol import signing
from neuralgrid.server.serving import ThreadedServer, free_port
from tests.conftest import stop_promptly

LLAMA8 = "meta-llama/Llama-3.1-8B-Instruct"
SERVED = "/models/llama-8b.Q4_K_M.gguf"  # the name an owner's server reports
KEY = signing.node_key("ngn-test-secret")
CHAT = "/v1/chat/completions"


def chat(stream: bool = False, **extra: Any) -> bytes:
    body = {
        "model": LLAMA8,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": stream,
    }
    return json.dumps({**body, **extra}).encode()


def events(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# The relay -----------------------------------------------------------------------------------


async def test_the_relay_keeps_one_connection_for_requests_one_after_another() -> None:
    with ThreadedServer(create_fake_node(FakeNodeConfig(models=(LLAMA8,)))) as node:
        relay = Relay(node.url)
        try:
            for stream in (False, True, False, True):
                resp = await relay.post(CHAT, chat(stream))
                body = b"".join([chunk async for chunk in resp])
                assert resp.status == 200 and resp.finished()
                if stream:
                    assert resp.length is None and resp.content_type.startswith(b"text/event-stream")
                    assert body.endswith(b"data: [DONE]\n\n") and len(events(body.decode())) == 4
                else:
                    assert resp.length == len(body) and json.loads(body)["model"] == LLAMA8
                resp.release()
            assert len(relay.connections) == 1 and node.app.state.requests == 4
        finally:
            relay.close()


def test_the_relay_runs_on_uvloop_too() -> None:
    """The agent may run on uvloop, as the gateway does: its transports are not asyncio's classes."""
    uvloop = pytest.importorskip("uvloop")

    async def twice(url: str) -> list[bytes]:
        relay = Relay(url)
        bodies = []
        for stream in (False, True):
            resp = await relay.post(CHAT, chat(stream))
            bodies.append(b"".join([chunk async for chunk in resp]))
            resp.release()
        relay.close()
        return bodies

    with ThreadedServer(create_fake_node(FakeNodeConfig(models=(LLAMA8,)))) as node:
        plain, stream = uvloop.run(twice(node.url))
    assert json.loads(plain)["model"] == LLAMA8 and stream.endswith(b"data: [DONE]\n\n")


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handle: Handler) -> AsyncIterator[str]:
    """A server written byte by byte, to misbehave as real ones do; its URL."""
    writers: list[asyncio.StreamWriter] = []

    async def handled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            await handle(reader, writer)

    server = await asyncio.start_server(handled, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()
        await asyncio.sleep(0)  # the transports' closing callbacks


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def test_a_request_that_meets_a_closing_connection_goes_again_on_a_new_one() -> None:
    """A server that ends a kept-alive connection as the next request goes out on it (llama.cpp's
    does after some streams) never read that request: it is sent once more, on a new connection.
    A new connection that closes unanswered is an error, not a loop."""
    seen: list[tuple[int, bytes]] = []

    async def first_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = len({c for c, _ in seen})
        seen.append((n, await read_request(reader)))
        writer.write(OK)
        await writer.drain()
        await reader.read(1)  # the next request arrives: close without answering it
        writer.close()

    async with raw_server(first_only) as url:
        relay = Relay(url)
        try:
            for body in (b'{"n": 1}', b'{"n": 2}'):
                resp = await relay.post(CHAT, body)
                assert resp.status == 200 and b"".join([c async for c in resp]) == b"{}"
                resp.release()
            assert seen == [(0, b'{"n": 1}'), (1, b'{"n": 2}')]  # answered once each
        finally:
            relay.close()

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    async with raw_server(never) as url:
        relay = Relay(url)
        try:
            with pytest.raises(RelayError, match="without answering"):
                await relay.post(CHAT, b"{}")
        finally:
            relay.close()


async def test_the_relay_reports_a_silent_server_and_a_broken_answer() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)
        writer.close()

    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
        await writer.drain()
        writer.close()

    async with raw_server(silent) as url:
        relay = Relay(url, read_timeout_s=0.3)
        started = time.monotonic()
        try:
            with pytest.raises(RelayError, match=r"sent nothing for 0\.3 s"):
                await relay.post(CHAT, b"{}")
            assert time.monotonic() - started < 2
        finally:
            relay.close()

    async with raw_server(half) as url:
        relay = Relay(url)
        try:
            resp = await relay.post(CHAT, b"{}")
            with pytest.raises(RelayError, match="mid-answer"):
                async for _ in resp:
                    pass
            resp.release()
        finally:
            relay.close()
    with pytest.raises(ConnectionRefusedError):
        await Relay(f"http://127.0.0.1:{free_port()}").post(CHAT, b"{}")


async def test_a_slow_reader_holds_the_server_back_and_gets_every_byte() -> None:
    big = json.dumps({"data": ["x" * 1000] * 3000}).encode()  # 3 MB, well past the watermark

    async def large(request: Request) -> Response:
        if (await request.json()).get("stream"):

            async def pieces() -> AsyncIterator[bytes]:
                for i in range(0, len(big), 50_000):
                    yield big[i : i + 50_000]

            return StreamingResponse(pieces(), media_type="text/event-stream")
        return Response(big, media_type="application/json")

    with ThreadedServer(Starlette(routes=[Route(CHAT, large, methods=["POST"])])) as node:
        relay = Relay(node.url)
        try:
            for stream in (False, True):
                resp = await relay.post(CHAT, json.dumps({"stream": stream}).encode())
                await asyncio.sleep(0.5)  # the server writes on; the relay stops reading
                assert b"".join([chunk async for chunk in resp]) == big
                resp.release()
        finally:
            relay.close()


# The front -----------------------------------------------------------------------------------


@pytest.fixture
def node() -> Iterator[ThreadedServer]:
    config = FakeNodeConfig(models=(LLAMA8, SERVED), tokens_per_s=0)
    server = ThreadedServer(create_fake_node(config)).start()
    yield server
    stop_promptly(server)  # a test may leave it making a 10 s answer nobody reads


def front_for(url: str, **state: Any) -> tuple[FrontState, ThreadedServer]:
    front = FrontState(Backend(url), key=KEY, **state)
    return front, ThreadedServer(create_front(front))


def signed(body: bytes, path: str = CHAT) -> dict[str, str]:
    return {signing.HEADER: signing.sign(KEY, path, body), "content-type": "application/json"}


def test_the_front_serves_signed_requests_once_and_nothing_else(node: ThreadedServer) -> None:
    front, server = front_for(node.url)
    with server:
        url = server.url + CHAT
        body = chat()
        assert httpx.post(url, content=body).status_code == 401
        forged = signing.sign(signing.node_key("another"), CHAT, body)
        assert httpx.post(url, content=body, headers={signing.HEADER: forged}).status_code == 401
        assert node.app.state.requests == 0
        headers = signed(body)
        answer = httpx.post(url, content=body, headers=headers)
        assert answer.status_code == 200 and answer.json()["model"] == LLAMA8
        assert answer.headers["content-length"] == str(len(answer.content))
        replay = httpx.post(url, content=body, headers=headers)
        assert replay.status_code == 401 and "signed" in replay.json()["error"]["message"]
        assert node.app.state.requests == 1 and front.served == 1
        assert httpx.get(server.url + "/healthz").json() == {"status": "ok", "inflight": 0}
        assert httpx.get(url).status_code == 405 and httpx.post(server.url + "/other").status_code == 404
        front.draining = True
        drained = httpx.post(url, content=body, headers=signed(body))
        assert drained.status_code == 503 and "draining" in drained.json()["error"]["message"]
        assert httpx.get(server.url + "/healthz").json()["status"] == "draining"


def test_a_server_that_is_down_is_a_502() -> None:
    front, server = front_for(f"http://127.0.0.1:{free_port()}")
    with server:
        body = chat()
        answer = httpx.post(server.url + CHAT, content=body, headers=signed(body))
        assert answer.status_code == 502 and "unreachable" in answer.json()["error"]["message"]
        assert front.inflight == 0


def test_the_catalog_name_goes_in_as_the_served_one_and_comes_back(node: ThreadedServer) -> None:
    _, server = front_for(node.url, served_names={LLAMA8: SERVED})
    with server:
        body = chat()
        answer = httpx.post(server.url + CHAT, content=body, headers=signed(body))
        assert node.app.state.last_body["model"] == SERVED
        assert answer.json()["model"] == LLAMA8 and SERVED not in answer.text
        body = chat(stream=True, stream_options={"include_usage": True})
        answer = httpx.post(server.url + CHAT, content=body, headers=signed(body))
        assert answer.text.endswith("data: [DONE]\n\n") and SERVED not in answer.text
        streamed = events(answer.text)
        assert [e["model"] for e in streamed] == [LLAMA8] * 5 and streamed[-1]["usage"][
            "completion_tokens"
        ] == 4


def test_a_stream_without_usage_gets_it_before_its_end(node: ThreadedServer) -> None:
    node.app.state.config.usage_in_streams = False
    front, server = front_for(node.url, served_names={LLAMA8: SERVED})
    asked: list[tuple[str, str, str]] = []

    async def usage(kind: str, request: dict[str, Any], answers: list[str]) -> dict[str, int]:
        (answer,) = answers
        asked.append((kind, request["model"], answer))
        return {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}

    front.backend.usage = usage  # type: ignore[method-assign]
    with server:
        body = chat(stream=True, stream_options={"include_usage": True})
        answer = httpx.post(server.url + CHAT, content=body, headers=signed(body))
        streamed = events(answer.text)
        text = "".join(e["choices"][0]["delta"]["content"] for e in streamed[:-1])
        assert asked == [("chat", SERVED, text)]  # the server's own name, to count with
        tail = streamed[-1]
        assert tail["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
        assert (tail["id"], tail["model"], tail["choices"]) == (streamed[0]["id"], LLAMA8, [])
        assert answer.text.endswith("data: [DONE]\n\n")
        # A stream that did not ask for usage gets none; one that did not stream is not counted.
        body = chat(stream=True)
        assert "usage" not in httpx.post(server.url + CHAT, content=body, headers=signed(body)).text
        assert len(asked) == 1


@pytest.mark.parametrize("held_bytes", [1 << 16, 100])  # held whole, or read as they come
async def test_usage_is_counted_however_the_events_are_cut(
    monkeypatch: pytest.MonkeyPatch, held_bytes: int
) -> None:
    """CRLF lines, events cut anywhere across chunks, a long answer read as it comes: the usage
    event still goes just before [DONE], counted from the whole text."""
    monkeypatch.setattr(answers, "HELD_BYTES", held_bytes)
    words = [f"word{i} " for i in range(12)]
    sse = b"".join(
        f'data: {{"id": "x1", "created": 5, "choices": [{{"index": 0, "delta": {{"content": "{w}"}}}}]}}\r\n\r\n'.encode()
        for w in words
    )
    sse += b": a comment\r\n\r\ndata: [DONE]\r\n\r\n"

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for i in range(0, len(sse), 7):
            piece = sse[i : i + 7]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    asked: list[str] = []

    async def usage(kind: str, request: dict[str, Any], answers: list[str]) -> dict[str, int]:
        asked.extend(answers)
        return {"prompt_tokens": 1, "completion_tokens": 12, "total_tokens": 13}

    async with raw_server(cut) as url:
        front = FrontState(Backend(url))
        front.backend.usage = usage  # type: ignore[method-assign]
        try:
            answer = await front.forward(CHAT, chat(stream=True, stream_options={"include_usage": True}))
            body = b"".join([chunk async for chunk in answer.chunks])
            await answer.aclose()
        finally:
            await front.backend.aclose()
    assert asked == ["".join(words)] and front.inflight == 0
    head, tail = body.split(b": a comment\n\n")
    assert head == sse.split(b": a comment")[0].replace(b"\r\n", b"\n")
    assert json.loads(tail.split(b"\n\n")[0][6:]) == {
        "id": "x1",
        "created": 5,
        "object": "chat.completion.chunk",
        "model": LLAMA8,
        "choices": [],
        "usage": {"prompt_tokens": 1, "completion_tokens": 12, "total_tokens": 13},
    }
    assert tail.endswith(b"\n\ndata: [DONE]\n\n")


def test_only_events_with_usage_in_them_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    loads = json.loads

    def counted(data: bytes) -> Any:
        parsed.append(data)
        return loads(data)

    monkeypatch.setattr(json, "loads", counted)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    for payload, has in [
        ({"choices": [{"delta": {"content": "usage"}}], "usage": None}, False),
        ({"choices": [{"delta": {"content": '"usage": 1'}}]}, False),
        ({"choices": [], "usage": usage}, True),
        ({"choices": [], "usage": {"prompt_tokens": -1}}, False),
    ]:
        for separators in ((",", ":"), (", ", ": ")):
            event = b"data: " + json.dumps(payload, separators=separators).encode() + b"\n\n"
            assert answers._has_usage(event) is has
    assert len(parsed) == 4  # the two with a usage object, each written two ways


def test_a_gateway_that_hangs_up_ends_the_servers_answer_at_once(node: ThreadedServer) -> None:
    node.app.state.config.tokens_per_s = 20  # 200 tokens: 10 s
    front, server = front_for(node.url)
    with server:
        body = chat(stream=True, max_tokens=200)
        with httpx.stream("POST", server.url + CHAT, content=body, headers=signed(body)) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            assert front.inflight == 1
        started = time.monotonic()
        while front.inflight and time.monotonic() - started < 3:
            time.sleep(0.02)
        assert front.inflight == 0 and time.monotonic() - started < 1
        assert not front.backend.relay.connections  # closed: the server stops generating


@pytest.mark.parametrize("stream", [False, True])
def test_a_gateway_that_hangs_up_before_the_answer_starts_ends_the_servers_work(
    node: ThreadedServer, stream: bool
) -> None:
    """Found by a fault-injection review: a whole answer (which comes at its end) went on being
    generated for minutes after its gateway died, the server's slot taken; a stream likewise until
    its first token. The front watches for the gateway hanging up from the request's start."""
    node.app.state.config.tokens_per_s = 20  # 200 tokens: 10 s before a whole answer's first byte
    node.app.state.config.latency_s = 0 if not stream else 10  # a stream's first token in 10 s
    front, server = front_for(node.url)
    with server:
        body = chat(stream=stream, max_tokens=200)
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(server.url + CHAT, content=body, headers=signed(body), timeout=0.5)
        started = time.monotonic()
        while front.inflight and time.monotonic() - started < 3:
            time.sleep(0.02)
        assert front.inflight == 0 and time.monotonic() - started < 1
        assert not front.backend.relay.connections  # closed: the server stops generating


async def test_forwarding_to_a_server_that_is_down_raises_backend_unreachable() -> None:
    front = FrontState(Backend(f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(BackendUnreachable):
        await front.forward(CHAT, chat())
    assert front.inflight == 0


async def test_a_server_that_cuts_streams_gets_one_request_at_a_time() -> None:
    """llama-cpp-python ends a running stream, without a finish_reason, when any request comes in
    (GET /v1/models too). A second request of the gateway's and the agent's own probe wait for the
    running stream's end instead of cutting it."""
    config = FakeNodeConfig.like("llama-cpp-python", models=(LLAMA8,), tokens_per_s=50)
    with ThreadedServer(create_fake_node(config)) as node:
        front = FrontState(Backend(node.url))
        try:
            await front.backend.detect()
            assert front.fragile

            async def whole(max_tokens: int) -> list[Any]:
                answer = await front.forward(CHAT, chat(stream=True, max_tokens=max_tokens))
                body = b"".join([chunk async for chunk in answer.chunks])
                await answer.aclose()
                return events(body.decode())

            async def probe() -> list[str]:
                async with front.own_turn():
                    return await front.backend.models()

            first = asyncio.create_task(whole(10))
            while not front.inflight:
                await asyncio.sleep(0.005)
            assert front.busy()
            answers = await asyncio.gather(first, whole(3), probe())
        finally:
            await front.backend.aclose()
    assert [e["choices"][0]["finish_reason"] for e in answers[0] if e["choices"]][-1] == "length"
    assert [e["choices"][0]["finish_reason"] for e in answers[1] if e["choices"]][-1] == "length"
    assert answers[2] == [LLAMA8] and front.inflight == 0 and not front.busy()


def test_an_unsigned_or_oversized_request_is_refused_before_its_body_is_read(node: ThreadedServer) -> None:
    """A security review's case: 512 MiB posted unsigned to an agent's public port were all held
    in memory (1 GiB) before the signature was found missing. A request without a signature is
    refused from its headers; one past MAX_REQUEST_BYTES by its length, or as it arrives."""
    _, server = front_for(node.url)
    with server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            # 1 GiB promised, none of it sent: the answer comes at once, from the headers alone.
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n"
            )
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 401")
        huge = b"x" * (MAX_REQUEST_BYTES + 1)
        signature = signing.sign(KEY, CHAT, huge)
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            # Its length says it is too large: refused at once, none of it read.
            sock.sendall(
                f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n{signing.HEADER}: {signature}\r\n"
                f"Content-Length: {len(huge)}\r\n\r\n".encode()
            )
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 413")

        def chunked() -> Iterator[bytes]:  # no length said: counted as it comes
            for i in range(0, len(huge), 1 << 20):
                yield huge[i : i + (1 << 20)]

        # Refused as it arrives: a 413, or (when the refusal and the close beat the client's last
        # write) a connection the agent ended.
        try:
            status: int | None = httpx.post(
                server.url + CHAT, content=chunked(), headers={signing.HEADER: signature}
            ).status_code
        except httpx.TransportError:
            status = None
        assert status in (413, None)
        assert node.app.state.requests == 0
