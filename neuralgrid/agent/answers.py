"""The server's answers on their way to the gateway: the catalog's model name in place of the
server's (the client never sees an owner's file path), and exact usage where the server gave none or
only one choice's (see Backend.usage): the gateway bills tokens, never events.

Answers pass through as bytes: their events are parsed only when they must be renamed or, once the
server has not sent usage by its end, counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from neuralgrid.agent.backend import Backend
from neuralgrid.agent.relay import RelayError, RelayResponse
from neuralgrid.protocol import wire_json
from neuralgrid.protocol.sse import SseEvents, Usage

# Events held unread while waiting to see whether the server sends usage; past this, they are read
# as they come (as long answers' are), so that memory stays bounded.
HELD_BYTES = 1 << 16
_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}


async def rewritten_events(
    backend: Backend,
    kind: str,
    request: dict[str, Any],
    chunks: RelayResponse,
    count: bool,
    renamed: tuple[str, str] | None,
    several: bool = False,
    private: bool = False,
) -> AsyncIterator[bytes]:
    """The stream as the server sent it, event by event, with the catalog's model name in place
    of the server's (the client never sees an owner's file path), and a usage event before
    [DONE] when the server sent none. Fails open: what cannot be read or counted passes as it came.
    `private`: a server whose prompt cache keys share, its cache counts stripped (private_event).

    Events are not parsed while the server may still send usage (most do, at the end): they
    are held, and read only if [DONE] comes without it. Nor are they taken one by one, unless
    they are to be renamed or a block of them holds usage or [DONE]. With several choices each
    event is read, each choice's text kept, and the usage is theirs counted, in place of the
    server's own (which may be one choice's)."""
    rename = _Renamer(*renamed) if renamed else None
    choices = _Choices() if several else None
    looking = count  # for usage, until the server sends it or [DONE] comes
    held: dict[str, Any] | None = None  # the server's usage event, of several choices
    unread = _Unread()
    pending = b""

    def passed(event: bytes) -> bytes:
        """An event as it goes on: its cache counts stripped, in the catalog's name."""
        event = private_event(event) if private else event
        return rename.event(event) if rename else event

    async def held_usage() -> bytes:
        """The usage held, counted over every choice, in the catalog's name."""
        assert held is not None and choices is not None
        return passed(_sse(await _recounted(backend, request, held, choices.answers())))

    try:
        async for raw in chunks:
            # Events end with a blank line; servers that write CRLF lines are read the same way.
            buffer = pending + raw if pending else raw
            if b"\r" in buffer:
                buffer = buffer.replace(b"\r\n", b"\n")
            last = chunks.finished()
            if b"\n\n" not in buffer and not last:
                pending = buffer
                continue
            events = buffer.split(b"\n\n")
            pending = events.pop()
            whole = buffer[: len(buffer) - len(pending)]  # the events complete so far, as one block
            out: list[bytes] = []
            if (
                rename is None
                and choices is None
                and not (looking and (b"[DONE]" in whole or _USAGE.search(whole)))
                and not (private and _CACHE_COUNTS.search(whole))
            ):
                out.append(whole)
                if looking:
                    unread.add(whole)
            else:
                for bare in events:
                    event = bare + b"\n\n"
                    if choices is not None:
                        payload = choices.feed(event)
                        # The server's usage may come before another choice's last events, and
                        # once a choice (llama-server), or in every event (vLLM's continuous usage
                        # stats): the last is held, to be sent recounted at [DONE] (or the end),
                        # and events that carry choices go on at once without it.
                        if looking and payload is not None and Usage.parse(payload) is not None:
                            held = {**payload, "choices": []}
                            if not _choices_of(payload):
                                continue
                            event = _sse({**payload, "usage": None})
                    if looking and _is_done(event):
                        looking = False
                        if held is not None:
                            out.append(await held_usage())
                            held = None
                        elif tail := await _usage_event(backend, kind, request, unread, choices, renamed):
                            out.append(tail)
                    elif looking and choices is None:
                        if _has_usage(event):
                            looking = False
                        else:
                            unread.add(event)
                    out.append(passed(event))
            if last and held is not None:  # a stream that ends without [DONE]
                out.append(await held_usage())
                held = None
            if last:  # what follows the last event goes with it, as it came: this is the end
                out.append(pending)
                pending = b""
            yield b"".join(out)
    except RelayError:  # broken off: the usage held so far goes on, as the server's own would have
        if held is not None:
            yield await held_usage()
        raise
    if pending:
        yield pending


