"""A Responses API stream from llama.cpp's server, as the gateway passes it on: its events leave out
sequence_number, output_index and content_index, on which OpenAI's SDK's stream helper builds the
answer (it raised `Received a content event for output index None ...`); the gateway puts them in."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from neuralgrid.protocol.sse import ResponseEvents
from neuralgrid.server.serving import ThreadedServer

# llama-server's events for an answer with reasoning, text and a function call, field for field as
# its tools/server/server-task.cpp (llama-cpp-python 0.3.36's) writes them.
STARTED = {"id": "resp_1", "object": "response", "status": "in_progress"}
REASONING = {"id": "rs_1", "summary": [], "type": "reasoning", "content": [], "encrypted_content": ""}
MESSAGE = {"content": [], "id": "msg_1", "role": "assistant", "status": "in_progress", "type": "message"}
PART = {"type": "output_text", "annotations": [], "logprobs": [], "text": "Hello there"}
CALL = {"id": "fc_1", "type": "function_call", "arguments": "", "call_id": "call_1", "name": "look"}
CALL_2 = {**CALL, "id": "fc_2", "call_id": "call_2"}
DONE = [
    {**REASONING, "content": [{"text": "Think.", "type": "reasoning_text"}]},
    {**MESSAGE, "status": "completed", "content": [PART]},
    {**CALL, "status": "completed", "arguments": "{}"},
    {**CALL_2, "status": "completed", "arguments": "{}"},
]
LLAMA_SERVER: list[dict[str, Any]] = [
    {"type": "response.created", "response": STARTED},
    {"type": "response.in_progress", "response": STARTED},
    {"type": "response.output_item.added", "item": {**REASONING, "status": "in_progress"}},
    {"type": "response.reasoning_text.delta", "delta": "Think.", "item_id": "rs_1"},
    {"type": "response.output_item.added", "item": MESSAGE},
    {"type": "response.content_part.added", "item_id": "msg_1", "part": {"type": "output_text", "text": ""}},
    {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "Hello"},
    {"type": "response.output_text.delta", "item_id": "msg_1", "delta": " there"},
    {"type": "response.output_item.added", "item": {**CALL, "status": "in_progress"}},
    {"type": "response.function_call_arguments.delta", "delta": "{}", "item_id": "fc_1"},
    {"type": "response.output_item.added", "item": {**CALL_2, "status": "in_progress"}},
    {"type": "response.function_call_arguments.delta", "delta": "{}", "item_id": "fc_2"},
    {"type": "response.output_item.done", "item": DONE[0]},
    {"type": "response.output_text.done", "item_id": "msg_1", "text": "Hello there"},
    {"type": "response.content_part.done", "item_id": "msg_1", "part": PART},
    {"type": "response.output_item.done", "item": DONE[1]},
    {"type": "response.output_item.done", "item": DONE[2]},
    {"type": "response.output_item.done", "item": DONE[3]},
    {
        "type": "response.completed",
        "response": {
            **STARTED,
            "created_at": 0,
            "status": "completed",
            "model": "smollm2",
            "output": DONE,
            "usage": {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8},
        },
    },
]
# llama-server starts its response again (response.created, .in_progress) before each chunk when no
# chunk came for the answer's first token (server-task.cpp marks the response started on that chunk
# only, and a token that is half a character comes in none): seen in 1 of 40 answers of SmolLM2 at its
# default temperature, whose first token was half an emoji.
STARTED_AGAIN = LLAMA_SERVER[:7] + LLAMA_SERVER[:2] + LLAMA_SERVER[7:]


def relayed(events: list[dict[str, Any]]) -> bytes:
    """The node's stream as the gateway passes it on, read in pieces of 7 bytes."""
    sent = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
    reader = ResponseEvents()
    out = b"".join(b"".join(reader.feed(sent[i : i + 7])) for i in range(0, len(sent), 7))
    assert reader.done and reader.used().completion_tokens == 5
    return out


def test_llama_servers_events_are_placed_as_openais_are() -> None:
    placed = [
        json.loads(line[5:]) for line in relayed(LLAMA_SERVER).splitlines() if line.startswith(b"data:")
    ]
    assert [e["sequence_number"] for e in placed] == list(range(len(LLAMA_SERVER)))
    where = [
        (e["type"].removeprefix("response."), e.get("output_index"), e.get("content_index")) for e in placed
    ]
    assert where[2:-1] == [
        ("output_item.added", 0, None),
        ("reasoning_text.delta", 0, 0),
        ("output_item.added", 1, None),
        ("content_part.added", 1, 0),
        ("output_text.delta", 1, 0),
        ("output_text.delta", 1, 0),
        ("output_item.added", 2, None),
        ("function_call_arguments.delta", 2, None),
        ("output_item.added", 3, None),
        ("function_call_arguments.delta", 3, None),
        ("output_item.done", 0, None),
        ("output_text.done", 1, 0),
        ("content_part.done", 1, 0),
        ("output_item.done", 1, None),
        ("output_item.done", 2, None),
        ("output_item.done", 3, None),
    ]
    assert all({k: p[k] for k in sent} == sent for p, sent in zip(placed, LLAMA_SERVER, strict=True))


@pytest.mark.parametrize("events", [LLAMA_SERVER, STARTED_AGAIN], ids=["as-usual", "started-again"])
def test_the_sdks_stream_helper_reads_llama_servers_answer_through_the_gateway(
    events: list[dict[str, Any]],
) -> None:
    body = relayed(events)

    async def answer(_: Request) -> Response:
        return Response(body, media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/responses", answer, methods=["POST"])])
    with (
        ThreadedServer(app) as gateway,
        openai.OpenAI(api_key="-", base_url=f"{gateway.url}/v1") as sdk,
        sdk.responses.stream(model="smollm2", input="hi") as stream,
    ):
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas == ["Hello", " there"] and final.output_text == "Hello there"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]


def test_openais_own_events_pass_as_they_came() -> None:
    event = {"type": "response.output_text.delta", "sequence_number": 7, "item_id": "m", "output_index": 3}
    sent = f"event: response.output_text.delta\ndata: {json.dumps(event)}\n\n".encode()
    assert ResponseEvents().feed(sent) == [sent]


@pytest.mark.parametrize("kind", [["response.completed"], {"a": 1}, 7, None])
def test_an_event_whose_type_is_not_a_string_is_passed_on_as_it_came(kind: Any) -> None:
    """A node's event whose "type" is a list or an object raised TypeError (unhashable) in the relay:
    the stream cut with no error event, and its job recorded as if the client had gone (a review)."""
    reader = ResponseEvents()
    event = b"data: " + json.dumps({"type": kind, "delta": "x"}).encode()
    assert reader.feed(event + b"\n\n") == [event + b"\n\n"]
    assert not reader.done and reader.text == []
