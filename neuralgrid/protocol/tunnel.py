"""Tunnel frames: what the gateway and an agent say to each other over one WebSocket, one model each.

Many requests share the socket, so every frame carries its request's id. The gateway sends `req` and
`cancel`; the agent answers `start` (status line), `data` chunks, then `end` or `err`. Bodies are text
(JSON and SSE are UTF-8). Frames travel as JSON text and are validated on arrival at both ends.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Frame(BaseModel):
    model_config = ConfigDict(frozen=True)
    id: int


class Req(_Frame):
    """Gateway → agent: forward this body to the inference server's `path`."""

    t: Literal["req"] = "req"
    path: str
    body: str


class Cancel(_Frame):
    """Gateway → agent: the client left; stop the request."""

    t: Literal["cancel"] = "cancel"


class Start(_Frame):
    """Agent → gateway: the server's status line."""

    t: Literal["start"] = "start"
    status: int = Field(ge=200, le=599)  # a final status: 1xx is no answer to relay
    type: str = Field("application/json", pattern=r"^[\x20-\x7e]*$")  # a header value: printable ASCII


class Data(_Frame):
    """Agent → gateway: one chunk of the body."""

    t: Literal["data"] = "data"
    b: str


class End(_Frame):
    """Agent → gateway: the body is complete."""

    t: Literal["end"] = "end"


class Err(_Frame):
    """Agent → gateway (or the gateway to itself when the socket drops): the request failed."""

    t: Literal["err"] = "err"
    message: str


GatewayFrame = Annotated[Req | Cancel, Field(discriminator="t")]
AgentFrame = Annotated[Start | Data | End | Err, Field(discriminator="t")]

_gateway_frames: TypeAdapter[Req | Cancel] = TypeAdapter(GatewayFrame)
_agent_frames: TypeAdapter[Start | Data | End | Err] = TypeAdapter(AgentFrame)


def encode(frame: _Frame) -> str:
    return frame.model_dump_json()


def gateway_frame(text: str | bytes) -> Req | Cancel:
    """Parse what the gateway sent (raises pydantic.ValidationError, a ValueError, when malformed)."""
    return _gateway_frames.validate_json(text)


def agent_frame(text: str | bytes) -> Start | Data | End | Err:
    """Parse what an agent sent (raises pydantic.ValidationError, a ValueError, when malformed)."""
    return _agent_frames.validate_json(text)