async def _usage_event(
    backend: Backend,
    kind: str,
    request: dict[str, Any],
    unread: _Unread,
    choices: _Choices | None,
    renamed: tuple[str, str] | None,
) -> bytes | None:
    """The usage event for a stream that ended without one: its text counted by the server."""
    if choices is not None:
        answers, identity = choices.answers(), choices.identity
    else:
        read = unread.events()
        if read.usage is not None:
            return None
        answers, identity = ["".join(read.text)], read.identity
    counted = await backend.usage(kind, request, answers)
    if counted is None:
        return None
    model = renamed[1] if renamed else request.get("model")
    tail = {**identity, "object": _OBJECT[kind], "model": model}
    tail.update(choices=[], usage=counted)
    return _sse(tail)


async def _recounted(
    backend: Backend, request: dict[str, Any], event: dict[str, Any], answers: list[str]
) -> dict[str, Any]:
    """A usage event of the server's, its completion tokens those of every choice."""
    return await _with_choices_counted(backend, request, event, answers) or event


async def _with_choices_counted(
    backend: Backend, request: dict[str, Any], payload: Any, answers: list[str]
) -> dict[str, Any] | None:
    """The answer (or usage event) with its usage's completion tokens counted over every choice;
    None when it has no usage to correct or they cannot be counted (it passes as it came)."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict) or type(prompt := usage.get("prompt_tokens")) is not int:
        return None
    completion = await backend.completion_tokens(str(request.get("model") or ""), answers)
    if completion is None:
        return None
    reported = usage.get("completion_tokens")
    completion = max(completion, reported) if type(reported) is int else completion  # never less
    counted = {**usage, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {**payload, "usage": counted}


async def counted_body(
    backend: Backend,
    request: dict[str, Any],
    chunks: AsyncIterator[bytes],
    renamed: tuple[str, str] | None,
    private: bool = False,
) -> AsyncIterator[bytes]:
    """A whole answer of several choices (read whole: it is small), its usage theirs counted."""
    body = b"".join([chunk async for chunk in chunks])
    try:
        payload = wire_json.loads_answer(body)
    except ValueError:
        payload = None
    answers = [_choice_text(c) for c in _choices_of(payload)]
    recounted = await _with_choices_counted(backend, request, payload, answers) if answers else None
    if recounted is not None:
        body = json.dumps(recounted).encode()
    body = private_body(body) if private else body
    yield _Renamer(*renamed).body(body) if renamed else body


# What an answer says of the server's prompt cache: how much of the prompt it found there
# (`cached_tokens`; llama-server's `timings` and `prompt_progress` tell the same, and its times).
_CACHE_COUNTS = re.compile(rb'"(?:cached_tokens|timings|prompt_progress)"')
_CACHE_REPORTS = ("timings", "prompt_progress")


def without_cache_counts(payload: dict[str, Any]) -> dict[str, Any]:
    """An answer or event of a server whose prompt cache all keys share, telling nothing of it: no
    llama.cpp timings or progress, and 0 tokens cached (the field kept: OpenAI's SDK reads it)."""
    stripped = {k: v for k, v in payload.items() if k not in _CACHE_REPORTS}
    response = stripped.get("response")  # a Responses API event's
    if isinstance(response, dict) and isinstance(response.get("usage"), dict):
        stripped["response"] = {**response, "usage": _uncached(response["usage"])}
    if isinstance(stripped.get("usage"), dict):
        stripped["usage"] = _uncached(stripped["usage"])
    return stripped


def _uncached(usage: dict[str, Any]) -> dict[str, Any]:
    usage = dict(usage)
    for field in ("prompt_tokens_details", "input_tokens_details"):  # chat and completions; Responses
        details = usage.get(field)
        if isinstance(details, dict) and "cached_tokens" in details:
            usage[field] = {**details, "cached_tokens": 0}
    return usage


def private_event(event: bytes) -> bytes:
    """One SSE event with its cache counts stripped (without_cache_counts), other lines kept."""
    if _CACHE_COUNTS.search(event) is None:
        return event
    try:
        payload = wire_json.loads_answer(_data(event))
    except ValueError:
        return event
    if not isinstance(payload, dict):
        return event
    head = b"".join(line + b"\n" for line in event.split(b"\n") if line and not line.startswith(b"data:"))
    return head + _sse(without_cache_counts(payload))


def private_body(body: bytes) -> bytes:
    """A whole JSON answer with its cache counts stripped (without_cache_counts)."""
    if _CACHE_COUNTS.search(body) is None:
        return body
    try:
        payload = wire_json.loads_answer(body)
    except ValueError:
        return body
    return json.dumps(without_cache_counts(payload)).encode() if isinstance(payload, dict) else body


class _Choices:
    """Each choice's text of a stream of several, as its events come."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.identity: dict[str, Any] = {}

    def feed(self, event: bytes) -> dict[str, Any] | None:
        """Notes the event's text; its JSON, if it has an object."""
        try:
            payload = wire_json.loads_answer(_data(event))
        except ValueError:  # [DONE], a comment, what is not JSON: no text
            return None
        if not isinstance(payload, dict):
            return None
        if not self.identity:
            self.identity = {k: payload[k] for k in ("id", "created") if k in payload}
        for choice in _choices_of(payload):
            if isinstance(choice, dict) and type(index := choice.get("index", 0)) is int:
                self.texts.setdefault(index, []).append(_choice_text(choice))
        return payload

    def answers(self) -> list[str]:
        return ["".join(parts) for parts in self.texts.values()]


def _choices_of(payload: Any) -> list[Any]:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    return choices if isinstance(choices, list) else []


def _choice_text(choice: Any) -> str:
    """A choice's text: a chat message's or delta's content and reasoning (llama-server and vLLM
    send it apart; it is generated and billed all the same), or a completion's text."""
    if not isinstance(choice, dict):
        return ""
    said = choice.get("message") or choice.get("delta") or {}
    parts = [said.get("reasoning_content"), said.get("content")] if isinstance(said, dict) else []
    parts.append(choice.get("text"))
    return "".join(part for part in parts if isinstance(part, str))


def _sse(payload: dict[str, Any]) -> bytes:
    """One SSE event of JSON data."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class _Unread:
    """A stream's events kept unread while its server may still send usage: read only if it does
    not (or as they come, past HELD_BYTES, so that a long answer holds no more than that)."""

    def __init__(self) -> None:
        self.blocks: list[bytes] = []
        self.size = 0
        self.read: SseEvents | None = None

    def add(self, events: bytes) -> None:
        if self.read is not None:
            self.read.feed(events)
            return
        self.blocks.append(events)
        self.size += len(events)
        if self.size > HELD_BYTES:
            self.events()

    def events(self) -> SseEvents:
        """All of them, read."""
        if self.read is None:
            self.read = SseEvents(keep_usage_event=True)
            self.read.feed(b"".join(self.blocks))
            self.blocks.clear()
        return self.read


def json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None when it is not one (the front reads requests with it too)."""
    try:
        request = wire_json.loads(body)
    except ValueError:
        return None
    return request if isinstance(request, dict) else None


def _data(event: bytes) -> bytes:
    """An event's data: its `data:` lines (a space after the colon is optional), joined."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines).strip()


def _is_done(event: bytes) -> bool:
    return event.rstrip().endswith(b"[DONE]") and _data(event) == b"[DONE]"


# A usage field with a value (servers send `"usage": null` in every chunk of a stream that asked
# for usage): only such events are worth parsing to know whether the server gave its usage.
_USAGE = re.compile(rb'"usage"\s*:(?!\s*null)')


def _has_usage(event: bytes) -> bool:
    if _USAGE.search(event) is None:
        return False
    try:
        payload = wire_json.loads_answer(_data(event))
    except ValueError:  # not JSON, or nested past what can be read
        return False
    return Usage.parse(payload) is not None


class _Renamer:
    """The served model's name in JSON, replaced by the catalog's: where it is written as
    `"model": "<served>"`, in place; otherwise (a name written with escapes) by parsing the JSON."""

    def __init__(self, served: str, catalog: str) -> None:
        self.renamed = (served, catalog)
        self.pattern = re.compile(rb'("model"\s*:\s*)' + re.escape(json.dumps(served).encode()))
        self.to = json.dumps(catalog).encode()

    def _sub(self, match: re.Match[bytes]) -> bytes:
        return match.group(1) + self.to

    def event(self, event: bytes) -> bytes:
        """One SSE event whose JSON data names the served model, naming the catalog's instead."""
        new, n = self.pattern.subn(self._sub, event)
        if n or b'"model"' not in event:
            return new
        head, sep, data = event.partition(b"data:")
        payload = _renamed(data, self.renamed) if sep else None
        return event if payload is None else head + b"data: " + payload + b"\n\n"

    def body(self, body: bytes) -> bytes:
        """A JSON answer naming the served model, naming the catalog's instead."""
        new, n = self.pattern.subn(self._sub, body)
        return new if n else _renamed(body, self.renamed) or body


async def rewritten_body(
    chunks: AsyncIterator[bytes], renamed: tuple[str, str] | None, private: bool
) -> AsyncIterator[bytes]:
    """A JSON answer (read whole: it is small), its cache counts stripped if `private`, renamed."""
    body = b"".join([chunk async for chunk in chunks])
    body = private_body(body) if private else body
    yield _Renamer(*renamed).body(body) if renamed else body


def _renamed(data: bytes, renamed: tuple[str, str]) -> bytes | None:
    """A JSON object naming the served model, re-encoded naming the catalog's; None if it does not."""
    try:
        payload = wire_json.loads_answer(data)
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("model") != renamed[0]:
        return None
    return json.dumps({**payload, "model": renamed[1]}).encode()


def text_answers(request: dict[str, Any]) -> bool:
    """Plain text answers, the kind whose tokens the server's tokenizer can count afterwards."""
    return not request.get("tools") and not request.get("echo")
