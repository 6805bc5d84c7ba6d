"""Challenges and verdicts, alone: what a node is asked (everyday tasks with a nonce, greedy, long now
and then where the model's context allows) and how one answer is judged from the reference's gaps."""

from __future__ import annotations

import random
import re

from neuralgrid.verify import challenge
from neuralgrid.verify.verdict import GAP_LIMIT, judge, refused, unreadable


def test_challenges_are_greedy_everyday_requests_each_with_its_own_nonce() -> None:
    made = [challenge.make(8192) for _ in range(200)]
    users = [c.messages[-1]["content"] for c in made]
    # Their own nonces: six random digits, so two of 200 meet now and then by chance (a CI run saw
    # one pair among 200); more than that would be a nonce that does not vary.
    assert len(set(users)) >= len(users) - 2
    assert all(re.search(r"\b\d{6}\b", u) for u in users)
    assert all(c.messages[0]["role"] == "system" and c.messages[1]["role"] == "user" for c in made)
    body = made[0].body("m")
    assert body == {
        "model": "m",
        "messages": made[0].messages,
        "max_tokens": made[0].max_tokens,
        "temperature": 0,
    }
    asked = {c.max_tokens for c in made}
    assert min(asked) >= challenge.MAX_TOKENS[0] and max(asked) <= challenge.MAX_TOKENS[1] and len(asked) > 10
    longs = [c for c in made if c.long]
    assert 20 <= len(longs) <= 90  # about one in LONG_SHARE
    for c in longs:
        size = len(c.messages[1]["content"])
        assert (
            challenge.LONG_TOKENS * challenge.CHARS_PER_TOKEN
            <= size
            <= (challenge.LONG_TOKENS + 60) * challenge.CHARS_PER_TOKEN
        )
        number = re.search(r"Who wrote ticket (\d{6})", c.messages[1]["content"])
        assert number and f"Ticket {number[1]}:" in c.messages[1]["content"]  # the question is about the log


def test_a_model_with_a_short_context_gets_no_long_challenge() -> None:
    rng = random.Random(7)
    assert not any(challenge.make(1024, rng).long for _ in range(100))


def test_an_answer_the_reference_would_give_passes_and_one_it_ranks_low_fails() -> None:
    honest = judge([0.0, 0.0, 0.4, 0.0, 0.0])  # a near-tie picked the other way
    assert honest.passed and honest.distance == 0.4 and honest.reason is None
    assert judge([0.0, 4.7, 0.0, 0.0]).passed  # one token far off alone is not enough
    assert not judge([0.0, 9.0]).passed  # but one far enough is
    assert not judge([0.3], answer_tokens=0).passed  # an empty answer, however likely its end
    assert not judge([0.0] * 10, finish="length", answer_tokens=10, max_tokens=32).passed  # cut short
    assert judge([0.0] * 30, finish="length", answer_tokens=30, max_tokens=32).passed  # tokenized back
    cheat = judge([0.0, 0.0, GAP_LIMIT + 0.5, 7.25, 0.0])
    assert not cheat.passed and cheat.distance == 7.25
    assert cheat.detail == {"tokens": 5, "over": 2, "max_gap": 7.25, "reason": cheat.reason}
    assert cheat.reason == (
        "2 of 5 tokens are not the model's greedy choice (the first at token 2, 1.5 logits below the"
        " reference's best)"
    )


def test_a_refusal_or_an_unreadable_answer_fails_without_the_reference() -> None:
    cut = refused(400, '{"error": {"message": "the request exceeds the available context size"}}', True)
    assert not cut.passed and cut.distance is None
    assert cut.reason is not None and cut.reason.startswith(
        "refused a long prompt within the model's context: HTTP 400"
    )
    assert not unreadable().passed


def test_only_a_greedy_plain_chat_is_auditable() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    greedy = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 8, "cache_salt": "s"}
    assert challenge.auditable({**greedy, "max_tokens": None, "max_completion_tokens": 64}) == messages
    assert challenge.auditable(greedy) == messages
    assert challenge.auditable({**greedy, "stream": True, "user": "u", "n": 1}) == messages
    streamed = {**greedy, "stream": True, "stream_options": {"include_usage": True}}
    assert challenge.auditable(streamed) == messages  # streams are audited too
    changes: list[dict[str, object]] = [
        {"temperature": 0.7},
        {"temperature": None},
        {"stop": ["\n"]},
        {"frequency_penalty": 0.5},
        {"tools": []},
        {"response_format": {"type": "json_object"}},
        {"n": 2},
        {"seed": 1},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": "Hi", "name": "bob"}]},
        {"messages": []},
        {"messages": [*messages, {"role": "assistant", "content": "Hel"}]},  # continued, not answered anew
        {"max_tokens": 65},  # longer than the rule was calibrated on
        {"max_tokens": None},
    ]
    for changed in changes:
        assert challenge.auditable({**greedy, **changed}) is None, changed
    assert challenge.auditable({k: v for k, v in greedy.items() if k != "temperature"}) is None
