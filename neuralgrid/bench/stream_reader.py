"""`neuralgrid bench sse`: the CPU a node's stream costs the gateway's SSE reader
(neuralgrid/protocol/sse.py, SseEvents.feed), by the stream's shape.

A reader must cost a stream's size, not its square: a node can send one event in many pieces, and
a reader that copied what it held at every piece spent 76 s of CPU on a 128 MiB event (session
24's security review). The figure that shows it is the CPU of one large event (15 MiB: the most an
event may be is 16) sent in 64 KiB pieces over the same event in one read: near 1 when each byte is
read once, and about the number of pieces over two (120 here) when every piece copies what is held.

The other shapes are the ones a node sends: tiny events (a node spending the reader's CPU on
purpose; bounded by count in the relay), and an ordinary chat stream, one token an event and one
event a read. CPU is `time.process_time`, the least of `rounds` runs: what the reader needs, not
what a shared machine gave it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from neuralgrid.protocol.sse import SseEvents

MIB = 1 << 20
PIECE = 64 << 10  # the size a socket read gives a large answer in
SIZES_MIB = (1, 4, 15)  # one event: the last below the reader's 16 MiB bound
TINY_MIB = 4
CHAT_EVENTS = 20_000


def one_event(size: int, piece: int = PIECE) -> list[bytes]:
    """One event of `size` bytes (a JSON string of 'x'), in pieces of `piece` bytes."""
    head, tail = b'data: {"choices":[{"index":0,"delta":{"content":"', b'"}}]}\n\n'
    raw = head + b"x" * (size - len(head) - len(tail)) + tail
    return [raw[i : i + piece] for i in range(0, len(raw), piece)]


def tiny_events(size: int) -> list[bytes]:
    """`size` bytes of 8-byte keep-alive comments (`: tick`), in 64 KiB pieces."""
    raw = b": tick\n\n" * (size // 8)
    return [raw[i : i + PIECE] for i in range(0, len(raw), PIECE)]


def chat_stream(events: int) -> list[bytes]:
    """An ordinary chat stream: a token an event, an event a read, then usage and [DONE]."""
    token = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    token["choices"] = [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]
    usage = {**token, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": events}}
    return [f"data: {json.dumps(token)}\n\n".encode()] * events + [
        f"data: {json.dumps(usage)}\n\n".encode(),
        b"data: [DONE]\n\n",
    ]


def cpu_ms(pieces: list[bytes], rounds: int) -> tuple[float, int]:
    """The least CPU, in ms, that reading `pieces` through a fresh reader took in `rounds` runs, and
    the events it read (so a shape is known to be what it says)."""
    best, events = float("inf"), 0
    for _ in range(rounds):
        reader = SseEvents(keep_usage_event=False)
        start = time.process_time()
        for piece in pieces:
            reader.feed(piece)
        best, events = min(best, time.process_time() - start), reader.events
    return best * 1000, events


def run(rounds: int, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Each shape's CPU, and the figure that shows a reader's cost is linear (`pieces_over_whole`)."""
    largest = SIZES_MIB[-1]
    shapes: list[tuple[str, list[bytes]]] = [
        (f"one {mib} MiB event in 64 KiB pieces", one_event(mib * MIB)) for mib in SIZES_MIB
    ]
    shapes.append((f"one {largest} MiB event in one read", one_event(largest * MIB, largest * MIB)))
    shapes.append((f"{TINY_MIB} MiB of 8-byte events in 64 KiB pieces", tiny_events(TINY_MIB * MIB)))
    shapes.append((f"a chat stream of {CHAT_EVENTS:,} events, one a read", chat_stream(CHAT_EVENTS)))
    results: list[dict[str, Any]] = []
    for name, pieces in shapes:
        progress(name)
        size = sum(map(len, pieces))
        ms, events = cpu_ms(pieces, rounds)
        mib = size / MIB
        results.append(
            {"shape": name, "mib": mib, "events": events, "cpu_ms": ms, "cpu_ms_per_mib": ms / mib}
        )
    in_pieces, whole = results[len(SIZES_MIB) - 1]["cpu_ms"], results[len(SIZES_MIB)]["cpu_ms"]
    return {"rounds": rounds, "shapes": results, "pieces_over_whole": in_pieces / whole}
