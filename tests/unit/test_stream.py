"""The relay's view of a stream (usage, the answer so far) and the request that resumes one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from neuralgrid.gateway.pipeline.relay import audited, continuation
from neuralgrid.protocol.sse import MAX_EVENT_BYTES, NotAnAnswer, SseEvents, Usage


def _sse(*payloads: Any) -> bytes:
    return b"".join(f"data: {json.dumps(p)}\n\n".encode() for p in payloads)


def _chat_chunk(content: str | None, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": content, **delta}, "finish_reason": finish}
    return {"id": "chatcmpl-1", "created": 7, "choices": [choice]}


CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 10,
    "stream": True,
}


def test_events_are_split_whole_across_reads_and_text_is_kept() -> None:
    events = SseEvents(keep_usage_event=False)
    raw = _sse(_chat_chunk("Hel"), _chat_chunk("lo")) + b"data: [DONE]\n\n"
    out = [e for i in range(0, len(raw), 7) for e in events.feed(raw[i : i + 7])]
    assert b"".join(out) == raw and events.done
    assert "".join(events.text) == "Hello" and events.chunks == 2 and not events.finished


def test_crlf_lines_split_between_reads_end_events_as_lf_lines_do() -> None:
    raw = _sse(_chat_chunk("Hel"), _chat_chunk("lo")).replace(b"\n", b"\r\n") + b"data: [DONE]\r\n\r\n"
    for size in (1, 2, 3, 5):
        events = SseEvents(keep_usage_event=False)
        out = [e for i in range(0, len(raw), size) for e in events.feed(raw[i : i + size])]
        assert b"".join(out) == raw.replace(b"\r\n", b"\n") and events.done, size
        assert "".join(events.text) == "Hello"


def test_a_stream_no_answer_could_be_is_refused() -> None:
    """A security review's cases: an event that never ends (128 MiB took 76 s of the gateway's CPU,
    its buffer copied whole for each piece), and tiny events by the million (4 MiB, 16 s)."""
    endless = SseEvents(keep_usage_event=False)
    piece = b"data: " + b"x" * (1 << 20)
    with pytest.raises(NotAnAnswer, match="MiB"):
        for _ in range(MAX_EVENT_BYTES // len(piece) + 2):
            endless.feed(piece)
    assert len(endless.buffer) <= MAX_EVENT_BYTES + len(piece)
    tiny = SseEvents(keep_usage_event=False, most_events=100)
    assert len(tiny.feed(b"data:a\n\n" * 100)) == 100
    with pytest.raises(NotAnAnswer, match="more events"):
        tiny.feed(b"data:a\n\n")
    # The node the stream resumes on is counted on its own (a review: it inherited the count, and
    # failed on its first event, and the next node too).
    tiny.resumed()
    assert len(tiny.feed(b"data:a\n\n" * 100)) == 100


def test_the_usage_event_the_gateway_asked_for_is_dropped_unless_the_client_asked_too() -> None:
    usage_event = {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    for keep in (False, True):
        events = SseEvents(keep_usage_event=keep)
        out = events.feed(_sse(_chat_chunk("a"), usage_event))
        assert len(out) == (2 if keep else 1) and events.usage == Usage(5, 2)


def test_after_a_resume_events_keep_the_first_id_and_usage_counts_both_nodes() -> None:
    events = SseEvents(keep_usage_event=True)
    events.feed(_sse(_chat_chunk("one "), _chat_chunk("two ")))
    events.resumed()
    usage = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    out = events.feed(
        _sse(
            {**_chat_chunk("three "), "id": "chatcmpl-2", "created": 9},
            {"id": "x", "choices": [], "usage": usage},
        )
    )
    payloads = [json.loads(e.removeprefix(b"data: ")) for e in out]
    assert {(p["id"], p["created"]) for p in payloads} == {("chatcmpl-1", 7)}
    assert payloads[1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert events.usage == Usage(10, 5) and "".join(events.text) == "one two three "


def test_a_chat_continuation_sends_the_answer_so_far_as_an_open_assistant_message() -> None:
    events = SseEvents(keep_usage_event=False)
    events.feed(_sse(_chat_chunk("", role="assistant"), _chat_chunk("Hello "), _chat_chunk("there")))
    body = json.loads(continuation("chat", CHAT, events) or b"")
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello there"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    # Two tokens streamed (the role-only event carries none); the original is untouched.
    assert body["max_tokens"] == 10 - 2 and CHAT["max_tokens"] == 10


def test_a_clients_own_prefill_is_extended_not_repeated() -> None:
    prefill = {
        **CHAT,
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure: "}],
        "continue_final_message": True,
    }
    events = SseEvents(keep_usage_event=False)
    events.feed(_sse(_chat_chunk("yes")))
    body = json.loads(continuation("chat", prefill, events) or b"")
    assert body["messages"][1:] == [{"role": "assistant", "content": "Sure: yes"}]


def test_a_completion_continuation_extends_the_prompt() -> None:
    events = SseEvents(keep_usage_event=False)
    events.feed(_sse({"id": "cmpl-1", "choices": [{"index": 0, "text": " there", "finish_reason": None}]}))
    body = json.loads(continuation("completion", {"prompt": "Hi", "max_tokens": 4}, events) or b"")
    assert body == {"prompt": "Hi there", "max_tokens": 3}


def test_streams_that_cannot_be_resumed() -> None:
    def after(kind: str, body: dict[str, Any], *chunks: dict[str, Any]) -> bytes | None:
        events = SseEvents(keep_usage_event=False)
        events.feed(_sse(*chunks))
        return continuation(kind, body, events)

    assert after("chat", CHAT, _chat_chunk("done", finish="stop")) is None  # the answer is whole
    tool = _chat_chunk(None, tool_calls=[{"index": 0, "function": {"name": "f"}}])
    assert after("chat", CHAT, tool) is None
    two = {"id": "c", "choices": [{"index": 1, "delta": {"content": "b"}}]}
    assert after("chat", {**CHAT, "n": 2}, _chat_chunk("a")) is None and after("chat", CHAT, two) is None
    assert after("chat", {**CHAT, "max_tokens": 2}, _chat_chunk("a"), _chat_chunk("b")) is None  # spent
    text = {"id": "c", "choices": [{"index": 0, "text": "x"}]}
    assert after("completion", {"prompt": ["a", "b"]}, text) is None
    assert after("completion", {"prompt": "a", "echo": True}, text) is None


def test_data_lines_without_a_space_and_keep_alive_comments() -> None:
    events = SseEvents(keep_usage_event=False)
    out = events.feed(b": keep-alive\n\n" + b"data:" + json.dumps(_chat_chunk("hi")).encode() + b"\n\n")
    assert len(out) == 2 and events.chunks == 1 and events.text == ["hi"]


def test_after_a_resume_the_next_nodes_usage_is_added_to_what_came_before() -> None:
    events = SseEvents(keep_usage_event=False)
    first_usage = {"prompt_tokens": 5, "completion_tokens": 2}
    events.feed(_sse({**_chat_chunk("a b"), "usage": first_usage}))  # usage on every chunk
    events.resumed()
    events.feed(_sse(_chat_chunk(" c"), _chat_chunk(" d")))  # the next node reports none
    assert events.usage is None and events.tokens() == 2 + 2


def test_answers_one_cannot_replay_are_not_resumed() -> None:
    reasoning = SseEvents(keep_usage_event=False)
    reasoning.feed(_sse(_chat_chunk(None, reasoning_content="thinking")))
    assert continuation("chat", CHAT, reasoning) is None
    for constrained in ({"response_format": {"type": "json_object"}}, {"guided_regex": "[a-z]+"}):
        events = SseEvents(keep_usage_event=False)
        events.feed(_sse(_chat_chunk("{")))
        assert continuation("chat", {**CHAT, **constrained}, events) is None
    events = SseEvents(keep_usage_event=False)
    events.feed(_sse(_chat_chunk("plain")))
    assert continuation("chat", {**CHAT, "response_format": {"type": "text"}}, events) is not None


def test_nothing_but_a_role_so_far_asks_again_as_it_was() -> None:
    events = SseEvents(keep_usage_event=False)
    events.feed(_sse(_chat_chunk("", role="assistant")))
    assert json.loads(continuation("chat", CHAT, events) or b"") == CHAT


def test_a_whole_chat_streams_text_and_finish_reason_are_what_an_audit_scores() -> None:
    events = SseEvents(keep_usage_event=False)
    events.feed(_sse(_chat_chunk("", role="assistant"), _chat_chunk("Paris"), _chat_chunk(".", "stop")))
    events.feed(b"data: [DONE]\n\n")
    assert "".join(events.text) == "Paris." and events.finish_reason == "stop" and audited(events)
    resumed = SseEvents(keep_usage_event=False)
    resumed.feed(_sse(_chat_chunk("Par")))
    resumed.resumed()  # another node wrote the rest: no one node's answer
    resumed.feed(_sse(_chat_chunk("is", "stop")) + b"data: [DONE]\n\n")
    assert not audited(resumed)
    tools = SseEvents(keep_usage_event=False)
    tools.feed(_sse(_chat_chunk(None, "tool_calls", tool_calls=[{"index": 0}])) + b"data: [DONE]\n\n")
    assert not audited(tools)
    cut = SseEvents(keep_usage_event=False)
    cut.feed(_sse(_chat_chunk("Par")))
    assert not audited(cut)  # no finish reason: not a whole answer
