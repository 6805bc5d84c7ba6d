"""The demo's answers, as the README's tour meets them: a sentence or two, not the 512 tokens a key
with a budget asks for by default (issue 40: the tour's first answer filled screens), while
max_tokens still bounds them and `ignore_eos` still runs them to it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
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

README = Path(__file__).parents[2] / "README.md"
BGE = "BAAI/bge-large-en-v1.5"
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


def tour_snippet() -> str:
    """The README tour's Python, as a reader copies it."""
    tour = README.read_text().split("## A 60-second tour", 1)[1]
    return tour.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_snippet_through_the_gateway_prints_a_short_answer_and_an_embedding(
    conn: psycopg.Connection, gateway: str, demo_node: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run with the tour's key (`--budget-usd 5`: the gateway asks the node for 512 tokens where the
    client gives no max_tokens) against the demo's node, which serves the tour's two models."""
    make_node(conn, "demo", endpoint_url=demo_node, models={LLAMA8: "loaded", BGE: "loaded"})
    key = conn.execute("select api_key from create_api_key('laptop', 600, null, 5)").fetchone()
    assert key is not None
    snippet = tour_snippet()
    assert 'api_key="ng-…"' in snippet and "http://127.0.0.1:8080/v1" in snippet
    exec(snippet.replace("ng-…", str(key[0])).replace("http://127.0.0.1:8080/v1", f"{gateway}/v1"), {})
    answer, node, streamed, embedding = capsys.readouterr().out.split("\n")[:4]
    assert len(answer.split()) == len(streamed.split()) == demo.ANSWER_WORDS  # not screens of words
    row = conn.execute("select id::text from nodes where name = 'demo'").fetchone()
    assert row is not None and node.split()[0] == row[0]
    assert len(json.loads(embedding.strip())) == 4
