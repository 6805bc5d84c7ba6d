"""Realtime wire formats: vsn 1.0.0 (JSON objects) and 2.0.0 (JSON arrays, binary broadcast pushes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from neuralgrid.protocol import wire_json

V1 = "1.0.0"
V2 = "2.0.0"
VERSIONS = (V1, V2)

USER_BROADCAST_PUSH = 3  # a client's broadcast, as realtime-js sends it in binary on vsn 2.0.0
JSON_ENCODING = 1


class ProtocolError(ValueError):
    """A frame that is not a Realtime message."""


@dataclass(slots=True)
class Message:
    topic: str
    event: str
    payload: Any
    ref: str | None = None
    join_ref: str | None = None


class Outgoing:
    """A message encoded once for many sockets: its text, and its WebSocket frame built on first use."""

    __slots__ = ("_frame", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self._frame: bytes | None = None

    @property
    def frame(self) -> bytes:
        """An unmasked server text frame, valid on every socket (servers never mask)."""
        if self._frame is None:
            data = self.text.encode()
            size = len(data)
            if size < 126:
                header = bytes([0x81, size])
            elif size < 1 << 16:
                header = bytes([0x81, 126]) + size.to_bytes(2, "big")
            else:
                header = bytes([0x81, 127]) + size.to_bytes(8, "big")
            self._frame = header + data
        return self._frame


def outgoing(msg: Message, vsn: str) -> Outgoing:
    return Outgoing(encode(msg, vsn))


def encode(msg: Message, vsn: str) -> str:
    if vsn == V2:
        return json.dumps([msg.join_ref, msg.ref, msg.topic, msg.event, msg.payload], separators=(",", ":"))
    # vsn 1.0.0: `ref` is always present (the Python client drops messages without it).
    return json.dumps(
        {
            "topic": msg.topic,
            "event": msg.event,
            "payload": msg.payload,
            "ref": msg.ref,
            "join_ref": msg.join_ref,
        },
        separators=(",", ":"),
    )


def _str_or_none(value: Any, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int):  # some clients send numeric refs
        return str(value)
    raise ProtocolError(f"{field} must be a string")


def decode(data: str | bytes, vsn: str) -> Message:
    if isinstance(data, bytes):
        return decode_binary(data)
    try:
        obj = wire_json.loads(data)
    except ValueError as err:
        raise ProtocolError(f"not JSON: {err}") from err
    if vsn == V2:
        if not isinstance(obj, list) or len(obj) != 5:
            raise ProtocolError("vsn 2.0.0 messages are [join_ref, ref, topic, event, payload]")
        join_ref, ref, topic, event, payload = obj
    else:
        if not isinstance(obj, dict):
            raise ProtocolError("vsn 1.0.0 messages are JSON objects")
        join_ref, ref = obj.get("join_ref"), obj.get("ref")
        topic, event, payload = obj.get("topic"), obj.get("event"), obj.get("payload", {})
    if not isinstance(topic, str) or not isinstance(event, str):
        raise ProtocolError("topic and event must be strings")
    if not isinstance(payload, dict):
        raise ProtocolError("payload must be an object")
    return Message(topic, event, payload, _str_or_none(ref, "ref"), _str_or_none(join_ref, "join_ref"))


def decode_binary(data: bytes) -> Message:
    """A User Broadcast Push frame: kind, five lengths, encoding, then the fields in order."""
    if len(data) < 7 or data[0] != USER_BROADCAST_PUSH:
        raise ProtocolError("unknown binary frame")
    join_ref_len, ref_len, topic_len, event_len, meta_len, encoding = data[1:7]
    fields: list[bytes] = []
    offset = 7
    for size in (join_ref_len, ref_len, topic_len, event_len, meta_len):
        fields.append(data[offset : offset + size])
        offset += size
    if offset > len(data):
        raise ProtocolError("truncated binary frame")
    try:
        join_ref, ref, topic, event, meta = (f.decode() for f in fields)
    except UnicodeDecodeError as err:
        raise ProtocolError("binary frame fields must be UTF-8") from err
    if encoding != JSON_ENCODING:
        raise ProtocolError("binary broadcast payloads are not supported; send JSON")
    try:
        user_payload = wire_json.loads(data[offset:]) if offset < len(data) else {}
        meta_value = wire_json.loads(meta) if meta else None
    except ValueError as err:
        raise ProtocolError(f"broadcast payload is not JSON: {err}") from err
    payload: dict[str, Any] = {"type": "broadcast", "event": event, "payload": user_payload}
    if meta:
        payload["meta"] = meta_value
    return Message(topic, "broadcast", payload, ref or None, join_ref or None)
