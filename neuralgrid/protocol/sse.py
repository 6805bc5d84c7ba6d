"""A server's SSE stream as the agent and the gateway read it: whole events, usage, and the answer
so far.

The answer so far is what lets a stream that a node dropped go on on another node: that node is
sent the conversation plus the text already streamed (gateway/pipeline/relay.py), and its events
are relayed as if the first node had gone on (same id, usage counted across both).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from neuralgrid.protocol import wire_json

MAX_REPORTED_TOKENS = 10_000_000
# The largest event a node may send: the Responses API's last event holds the whole answer (with its
# logprobs, if asked), far below this; an event past it is a node sending what no answer holds.
MAX_EVENT_BYTES = 16 << 20


class NotAnAnswer(ValueError):
    """A stream no answer could be: an event past MAX_EVENT_BYTES, or more events than its tokens."""


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def parse(cls, payload: Any) -> Usage | None:
        """The node's own account of usage, if it is a plausible one (nodes are not trusted): OpenAI's
        prompt and completion tokens, the Responses API's input and output tokens, or (rerank and
        score, vLLM's older rerank) total tokens alone, which are all prompt."""
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if not isinstance(usage, dict):
            return None
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        if prompt is None and completion is None:
            prompt = usage.get("total_tokens")
        counts = [prompt or 0, completion or 0]
        if not all(type(c) is int and 0 <= c <= MAX_REPORTED_TOKENS for c in counts):  # not bools
            return None
        return cls(counts[0], counts[1])


PASS_ON: Final = object()  # SseEvents._payload: an event passed on unread


class SseEvents:
    """Splits a node's SSE bytes into whole events; keeps usage, the answer's text and the stream's
    identity; drops the usage-only event the gateway asked for on the client's behalf."""

    def __init__(self, keep_usage_event: bool, most_events: int | None = None) -> None:
        self.keep_usage_event = keep_usage_event
        # A token an event, and a few of their own (role, finish, usage, keep-alives): a node that
        # sends many more, tiny ones, spends the reader's CPU, not its own GPU's.
        self.most_events = most_events
        self.buffer = bytearray()  # an event's start, its end still to come
        self.cr = False  # the last piece ended with a CR, whose LF may start the next
        self.events = 0  # every event read, comments and [DONE] included
        self.done = False  # [DONE] seen
        self.chunks = 0  # events other than usage and [DONE]: a token each, when usage is missing
        self.usage: Usage | None = None
        self.text: list[str] = []  # choice 0's text so far
        self.finished = False  # a choice has its finish_reason: the answer is whole
        self.finish_reason: str | None = None  # choice 0's, once it has one
        self.plain_text = True  # one choice of text only (no tool calls): an answer one can resume
        self.identity: dict[str, Any] = {}  # the first event's id and created
        self.resumes = 0
        self.carried = 0  # tokens streamed before the last resume
        self.chunks_carried = 0  # events streamed before the last resume

    def feed(self, raw: bytes) -> list[bytes]:
        """The events that `raw` completes. Each byte is scanned once, so a node that sends an event
        in many pieces costs its size, not its square. NotAnAnswer past MAX_EVENT_BYTES or most_events."""
        # Events end with a blank line; servers that write CRLF lines are read the same way.
        if self.cr:
            raw, self.cr = b"\r" + raw, False
        if raw.endswith(b"\r"):
            raw, self.cr = raw[:-1], True
        if b"\r" in raw:
            raw = raw.replace(b"\r\n", b"\n")
        if not self.buffer and raw.endswith(b"\n\n"):  # the usual read: whole events, nothing held
            events = raw[:-2].split(b"\n\n")
        else:
            events = self._completed(raw)
        out: list[bytes] = []
        for event in events:
            if self.done:  # nothing after [DONE] is an event
                break
            self.events += 1
            if self.most_events is not None and self.events > self.most_events:
                raise NotAnAnswer(f"the node sent more events than its answer's {self.most_events}")
            kept = self._take(event)
            if kept is not None:
                out.append(kept + b"\n\n")
        return out

    def _completed(self, raw: bytes) -> list[bytes]:
        """The events `raw` ends, the rest held: the buffer is scanned from where the last read
        left it, so an event that comes in many pieces is read once."""
        scan = max(len(self.buffer) - 1, 0)  # a blank line may straddle two pieces
        self.buffer += raw
        events: list[bytes] = []
        start = 0
        while (end := self.buffer.find(b"\n\n", max(start, scan))) >= 0:
            events.append(bytes(self.buffer[start:end]))
            start = end + 2
        del self.buffer[:start]
        if len(self.buffer) > MAX_EVENT_BYTES:
            raise NotAnAnswer(f"the node sent an event of more than {MAX_EVENT_BYTES >> 20} MiB")
        return events

    def resumed(self) -> None:
        """The events from here on come from another node, which was sent the answer so far."""
        self.resumes += 1
        self.carried, self.chunks_carried = self.tokens(), self.chunks
        self.usage = None  # the next node's own account, if it gives one, is added to `carried`
        self.buffer, self.cr = bytearray(), False
        self.events = 0  # the next node's own (its answer is what is left: fewer tokens to send)
        self.done = False

    def tokens(self) -> int:
        """Completion tokens streamed so far: the node's count if it gave one (which includes
        earlier nodes'), else a token per event since the last resume on top of earlier nodes'."""
        if self.usage:
            return self.usage.completion_tokens
        return self.carried + self.chunks - self.chunks_carried

    def used(self) -> Usage:
        """The stream's usage, for metering: the nodes' account, else counted here."""
        return self.usage or Usage(0, self.tokens())

    def _payload(self, event: bytes) -> Any:
        """The JSON an event's data holds (None when it is not JSON), or PASS_ON for an event to pass on
        unread: a comment (keep-alive), a field we do not use, or [DONE] (which ends the stream)."""
        # An event's data is its `data:` lines (a space after the colon is optional), joined.
        lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            return PASS_ON
        data = b"\n".join(lines).strip()
        if data == b"[DONE]":  # the Responses API has none, but a server may add it: over either way
            self.done = True
            return PASS_ON
        try:
            return wire_json.loads_answer(data)
        except ValueError:  # not JSON, or nested past what can be read
            return None

    def _take(self, event: bytes) -> bytes | None:
        payload = self._payload(event)
        if payload is PASS_ON:
            return event
        if not isinstance(payload, dict):
            self.chunks += 1
            self.plain_text = False  # something we cannot read: no telling what a resume would repeat
            return event
        choices = payload.get("choices")
        choices = choices if isinstance(choices, list) else []
        carried = self._note(choices)
        usage = Usage.parse(payload)
        if usage is None:
            self.chunks += carried  # a token; not a role-only or finish-only event
        elif self.resumes:  # what the client would have been told had the first node gone on
            replayed = self.carried
            usage = Usage(max(usage.prompt_tokens - replayed, 0), usage.completion_tokens + replayed)
            payload["usage"] = {**payload["usage"], **_usage_fields(usage)}
        if usage is not None:
            self.usage = usage
            if not (self.keep_usage_event or choices):
                return None
        if not self.identity:
            self.identity = {k: payload[k] for k in ("id", "created") if k in payload}
        if self.resumes:
            return b"data: " + json.dumps({**payload, **self.identity}).encode()
        return event

    def _note(self, choices: list[Any]) -> bool:
        """Notes choice 0's text and whether the answer is over; True when the event carries output."""
        carried = False
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self.plain_text, carried = False, True  # n > 1, or unreadable: no one answer to resume
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):  # chat
                if any(value for key, value in delta.items() if key not in ("role", "content")):
                    self.plain_text, carried = False, True  # tool calls, reasoning: not text one can replay
                piece = delta.get("content")
            else:  # completions
                piece = choice.get("text")
            if isinstance(piece, str):
                self.text.append(piece)
                carried = carried or bool(piece)
            if choice.get("finish_reason"):
                self.finished = True
                self.finish_reason = str(choice["finish_reason"])
        return carried


