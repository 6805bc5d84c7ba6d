"""The tunnel's frames: one model each, shared by gateway and agent, validated at both ends."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from neuralgrid.protocol.tunnel import Cancel, Data, End, Err, Req, Start, agent_frame, encode, gateway_frame


def test_frames_round_trip_through_json() -> None:
    for frame in (Req(id=1, path="/v1/chat/completions", body="{}"), Cancel(id=2)):
        assert gateway_frame(encode(frame)) == frame
    for reply in (Start(id=1, status=200), Data(id=1, b="data: {}\n\n"), End(id=1), Err(id=1, message="x")):
        assert agent_frame(encode(reply)) == reply


def test_the_wire_format_is_compact_and_tagged() -> None:
    assert json.loads(encode(Data(id=7, b="hi"))) == {"id": 7, "t": "data", "b": "hi"}
    assert json.loads(encode(Start(id=7, status=503))) == {
        "id": 7,
        "t": "start",
        "status": 503,
        "type": "application/json",
    }


@pytest.mark.parametrize(
    "text",
    [
        '{"t": "start", "id": 1, "status": "two hundred"}',
        '{"t": "start", "id": 1, "status": 42}',  # not an HTTP status
        '{"t": "data", "id": "one", "b": "x"}',
        '{"t": "req", "id": 1, "path": "/", "body": "{}"}',  # only the gateway sends requests
        '{"t": "end"}',  # every frame names its request
        "[1, 2]",
        "not json",
    ],
)
def test_a_malformed_agent_frame_is_refused(text: str) -> None:
    with pytest.raises(ValidationError):
        agent_frame(text)


def test_a_malformed_gateway_frame_is_refused() -> None:
    with pytest.raises(ValidationError):
        gateway_frame('{"t": "start", "id": 1, "status": 200}')  # only agents send status lines
