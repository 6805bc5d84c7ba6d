"""The Responses API's streams as OpenAI's SDK reads them: its helper (`client.responses.stream`)
builds the answer from the events' positions (output_index, content_index) and fails on a stream
that leaves them out. Held through gateway and agent against the fake node (vLLM-like, and as
llama.cpp's server) and the real llama-server, and the fake's events against the real server's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from openai.types.responses import ResponseStreamEvent

from neuralgrid.dev.fakenode import FakeNodeConfig, create_fake_node
from neuralgrid.protocol.routes import Route
from neuralgrid.server.serving import ThreadedServer
from tests.agent.servers import SMOLLM2
from tests.agent.test_backends import FakeServer, Stack, join, make_server, platform
from tests.conftest import wait_for

RESPONSES: tuple[Route, ...] = ("chat/completions", "completions", "responses")
# The fake as vLLM (its default) and as llama.cpp's server, and the real llama-server (None).
SERVERS: dict[str, FakeNodeConfig | None] = {
    "fake-vllm": FakeNodeConfig(models=(SMOLLM2,), routes=RESPONSES),
    "fake-llama.cpp": FakeNodeConfig.like("llama.cpp", models=(SMOLLM2,)),
    "llama.cpp": None,
}


@contextmanager
def a_stack(pg_server: Any, template_db: str, tmp: Path, server: str) -> Iterator[Stack]:
    """test_backends' stack (direct), its server one of SERVERS."""
    config = SERVERS[server]
    with platform(pg_server, template_db) as (gateway, key, conn):
        started = FakeServer(config).start() if config else make_server("llama.cpp", tmp)
        try:
            agent, node_id = join(gateway, key, conn, started, "node-a", "direct")
            try:
                yield Stack(gateway, key, conn, started, agent, node_id, "node-a")
            finally:
                agent.stop()
        finally:
            started.kill()


@pytest.mark.parametrize("server", list(SERVERS))
def test_the_sdks_stream_helper_reads_a_response_to_its_end(
    server: str, pg_server: Any, template_db: str, tmp_path: Path
) -> None:
    """The issue's case: the helper raised `Received a content event for output index None before
    receiving its output item` on the demo's first delta, and the job was recorded cancelled."""
    with a_stack(pg_server, template_db, tmp_path, server) as stack:
        with stack.sdk() as sdk:
            stack.settle()
            deltas = []
            with sdk.responses.stream(model=SMOLLM2, input="Count to five", max_output_tokens=6) as events:
                for event in events:
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                        assert event.snapshot == "".join(deltas)  # the helper's running text
                final = events.get_final_response()
        assert final.output_text and final.output_text == "".join(deltas)
        assert final.usage is not None
        wait_for(lambda: stack.jobs() and stack.jobs()[-1][0] != "running", timeout=10)
        status, prompt, completion, _, error = stack.jobs()[-1]
        assert (status, prompt, completion, error) == (
            "succeeded",
            final.usage.input_tokens,
            final.usage.output_tokens,
            None,
        )


def events_of(url: str, model: str) -> list[dict[str, Any]]:
    """A streamed response's events as the server sends them, each with its SSE event name."""
    # Greedy, so the real server's answer is the same each time: at its default temperature it now and
    # then picks a token that is half a character, and then starts its response again (the gateway's
    # handling of that is held in tests/unit/test_response_events.py).
    body = {
        "model": model,
        "input": "Count to five",
        "max_output_tokens": 6,
        "stream": True,
        "temperature": 0,
    }
    events, name = [], None
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                events.append({**json.loads(line[5:]), "event": name})
    return events


def shape(events: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """Each event's type and fields, one delta standing for a run of them (counts differ by model)."""
    shapes = [(e["type"], sorted(k for k in e if k not in ("timings", "prompt_progress"))) for e in events]
    return [s for i, s in enumerate(shapes) if i == 0 or s != shapes[i - 1]]


def test_the_fake_streams_a_response_as_the_real_llama_server_does(tmp_path: Path) -> None:
    """llama-server's events leave out the positions and sequence numbers OpenAI's have (the SDK's
    helper fails on them); the fake made like it sends its events, field for field."""
    real = make_server("llama.cpp", tmp_path)
    fake = ThreadedServer(create_fake_node(FakeNodeConfig.like("llama.cpp", models=(SMOLLM2,)))).start()
    try:
        assert shape(events_of(fake.url, SMOLLM2)) == shape(events_of(real.url, real.served))
    finally:
        real.kill()
        fake.stop()


def test_the_fakes_response_events_are_openais_own() -> None:
    """vLLM builds its events from the SDK's own types: the fake (vLLM-like) sends each event with
    every field its type in the SDK requires, numbered, in the order OpenAI sends them."""
    with ThreadedServer(create_fake_node(FakeNodeConfig(routes=RESPONSES))) as fake:
        events = events_of(fake.url, "meta-llama/Llama-3.1-8B-Instruct")
    types = {
        get_args(t.model_fields["type"].annotation)[0]: t for t in get_args(get_args(ResponseStreamEvent)[0])
    }
    for event in events:
        assert event.pop("event") == event["type"]
        required = {name for name, field in types[event["type"]].model_fields.items() if field.is_required()}
        assert required <= event.keys(), event
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert deltas == 6