# The events that end a Responses API stream (it sends no [DONE]).
RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})


class ResponseEvents(SseEvents):
    """A Responses API stream (`response.*` events) read as SseEvents reads chat: whole once its
    final event has come (response.completed, .incomplete, .failed, or an error), usage from that
    event's response (input and output tokens), a token per text delta when there is none. Never
    resumed on another node: its events carry ids and positions a second node could not continue."""

    def __init__(self, most_events: int | None = None) -> None:
        super().__init__(keep_usage_event=True, most_events=most_events)
        self.plain_text = False
        self.items: dict[str, int] = {}  # output items' places by id (and call_id)
        self.outputs = 0  # output items added
        self.numbered = 0  # events passed on

    def _take(self, event: bytes) -> bytes | None:
        payload = self._payload(event)
        if payload is PASS_ON:
            return event
        kind = payload.get("type") if isinstance(payload, dict) else None
        kind = kind if isinstance(kind, str) else None  # a type no event has (a list, say): passed on
        if kind is not None and "sequence_number" not in payload:
            event = self._placed(kind, payload)
        self.numbered += 1
        if kind == "response.output_text.delta":
            delta = payload.get("delta") if isinstance(payload, dict) else None
            self.chunks += 1
            if isinstance(delta, str):
                self.text.append(delta)
        elif kind in RESPONSE_ENDS:
            self.done = self.finished = True
            usage = Usage.parse(payload.get("response") if isinstance(payload, dict) else None)
            self.usage = usage or self.usage
        return event

    def _placed(self, kind: str, payload: dict[str, Any]) -> bytes:
        """An event as OpenAI's are, from llama.cpp's server, which leaves out every event's
        sequence_number and where its content goes (output_index, content_index): OpenAI's SDK's
        stream helper builds the answer by them and fails without. Items are placed in the order
        they are added, and an event by the item it names (one content part an item)."""
        payload["sequence_number"] = self.numbered
        item = payload.get("item")
        if kind.startswith("response.output_item.") and isinstance(item, dict):
            # A function call's item has its call_id (and no id) in newer builds; its deltas name it.
            keys = [k for k in (item.get("id"), item.get("call_id")) if isinstance(k, str)]
            index = next((self.items[k] for k in keys if k in self.items), None)
            if index is None:
                index, self.outputs = self.outputs, self.outputs + 1
            self.items.update(dict.fromkeys(keys, index))
            payload.setdefault("output_index", index)
        elif isinstance(payload.get("item_id"), str):
            payload.setdefault("output_index", self.items.get(payload["item_id"], max(self.outputs - 1, 0)))
            if "arguments" not in kind:  # a function call's arguments are no content part
                payload.setdefault("content_index", 0)
        return f"event: {kind}\ndata: {json.dumps(payload)}".encode()


def _usage_fields(usage: Usage) -> dict[str, int]:
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
