"""The agent's end of a tunnel's flow control, spoken to by a gateway of this test's own: it keeps to
each answer's window when the gateway says it sends `more`, and holds nothing back for one from
before flow control (which would otherwise leave it waiting for ever after the first window)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from neuralgrid.agent.backend import Backend
from neuralgrid.agent.front import FrontState
from neuralgrid.agent.tunnel import TunnelClient, Window, _send_data
from neuralgrid.dev.fakenode import FakeNodeConfig, create_fake_node
from neuralgrid.protocol.tunnel import (
    FLOW_HEADER,
    MAX_DATA,
    WINDOW,
    Data,
    End,
    Err,
    More,
    Req,
    Start,
    agent_frame,
    encode,
)
from neuralgrid.server.serving import ThreadedServer
from tests.conftest import LLAMA8

TOKENS = 30_000  # about 200 bytes of SSE each: more than a window
CHAT = {
    "model": LLAMA8,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": TOKENS,
    "stream": True,
}


@asynccontextmanager
async def agent_dialling(gateway: str, backend: str) -> AsyncIterator[TunnelClient]:
    front = FrontState(Backend(backend))
    client = TunnelClient([gateway], "node", "secret", front)
    running = asyncio.create_task(client.run())
    try:
        yield client
    finally:
        client.close.set()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await front.backend.aclose()


async def answer_bytes(ws: ServerConnection, hold: bool) -> tuple[int, int, int]:
    """Ask for the stream and read it; with `hold`, acknowledge nothing until the agent has sent
    nothing for a second, then all of it, once. Returns the characters received, those out when the
    agent fell silent, and the size of the frame it sent next."""
    await ws.send(encode(Req(id=1, path="/v1/chat/completions", body=json.dumps(CHAT))))
    got = paused_at = held = 0
    while True:
        try:
            frame = agent_frame(await asyncio.wait_for(ws.recv(), 1.0 if hold and not paused_at else 30))
        except TimeoutError:
            if not hold or paused_at:
                raise
            if got:  # silent with data out: the agent keeps to its window, or it would go on
                paused_at = got
                await ws.send(encode(More(id=1, n=got)))
            continue
        assert not isinstance(frame, Start) or frame.status == 200
        if isinstance(frame, Data):
            held = held or (len(frame.b) if paused_at else 0)
            got += len(frame.b)
        elif isinstance(frame, End):
            return got, paused_at, held


@pytest.mark.parametrize("flow", [True, False])
async def test_the_agent_keeps_to_its_window_only_for_a_gateway_that_says_more(flow: bool) -> None:
    result: asyncio.Future[tuple[int, int, int]] = asyncio.get_running_loop().create_future()

    async def gateway(ws: ServerConnection) -> None:
        result.set_result(await answer_bytes(ws, hold=flow))

    def announce(_: ServerConnection, __: Request, response: Response) -> Response:
        if flow:
            response.headers[FLOW_HEADER] = "more"
        return response

    config = FakeNodeConfig(models=(LLAMA8,), context_length=65_536)
    with ThreadedServer(create_fake_node(config)) as backend:
        async with (
            serve(gateway, "127.0.0.1", 0, process_response=announce) as server,
            agent_dialling(f"http://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}", backend.url),
        ):
            got, paused_at, held = await asyncio.wait_for(result, 60)
    assert got > WINDOW  # the whole answer came, past its first window
    if flow:
        # The agent stopped at its window, until `more`: with the frame it held back, just past it.
        assert paused_at <= WINDOW < paused_at + held


async def test_data_goes_in_frames_of_half_a_window_so_acknowledgements_always_come() -> None:
    """Found in review: after a little data the gateway has not acknowledged (it does so by halves of
    the window), a chunk of nearly a window waited for room that no `more` would ever make. Sent in
    frames of at most half a window, whatever is out past half a window is acknowledged."""
    frames: asyncio.Queue[Data] = asyncio.Queue()
    window = Window(WINDOW)

    async def send(frame: Start | Data | End | Err) -> None:
        assert isinstance(frame, Data)
        await frames.put(frame)

    async def gateway(expected: int) -> str:
        got: list[str] = []
        taken = 0
        while sum(len(piece) for piece in got) < expected:
            frame = await frames.get()
            assert len(frame.b) <= MAX_DATA
            got.append(base64.b64decode(frame.b).decode() if frame.b64 else frame.b)
            taken += len(frame.b)
            if taken >= MAX_DATA:  # as the gateway's reader acknowledges
                window.more(taken)
                taken = 0
        return "".join(got)

    text, raw = "a" * 100, b"b" * (WINDOW - 1000)  # the second goes in base64: a third bigger again
    reading = asyncio.create_task(gateway(len(text) + len(raw)))
    await asyncio.wait_for(_send_data(send, window, 1, text), 5)
    await asyncio.wait_for(_send_data(send, window, 1, raw), 5)
    assert await asyncio.wait_for(reading, 5) == text + raw.decode()
