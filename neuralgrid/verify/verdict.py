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


@dataclass(frozen=True)
class Verdict:
    passed: bool
    distance: float | None  # the largest gap, in logits (0: the reference's own answer; None: no answer)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def reason(self) -> str | None:
        return None if self.passed else str(self.detail.get("reason", "the answer is not the model's"))


def judge(gaps: Sequence[float], *, limit: float = GAP_LIMIT) -> Verdict:
    """The verdict on an answer whose tokens the reference scored `gaps` (its best logit less the
    node's token's, one per token, the end of the answer included)."""
    distance = max(gaps, default=0.0)
    over = sum(1 for gap in gaps if gap > limit)
    detail: dict[str, Any] = {"tokens": len(gaps), "over": over, "max_gap": round(distance, 3)}
    if over >= TOKENS_OVER:
        at = next(i for i, gap in enumerate(gaps) if gap > limit)
        detail["reason"] = (
            f"{over} of {len(gaps)} tokens are not the model's greedy choice (the first at token {at},"
            f" {gaps[at]:.1f} logits below the reference's best)"
        )
    return Verdict(over < TOKENS_OVER, distance, detail)


def refused(status: int, body: str, long: bool) -> Verdict:
    """A node that refuses a challenge the model takes (a long prompt within its context, say)."""
    what = "a long prompt within the model's context" if long else "a request the model takes"
    reason = f"refused {what}: HTTP {status} {body[:160]}"
    return Verdict(False, None, {"reason": reason, "http_status": status, "long": long})


def unreadable() -> Verdict:
    """A node that answers a chat request with something that is not a chat completion."""
    return Verdict(False, None, {"reason": "answered with something that is not a chat completion"})
