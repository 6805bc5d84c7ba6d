"""Tunnel frames: what the gateway and an agent say to each other over one WebSocket, one model each.

Many requests share the socket, so every frame carries its request's id. The gateway sends `req` and
`cancel`; the agent answers `start` (status line), `data` chunks, then `end` or `err`. Bodies travel
as text (JSON and SSE are UTF-8) or, for bytes that are not (an audio upload, speech), in base64
(`b64`). Frames travel as JSON text and are validated on arrival at both ends.

Flow control, per request (as HTTP/2 has it, since one socket carries them all and TCP's
backpressure would stall every request behind the slowest client): the agent has at most WINDOW
characters of an answer's `data` out that the gateway has not taken, in frames of at most half a
window; the gateway says `more` as its reader takes them (at least half a window at a time), and
cuts off an agent that sends beyond its window. Both ends say they do this with FLOW_HEADER in the
socket's handshake; with an agent from before, the gateway sends no `more` and bounds what it
holds of an answer by UNWINDOWED_CAP instead.
"""

from __future__ import annotations

import base64
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Frame(BaseModel):
    model_config = ConfigDict(frozen=True)
    id: int


HEADER_VALUE = r"^[\x20-\x7e]*$"  # printable ASCII: what a header may hold
MAX_TYPE = 256  # the longest content type a frame carries
# Characters of one answer's `data` (the frames' `b`, as sent) an agent may send ahead of the
# gateway's reader: a stream's few hundred tokens a second never come near it; a flood stops there.
WINDOW = 4 << 20
MAX_DATA = WINDOW // 2  # the most one `data` frame carries: the gateway acknowledges by halves
# With an agent from before flow control (which sends no FLOW_HEADER), what the gateway holds of an
# answer its reader has not taken: far more than an eager reader ever leaves, and still a bound.
UNWINDOWED_CAP = 16 * WINDOW
# The handshake header (FLOW_HEADER: FLOW) by which each end says it does flow control: the agent
# in its request, the gateway in its answer. Each keeps to it only with the other (an agent waiting
# for a `more` that a gateway from before never sends would stall after its first window).
FLOW_HEADER = "x-neuralgrid-tunnel-flow"
FLOW = "more"  # the frame that flow control adds


def is_content_type(value: str) -> bool:
    """Whether a frame can carry this content type: 1 to MAX_TYPE printable ASCII characters (HTTP
    also allows tabs and other bytes in a header, which no client needs in a content type)."""
    return 0 < len(value) <= MAX_TYPE and re.fullmatch(HEADER_VALUE, value) is not None


class Req(_Frame):
    """Gateway → agent: forward this body (of content type `type`) to the inference server's `path`."""

    t: Literal["req"] = "req"
    path: str
    body: str
    type: str | None = Field(None, min_length=1, max_length=MAX_TYPE, pattern=HEADER_VALUE)  # None: JSON
    b64: Literal[True] | None = None  # the body is base64 (bytes that are not UTF-8 text)


class Cancel(_Frame):
    """Gateway → agent: the client left; stop the request."""

    t: Literal["cancel"] = "cancel"


class More(_Frame):
    """Gateway → agent: `n` more characters of this answer's `data` were taken; send as much again."""

    t: Literal["more"] = "more"
    n: int = Field(gt=0)


class Start(_Frame):
    """Agent → gateway: the server's status line."""

    t: Literal["start"] = "start"
    status: int = Field(ge=200, le=599)  # a final status: 1xx is no answer to relay
    type: str = Field("application/json", pattern=HEADER_VALUE)


class Data(_Frame):
    """Agent → gateway: one chunk of the body."""

    t: Literal["data"] = "data"
    b: str
    b64: Literal[True] | None = None  # the chunk is base64 (a body that is not text, such as audio)


class End(_Frame):
    """Agent → gateway: the body is complete."""

    t: Literal["end"] = "end"


class Err(_Frame):
    """Agent → gateway (or the gateway to itself when the socket drops): the request failed."""

    t: Literal["err"] = "err"
    message: str


GatewayFrame = Annotated[Req | Cancel | More, Field(discriminator="t")]
AgentFrame = Annotated[Start | Data | End | Err, Field(discriminator="t")]

_gateway_frames: TypeAdapter[Req | Cancel | More] = TypeAdapter(GatewayFrame)
_agent_frames: TypeAdapter[Start | Data | End | Err] = TypeAdapter(AgentFrame)


def is_text(media_type: str) -> bool:
    """Bodies of this type travel as text (JSON, SSE, plain text); others (audio) in base64."""
    kind = media_type.split(";", 1)[0].strip().lower()
    return kind.startswith("text/") or kind.endswith("json")


def pack(body: bytes) -> tuple[str, Literal[True] | None]:
    """A body for a frame: as text when it is UTF-8, else in base64 (second item True)."""
    try:
        return body.decode(), None
    except UnicodeDecodeError:
        return base64.b64encode(body).decode("ascii"), True


def unpack(text: str, b64: bool | None) -> bytes:
    """A frame's body back as bytes (ValueError for base64 that is not)."""
    return base64.b64decode(text, validate=True) if b64 else text.encode()


def encode(frame: _Frame) -> str:
    return frame.model_dump_json(exclude_none=True)  # text frames as before: no b64, no type


def gateway_frame(text: str | bytes) -> Req | Cancel | More:
    """Parse what the gateway sent (raises pydantic.ValidationError, a ValueError, when malformed)."""
    return _gateway_frames.validate_json(text)


def agent_frame(text: str | bytes) -> Start | Data | End | Err:
    """Parse what an agent sent (raises pydantic.ValidationError, a ValueError, when malformed)."""
    return _agent_frames.validate_json(text)
