"""A bare relay, the floor under `bench gateway`'s numbers: what one more HTTP hop through Python costs.

It forwards each POST to one node with the gateway's own node client and sends the answer back
(streams as they come, plain answers whole), served as the gateway is: uvicorn on uvloop. It does
nothing else: no key, no match, no metering. The latency the gateway adds beyond what this adds is
the cost of the gateway's own work.

With `--database`, it also takes a slot in Postgres before it asks the node and gives it back before
the client has the whole answer: one UPDATE each on a table of its own (bench_relay_slots), through
a pool of 4 connections that commit asynchronously, as the gateway's request path does (and, as
its pools do, hands out the connection returned last: db/pool.py). That is the
least any gateway can do that claims capacity in the database and frees it when the answer is
delivered; what the gateway adds beyond it is its matcher, its ledger and its checks.

    python -m neuralgrid.bench.relay --node http://127.0.0.1:9000 --port 9001 [--database URL]
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.types import Message, Receive, Scope, Send

from neuralgrid.db.pool import LastInFirstOut, commit_asynchronously
from neuralgrid.gateway.upstream import HttpNodes, NodeError
from neuralgrid.server.serving import run_fast

SLOTS = 256  # more than any bench gives callers: a claim never waits for one
CREATE = f"""
create table if not exists bench_relay_slots (id int primary key, used int not null check (used >= 0));
insert into bench_relay_slots select n, 0 from generate_series(1, {SLOTS}) n on conflict do nothing
"""
CLAIM = """
update bench_relay_slots set used = used + 1
 where id = (select id from bench_relay_slots where used = 0 order by id limit 1 for update skip locked)
returning id
"""
RELEASE = "update bench_relay_slots set used = used - 1 where id = %s"


class Slots:
    """A slot claimed and released in Postgres, one statement each."""

    def __init__(self, database_url: str) -> None:
        self.pool = LastInFirstOut(
            database_url,
            min_size=4,
            max_size=4,
            kwargs={"autocommit": True},
            configure=commit_asynchronously,
            open=False,
        )

    async def open(self) -> None:
        await self.pool.open(wait=True, timeout=30)
        async with self.pool.connection() as conn:
            await conn.execute(CREATE)

    async def claim(self) -> int | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(CLAIM)).fetchone()
        return None if row is None else int(row[0])

    async def release(self, slot: int) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(RELEASE, (slot,))


class Relay:
    """An ASGI app relaying every POST to `node_url` (same path); GET answers 200 (readiness). With
    `database_url`, each request holds a slot in Postgres while the node works (see the module)."""

    def __init__(self, node_url: str, database_url: str | None = None) -> None:
        self.node_url = node_url.rstrip("/")
        self.database_url = database_url
        self.nodes: HttpNodes | None = None
        self.slots: Slots | None = None

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
        slot = None if self.slots is None else await self.slots.claim()
        if self.slots is not None and slot is None:
            await _answer(send, 503, b"no free slot", "text/plain")
            return
        held = [slot] if slot is not None else []
        try:
            await self._relay(scope["path"], body, held, send)
        finally:
            await self._release(held)  # (if the relay broke off before it could)

    async def _relay(self, path: str, body: bytes, held: list[int], send: Send) -> None:
        assert self.nodes is not None
        try:
            resp = await self.nodes.post(self.node_url + path, body, {"content-type": "application/json"})
        except NodeError as err:
            await self._release(held)
            await _answer(send, 502, str(err).encode(), "text/plain")
            return
        try:
            if not resp.content_type.startswith("text/event-stream"):
                content = await resp.read()
                await self._release(held)  # before the client has the answer, as the gateway does
                await _answer(send, resp.status, content, resp.content_type)
                return
            headers = [(b"content-type", resp.content_type.encode())]
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            async for chunk in resp.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await self._release(held)
            await send({"type": "http.response.body", "body": b""})
        finally:
            await resp.close()

    async def _release(self, held: list[int]) -> None:
        if self.slots is not None and held:
            await self.slots.release(held.pop())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.nodes = HttpNodes(connect_timeout_s=5, read_timeout_s=60)
                if self.database_url is not None:
                    self.slots = Slots(self.database_url)
                    await self.slots.open()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.nodes is not None:
                    await self.nodes.close()
                if self.slots is not None:
                    await self.slots.pool.close()
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
    parser.add_argument("--database", help="hold a slot in this database while the node works")
    args = parser.parse_args()
    config = uvicorn.Config(
        Relay(args.node, args.database), host=args.host, port=args.port, log_level="warning", access_log=False
    )
    run_fast(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
