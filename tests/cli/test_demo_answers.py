"""The demo's answers, as the README's tour meets them: a sentence or two, not the 512 tokens a key
with a budget asks for by default (issue 40: the tour's first answer filled screens), while
max_tokens still bounds them and `ignore_eos` still runs them to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psycopg
import pytest
from openai.types.chat import ChatCompletionMessageParam

from neuralgrid.dev import demo
from neuralgrid.dev.fakenode import create_fake_node
from neuralgrid.server.serving import ThreadedServer
from tests.conftest import LLAMA8, make_node

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello, grid!"}]


@pytest.fixture
def demo_node() -> Iterator[str]:
    with ThreadedServer(create_fake_node(demo.node_config())) as server:
        yield server.url


def chat(url: str, **extra: Any) -> tuple[list[str], str, int]:
    """The demo node's answer to the tour's first request: its words, finish_reason, usage."""
    body = {"model": LLAMA8, "messages": HELLO, **extra}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).json()
    choice = answer["choices"][0]
    return choice["message"]["content"].split(), choice["finish_reason"], answer["usage"]["completion_tokens"]


@pytest.mark.parametrize("asked", [{}, {"max_tokens": 512}])  # none given; a key with a budget's default
def test_the_demos_answer_ends_after_a_sentence_or_two(demo_node: str, asked: dict[str, int]) -> None:
    words, finish, counted = chat(demo_node, **asked)
    assert (len(words), finish, counted) == (demo.ANSWER_WORDS, "stop", demo.ANSWER_WORDS)


def test_max_tokens_still_bounds_the_demos_answer_and_ignore_eos_runs_it_to_them(demo_node: str) -> None:
    words, finish, counted = chat(demo_node, max_tokens=5)
    assert (words, finish, counted) == (chat(demo_node)[0][:5], "length", 5)
    words, finish, counted = chat(demo_node, max_tokens=100, ignore_eos=True)
    assert (len(words), finish, counted) == (100, "length", 100)


def test_a_streamed_demo_answer_ends_of_itself_too(demo_node: str) -> None:
    with openai.OpenAI(base_url=f"{demo_node}/v1", api_key="-") as sdk:
        chunks = list(sdk.chat.completions.create(model=LLAMA8, messages=HELLO, stream=True, max_tokens=512))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(text.split()) == demo.ANSWER_WORDS and chunks[-1].choices[0].finish_reason == "stop"


def test_the_tours_snippet_through_the_gateway_prints_a_short_answer(
    conn: psycopg.Connection, gateway: str, demo_node: str
) -> None:
    """The README's snippet, with the tour's key (`--budget-usd 5`): the gateway asks the node for
    512 tokens, the snippet's max_tokens for fewer."""
    make_node(conn, "demo", endpoint_url=demo_node)
    key = conn.execute("select api_key from create_api_key('laptop', 600, null, 5)").fetchone()
    assert key is not None
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=str(key[0]), max_retries=0) as sdk:
        reply = sdk.chat.completions.create(model=LLAMA8, messages=HELLO)
        assert reply.choices[0].message.content is not None
        assert len(reply.choices[0].message.content.split()) == demo.ANSWER_WORDS
        capped = sdk.chat.completions.create(model=LLAMA8, messages=HELLO, max_tokens=8)
        assert capped.usage is not None and capped.usage.completion_tokens == 8
