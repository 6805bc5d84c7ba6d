"""One challenge's verdict, from the reference's account of the node's answer.

The node was asked greedily, so each token it sent should be the reference's most likely token
given the tokens before it (the reference is run over the node's own tokens, so one divergence does
not spoil the rest). An honest server of the same artifact differs from the reference only by
arithmetic (batch sizes, threads, its prompt cache): where two tokens are nearly tied it may pick
the other, a gap of a fraction of a logit. A different model, a coarser quantization, a truncated
network or sampling at a temperature picks tokens the reference ranks well below its best.
docs/security.md gives the measured gaps this limit was set from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# An answer fails when at least TOKENS_OVER of its tokens are more than GAP_LIMIT logits below the
# reference's best. One such token alone is not enough: an honest llama-server sent one with a gap of
# 4.7 in 200 challenges (a near-tie the batch shape tipped, or text that tokenizes back otherwise),
# and none sent two over 1 logit; the cheats measured send two or more in most answers.
GAP_LIMIT = 1.0
TOKENS_OVER = 2
# One token this far below the best fails an answer alone (an empty answer's end, say): far past the
# 4.7 of the honest server's worst.
ONE_TOKEN_LIMIT = 8.0
# An answer that says it ran out of tokens ("length") with fewer than max_tokens less this was cut
# short by the node, not by max_tokens (the reference tokenizes the text back: a token or two may differ).
LENGTH_SLACK = 4


@dataclass(frozen=True)
class Verdict:
    passed: bool
    distance: float | None  # the largest gap, in logits (0: the reference's own answer; None: no answer)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def reason(self) -> str | None:
        return None if self.passed else str(self.detail.get("reason", "the answer is not the model's"))


def judge(
    gaps: Sequence[float],
    *,
    finish: str = "stop",
    answer_tokens: int | None = None,
    max_tokens: int | None = None,
) -> Verdict:
    """The verdict on an answer whose tokens the reference scored `gaps` (its best logit less the
    node's token's, one per token, the end of the answer included), which ended for `finish` after
    `answer_tokens` tokens of the `max_tokens` asked."""
    distance = max(gaps, default=0.0)
    over = sum(1 for gap in gaps if gap > GAP_LIMIT)
    detail: dict[str, Any] = {"tokens": len(gaps), "over": over, "max_gap": round(distance, 3)}
    cut_short = (
        finish == "length"
        and answer_tokens is not None
        and max_tokens is not None
        and answer_tokens + LENGTH_SLACK < max_tokens
    )
    if answer_tokens == 0:
        detail["reason"] = "an empty answer"
    elif cut_short:
        detail["reason"] = f"said it ran out of tokens after {answer_tokens} of the {max_tokens} asked"
    elif over >= TOKENS_OVER or distance > ONE_TOKEN_LIMIT:
        at = next(i for i, gap in enumerate(gaps) if gap > GAP_LIMIT)
        detail["reason"] = (
            f"{over} of {len(gaps)} tokens are not the model's greedy choice (the first at token {at},"
            f" {gaps[at]:.1f} logits below the reference's best)"
        )
    return Verdict("reason" not in detail, distance, detail)


def refused(status: int, body: str, long: bool) -> Verdict:
    """A node that refuses a challenge the model takes (a long prompt within its context, say)."""
    what = "a long prompt within the model's context" if long else "a request the model takes"
    reason = f"refused {what}: HTTP {status} {body[:160]}"
    return Verdict(False, None, {"reason": reason, "http_status": status, "long": long})


def unreadable() -> Verdict:
    """A node that answers a chat request with something that is not a chat completion."""
    return Verdict(False, None, {"reason": "answered with something that is not a chat completion"})


def unscorable(why: str) -> Verdict:
    """An answer the reference cannot score: more than was asked, or text that is not Unicode."""
    return Verdict(False, None, {"reason": f"an answer that cannot be scored: {why}"})
