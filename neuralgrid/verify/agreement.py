"""Whether two nodes' greedy answers to the same challenge are the same model's: the check where no
reference can score a node's tokens (gateway/verifier.py's cross-checks).

Greedy decoding of the same artifact picks the same tokens until two candidates are nearly tied;
there kernels, batch shapes and prompt caches may break the tie differently, and the answers part
(measured here: an honest llama-server and llama-cpp-python of the same GGUF began differently in 4
of 40 challenges). So the answers are read with their log-probabilities (`logprobs`, TOP_LOGPROBS
candidates a token) and compared where they first part: each answer's token there must be within
TIE of the best candidate in the other's own distribution. An honest parting is a near tie both
ways; another model's token is far down an honest node's list, whatever that model says of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TOP_LOGPROBS = 5  # candidates asked for each token
TIE = 1.0  # logits (natural-log probabilities): the most an honest parting may lose on either side
MIN_SHARED = 3  # tokens alike before one answer ends where the other goes on


@dataclass(frozen=True)
class Step:
    """One token of an answer, and the candidates its server weighed for it (token -> logprob)."""

    token: str
    top: dict[str, float]


def steps(logprobs: Any) -> list[Step] | None:
    """An answer's tokens from a chat completion's `choices[0].logprobs`; None when it has none."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    out = []
    for item in content:
        if not isinstance(item, dict) or not isinstance(item.get("token"), str):
            return None
        top: dict[str, float] = {}
        for candidate in item.get("top_logprobs") or []:
            if isinstance(candidate, dict) and isinstance(candidate.get("token"), str):
                value = candidate.get("logprob")
                if isinstance(value, int | float) and math.isfinite(value):
                    top.setdefault(candidate["token"], float(value))
        if not top:
            return None
        out.append(Step(item["token"], top))
    return out


def parting(a: Sequence[Step], b: Sequence[Step]) -> int | None:
    """Where the two answers first differ; None when one is all of the other's beginning."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x.token != y.token:
            return i
    return None


def loss(a: Sequence[Step], b: Sequence[Step]) -> float:
    """What `a`'s token where they part loses against the best in `b`'s distribution there (0 when
    they never part; infinite when b does not even list it among its candidates: TOP_LOGPROBS
    tokens more likely than it is no tie a kernel's rounding breaks)."""
    i = parting(a, b)
    if i is None:
        return 0.0
    top = b[i].top
    token = a[i].token
    return max(top.values()) - top[token] if token in top else math.inf


def agree(a: Sequence[Step], b: Sequence[Step]) -> bool:
    """The same model's answers: where they part, each one's token is a near tie in the other's
    distribution (both ways, so neither side's own word decides). One that ended where the other
    went on is compared no further, once it said MIN_SHARED tokens alike (an empty answer agrees with
    nothing but another)."""
    if parting(a, b) is None and len(a) != len(b) and min(len(a), len(b)) < MIN_SHARED:
        return False
    return loss(a, b) <= TIE and loss(b, a) <= TIE


@dataclass(frozen=True)
class Decision:
    """What a cross-check found: whether the node checked passed (None: no verdict), and which of
    its peers, if any, was the odd one out."""

    passed: bool | None
    odd_peer: int | None
    reason: str


def decide(mine: Sequence[Step], peers: Sequence[Sequence[Step]]) -> Decision:
    """The node's answer against its peers' answers to the same challenge, in the order asked: it
    passes when it agrees with the first; when it does not, a second peer decides, and whichever of
    the two disagrees with the other two fails. No verdict without a second answer to decide, or
    when all three disagree."""
    if not peers:
        return Decision(None, None, "no peer answered")
    if agree(mine, peers[0]):
        return Decision(True, None, "agrees with a peer serving the same artifact")
    if len(peers) < 2:
        return Decision(None, None, "disagrees with a peer, and no second peer answered to decide")
    with_mine, between = agree(mine, peers[1]), agree(peers[0], peers[1])
    if between and not with_mine:
        return Decision(
            False, None, "parts from two peers serving the same artifact " + _by(mine, *peers[:2])
        )
    if with_mine and not between:
        return Decision(
            True, 0, "a peer parts from two nodes serving the same artifact " + _by(peers[0], mine, peers[1])
        )
    return Decision(None, None, "three nodes serving the same artifact answered three ways")


def _by(odd: Sequence[Step], one: Sequence[Step], other: Sequence[Step]) -> str:
    """How far the odd answer is from the two others where it parts from each, at the least."""
    apart = min(max(loss(odd, x), loss(x, odd)) for x in (one, other))
    if math.isinf(apart):
        return "with tokens the others do not list among their candidates"
    return f"by {apart:.2f} logits at least (a near tie is within {TIE:g})"
