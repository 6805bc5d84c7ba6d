"""A bare relay, the floor under `bench gateway`'s numbers: what one more HTTP hop through Python costs.

It forwards each POST to one node with the gateway's own node client and sends the answer back
(streams as they come, plain answers whole), served as the gateway is: uvicorn on uvloop. It does
nothing else: no key, no match, no metering. The latency the gateway adds beyond what this adds is
the cost of the gateway's own work.

    python -m neuralgrid.bench.relay --node http://127.0.0.1:9000 --port 9001
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.types import Message, Receive, Scope, Send

from neuralgrid.gateway.upstream import HttpNodes, NodeError
from neuralgrid.server.serving import run_fast


class Relay:
    """An ASGI app relaying every POST to `node_url` (same path); GET answers 200 (readiness)."""

    def __init__(self, node_url: str) -> None:
        self.node_url = node_url.rstrip("/")
        self.nodes: HttpNodes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["method"] != "POST" or self.nodes is None:
            await _answer(send, 200, b"relay", "text/plain")
            return
        body = await _body(receive)
        try:
            resp = await self.nodes.post(
                self.node_url + scope["path"], body, {"content-type": "application/json"}
            )
        except NodeError as err:
            await _answer(send, 502, str(err).encode(), "text/plain")
            return
        try:
            if not resp.content_type.startswith("text/event-stream"):
                await _answer(send, resp.status, await resp.read(), resp.content_type)
                return
            headers = [(b"content-type", resp.content_type.encode())]
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            async for chunk in resp.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await resp.close()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.nodes = HttpNodes(connect_timeout_s=5, read_timeout_s=60)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.nodes is not None:
                    await self.nodes.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message: Message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _answer(send: Send, status: int, body: bytes, content_type: str) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--node", required=True, help="the node's base URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    config = uvicorn.Config(
        Relay(args.node), host=args.host, port=args.port, log_level="warning", access_log=False
    )
    run_fast(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
