"""The demo: a fake OpenAI-compatible node behind the demo fleet, and heartbeats to keep it online."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import UUID

import psycopg

from neuralgrid.db import queries as q
from neuralgrid.db.store import Store
from neuralgrid.dev.fakenode import FakeNodeConfig, create_fake_node
from neuralgrid.protocol.routes import Route
from neuralgrid.server.serving import free_port, make_server, running

log = logging.getLogger(__name__)

DEMO_FLEET = Path(__file__).parent.parent / "data" / "demo_fleet.json"
DEMO_NODES = 24  # the demo fleet's size
DEMO_MODELS = (
    "meta-llama/Llama-3.1-8B-Instruct",
    "mistralai/Mistral-7B-Instruct-v0.3",
    "Qwen/Qwen2.5-0.5B-Instruct",
    "BAAI/bge-large-en-v1.5",
)

# The routes the demo's fake node serves: OpenAI's Responses API too, so the tour can try it.
DEMO_ROUTES: tuple[Route, ...] = ("chat/completions", "completions", "embeddings", "responses")
# What an agent would find of the demo's fake node: vLLM-like, usage in streams, it goes on with its
# own answers when asked to continue (so demo streams resume on another node), it echoes a
# completion's prompt when asked, and its routes.
FAKE_BACKEND = {
    "kind": "vllm",
    "version": "fake",
    "usage_in_streams": True,
    "continues": True,
    "echoes": True,
    "routes": list(DEMO_ROUTES),
}


# The demo's answers end of themselves after a sentence or two, as a model's do: a key with a budget
# asks for the gateway's default max_tokens (512), which the tour would print as screens of words.
ANSWER_WORDS = 24


def node_config() -> FakeNodeConfig:
    """The fake node that answers for the demo fleet."""
    return FakeNodeConfig(
        models=DEMO_MODELS, tokens_per_s=200, name="demo-node", routes=DEMO_ROUTES, answer_words=ANSWER_WORDS
    )


@contextlib.asynccontextmanager
async def backend() -> AsyncIterator[str]:
    """Serve one fake node on a loopback port while the block runs; yields its base URL."""
    port = free_port()
    async with running(make_server(create_fake_node(node_config()), "127.0.0.1", port)):
        yield f"http://127.0.0.1:{port}"


async def keep_alive(
    url: str, stop: asyncio.Event, first_retry_s: float = 0.5, max_retry_s: float = 5.0
) -> None:
    """Heartbeat every demo node (owner-less, not offline when this starts) at the platform's
    interval until stop. A lost database (a restart) is waited out: reconnect with a pause that
    doubles up to max_retry_s, said once per outage; the same nodes are kept alive after it, the
    sweeper having set them offline meanwhile or not."""
    nodes: list[UUID] | None = None
    retry_s = first_retry_s
    lost = False
    while not stop.is_set():
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                store = Store(conn)
                if nodes is None:
                    nodes = await store.all(q.LIVE_DEMO_NODES)
                interval_s = float(await store.get(q.HEARTBEAT_INTERVAL))
                if lost:
                    log.info("demo heartbeats: the database is back; %d nodes kept alive again", len(nodes))
                lost, retry_s = False, first_retry_s
                await _beat(store, nodes, interval_s, stop)
        except psycopg.OperationalError as err:
            if not lost:
                log.warning("demo heartbeats: lost the database (%s); reconnecting", err)
                lost = True
            await _wait(stop, retry_s)
            retry_s = min(retry_s * 2, max_retry_s)


async def _beat(store: Store, nodes: list[UUID], interval_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for node_id in nodes:
            await store.one(q.NODE_HEARTBEAT, (node_id,))
        await _wait(stop, interval_s)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    """Sleep, cut short by stop."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
