"""OpenAI's semantics on every node: a server whose defaults differ from OpenAI's (llama-cpp-python's
repeat penalty of 1.1, which keeps even a greedy answer from the model's most likely tokens) is told
OpenAI's default in each text-generation request that does not say otherwise. Model verification's
challenges depend on it: an honest llama-cpp-python node failed them before (bench verify, 1457f62)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from neuralgrid.agent.backend import Backend
from neuralgrid.agent.front import FrontState
from neuralgrid.agent.servers import llama_cpp_python, llama_server
from neuralgrid.agent.servers.base import ServerKind
from tests.agent.test_front import CHAT, chat, raw_server, read_request

ANSWER = json.dumps({"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}}]}).encode()


async def sent(kind: ServerKind, path: str, body: bytes) -> dict[str, Any]:
    """What a server of `kind` was sent for `body`."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(
            ANSWER
        )
        writer.write(head + ANSWER)
        await writer.drain()

    async with raw_server(handle) as url:
        front = FrontState(Backend(url))
        front.backend.kind = kind
        answer = await front.forward(path, body)
        await answer.aclose()
    result: dict[str, Any] = json.loads(seen[0])
    return result


@pytest.mark.asyncio
async def test_llama_cpp_python_is_told_openais_default_repeat_penalty_unless_the_client_set_one() -> None:
    lcp = llama_cpp_python.LlamaCppPython()
    assert (await sent(lcp, CHAT, chat()))["repeat_penalty"] == 1.0
    assert (await sent(lcp, "/v1/completions", json.dumps({"model": "m", "prompt": "a"}).encode()))[
        "repeat_penalty"
    ] == 1.0
    assert (await sent(lcp, CHAT, chat(repeat_penalty=1.3)))["repeat_penalty"] == 1.3
    embedding = json.dumps({"model": "m", "input": "a"}).encode()
    lcp_embeddings = await sent(lcp, "/v1/embeddings", embedding)
    assert "repeat_penalty" not in lcp_embeddings


@pytest.mark.asyncio
async def test_a_server_with_openais_defaults_gets_the_request_as_it_came() -> None:
    got = await sent(llama_server.LlamaServer(), CHAT, chat())
    assert "repeat_penalty" not in got and got == json.loads(chat())
