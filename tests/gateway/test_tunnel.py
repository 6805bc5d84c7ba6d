"""The gateway's end of a tunnel, spoken to frame by frame as an agent would (or a broken one)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, cast

import httpx
import psycopg
import pytest
from starlette.websockets import WebSocket
from websockets.sync.client import connect
from websockets.sync.connection import Connection

from neuralgrid.gateway.tunnel import Tunnel, Tunnels
from neuralgrid.protocol.tunnel import (
    FLOW_HEADER,
    UNWINDOWED_CAP,
    WINDOW,
    Cancel,
    Data,
    End,
    More,
    Req,
    Start,
    encode,
    gateway_frame,
)
from tests.conftest import LLAMA8, node_row, wait_for

BODY = {"model": LLAMA8, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REGISTRATION = {
    "name": "raw-agent",
    "gpu_model": "NVIDIA GeForce RTX 4090",
    "vram_gb": 24,
    "tflops": 165,
    "hourly_rate": 0.3,
    "region": "eu-west",
    "endpoint_url": "tunnel:raw-agent",
    "models": [LLAMA8],
}


@contextmanager
def raw_tunnel(
    conn: psycopg.Connection,
    gateway: str,
    api_key: str,
    heartbeat: dict[str, Any] | None = None,
    flow: bool = True,
) -> Iterator[Connection]:
    """A registered node whose tunnel is this test's socket, yielded once the node is online; with
    `flow`, it says it keeps to windows (an agent from before flow control does not)."""
    auth = {"authorization": f"Bearer {api_key}"}
    node = httpx.post(f"{gateway}/v1/nodes", json=REGISTRATION, headers=auth).json()
    secret = {"authorization": f"Bearer {node['node_secret']}"}
    beat = httpx.post(
        f"{gateway}/v1/nodes/{node['node_id']}/heartbeat",
        json=heartbeat or {"models": [LLAMA8]},
        headers=secret,
    )
    assert beat.status_code == 200, beat.text
    url = gateway.replace("http", "ws", 1) + f"/v1/nodes/{node['node_id']}/tunnel"
    headers = {**secret, FLOW_HEADER: "more"} if flow else secret
    with connect(url, additional_headers=headers, max_size=None) as ws:
        wait_for(lambda: node_row(conn, "raw-agent")[1] == "online")
        yield ws


def ask(gateway: str, api_key: str) -> Any:
    return httpx.post(
        f"{gateway}/v1/chat/completions",
        json=BODY,
        headers={"authorization": f"Bearer {api_key}"},
        timeout=10,
    )


def test_an_answer_in_frames_reaches_the_client(conn: psycopg.Connection, gateway: str, api_key: str) -> None:
    with raw_tunnel(conn, gateway, api_key) as ws, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask, gateway, api_key)
        request = gateway_frame(ws.recv(timeout=5))
        assert isinstance(request, Req) and request.path == "/v1/chat/completions"
        reply = '{"id": "x", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}'
        for frame in (
            Start(id=request.id, status=200),
            Data(id=request.id, b=reply[:20]),
            Data(id=request.id, b=reply[20:]),
            End(id=request.id),
        ):
            ws.send(encode(frame))
        resp = answer.result(timeout=10)
        assert resp.status_code == 200 and resp.json()["usage"]["total_tokens"] == 3


def test_a_malformed_frame_closes_the_tunnel_and_the_client_gets_a_clear_error(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    with raw_tunnel(conn, gateway, api_key) as ws, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask, gateway, api_key)
        request = gateway_frame(ws.recv(timeout=5))
        ws.send(json.dumps({"t": "start", "id": request.id, "status": "fine"}))
        resp = answer.result(timeout=10)
        # The only node failed before its first byte: the client hears so, as OpenAI-shaped JSON.
        assert resp.status_code in (502, 503) and "message" in resp.json()["error"], resp.text
        wait_for(lambda: node_row(conn, "raw-agent")[1] == "offline")


def test_an_upload_whose_content_type_no_frame_can_carry_is_a_400_that_blames_no_node(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """HTTP allows a tab in a header value; a frame carries a content type of printable ASCII only.
    Such an upload used to fail inside the gateway once its node was claimed: a 500, and the node
    counted a failure and cooled down, so any key could keep a tunneled node out of service."""
    whisper = "openai/whisper-large-v3"
    beat = {"models": [whisper], "backend": {"kind": "vllm", "routes": ["audio/transcriptions"]}}
    form = httpx.Request(
        "POST",
        "http://x",
        files={"file": ("a.wav", b"RIFF" + bytes(range(256)), "audio/wav")},
        data={"model": whisper},
    )
    body, content_type = form.read(), form.headers["content-type"].replace("; boundary", ";\tboundary")
    auth = {"authorization": f"Bearer {api_key}"}
    with raw_tunnel(conn, gateway, api_key, beat) as ws:
        resp = httpx.post(
            f"{gateway}/v1/audio/transcriptions",
            content=body,
            headers={**auth, "content-type": content_type},
            timeout=10,
        )
        assert resp.status_code == 400, resp.text
        assert "Content-Type" in resp.json()["error"]["message"]
        with pytest.raises(TimeoutError):
            ws.recv(timeout=0.5)  # the node was asked nothing
    failures = conn.execute("select failures, cooldown_until from nodes where name = 'raw-agent'").fetchone()
    assert failures == (0, None)


def event(text: str) -> str:
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": LLAMA8,
        "choices": [{"index": 0, "delta": {"content": text}}],
    }
    return f"data: {json.dumps(chunk)}\n\n"


@pytest.mark.parametrize("flow", [True, False])
def test_an_agent_that_sends_beyond_its_window_is_cut_off(
    conn: psycopg.Connection, gateway: str, api_key: str, flow: bool
) -> None:
    """A socket carries every request of its node, so the gateway cannot slow an agent down the way
    TCP slows an HTTP node: an agent that ignores its window while the client reads nothing would
    fill the gateway's memory (measured: 400 MiB in 3.4 s). It is cut off, and told to stop; an agent
    from before flow control, at UNWINDOWED_CAP."""
    body = json.dumps({**BODY, "stream": True}).encode()
    host, port = gateway.removeprefix("http://").split(":")
    with (
        raw_tunnel(conn, gateway, api_key, flow=flow) as ws,
        socket.create_connection((host, int(port))) as client,
    ):
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it never reads
        client.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {api_key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        request = gateway_frame(ws.recv(timeout=5))
        ws.send(encode(Start(id=request.id, status=200, type="text/event-stream")))
        flood = encode(Data(id=request.id, b=event("y" * (1 << 20))))
        told: list[Cancel | More | Req] = []
        for _ in range(UNWINDOWED_CAP // (1 << 20) + 16):  # past the cap: the gateway's buffers are far less
            ws.send(flood)
            with contextlib.suppress(TimeoutError):
                while not any(isinstance(frame, Cancel) for frame in told):
                    told.append(gateway_frame(ws.recv(timeout=0.05)))
            if any(isinstance(frame, Cancel) for frame in told):
                break
        assert any(isinstance(frame, Cancel) and frame.id == request.id for frame in told), told
    wait_for(lambda: conn.execute("select status from jobs").fetchone() == ("failed",))


def test_an_answer_bigger_than_the_window_flows_as_the_client_reads(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """An agent that keeps to its window gets `more` as the client reads: an answer of three windows
    arrives whole, the agent never having more than one window out."""
    piece = event("z" * 65536)
    pieces = 3 * WINDOW // len(piece) + 1

    def agent(ws: Connection) -> int:
        request = gateway_frame(ws.recv(timeout=5))
        ws.send(encode(Start(id=request.id, status=200, type="text/event-stream")))
        out = most = 0
        for _ in range(pieces):
            while out and out + len(piece) > WINDOW:
                more = gateway_frame(ws.recv(timeout=10))
                assert isinstance(more, More) and more.id == request.id
                out -= more.n
            ws.send(encode(Data(id=request.id, b=piece)))
            out += len(piece)
            most = max(most, out)
        ws.send(encode(End(id=request.id)))
        return most

    with raw_tunnel(conn, gateway, api_key) as ws, ThreadPoolExecutor(1) as pool:
        sent = pool.submit(agent, ws)
        with httpx.stream(
            "POST",
            f"{gateway}/v1/chat/completions",
            json={**BODY, "stream": True},
            headers={"authorization": f"Bearer {api_key}"},
            timeout=30,
        ) as resp:
            assert resp.status_code == 200
            got = [line.count("z") for line in resp.iter_lines() if '"z' in line]
        assert got == [65536] * pieces
        assert sent.result(timeout=10) <= WINDOW


async def test_a_request_cancelled_before_its_status_line_is_cancelled_at_the_agent() -> None:
    """Read in review: a caller cancelled while it waited for the node's status line (its client
    gone, the gateway stopping) left the request pending on the socket and the agent working on it;
    the forwarding path already told the agent."""
    told: list[Req | Cancel | More] = []

    class Socket:
        async def send_text(self, text: str) -> None:
            told.append(gateway_frame(text))

    link = Tunnel(uuid.uuid4(), cast(WebSocket, Socket()))
    tunnels = Tunnels(uuid.uuid4())
    tunnels.attach(link)
    opening = asyncio.create_task(tunnels.open(link.node_id, "/v1/chat/completions", b"{}", 30))
    await asyncio.sleep(0.05)  # the request is on the socket, its status line not yet in
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert link.pending == {}
    assert [type(frame) for frame in told] == [Req, Cancel]


def test_an_agent_from_before_flow_control_still_sends_a_big_answer_to_an_eager_reader(
    conn: psycopg.Connection, gateway: str, api_key: str
) -> None:
    """Found in review: an agent that says nothing of windows (one from before them) sending a whole
    answer of 16 MiB at once was cut off after its first 4 MiB, though the gateway read it as fast as
    it came: messages already in took no turn of the gateway's loop, so its reader never ran."""
    content = "x" * (16 << 20)
    reply = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "model": LLAMA8,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
    )
    with raw_tunnel(conn, gateway, api_key, flow=False) as ws, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask, gateway, api_key)
        request = gateway_frame(ws.recv(timeout=5))
        ws.send(encode(Start(id=request.id, status=200)))
        for at in range(0, len(reply), 1 << 20):
            ws.send(encode(Data(id=request.id, b=reply[at : at + (1 << 20)])))
        ws.send(encode(End(id=request.id)))
        resp = answer.result(timeout=30)
        assert resp.status_code == 200, resp.text[:300]
        assert len(resp.json()["choices"][0]["message"]["content"]) == len(content)
        with pytest.raises(TimeoutError):
            ws.recv(timeout=0.2)  # and it was sent no `more`, which it would not understand
