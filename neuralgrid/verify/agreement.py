"""Whether two nodes' greedy answers to the same challenge agree: the check where no reference can
score a node's tokens (gateway/cross_check.py).

Greedy decoding of the same artifact gives the same tokens until two candidates are nearly tied, and
then kernels, batch shapes and prompt caches may break the tie differently: honest answers share a
long beginning and may part after it. Another model, a pruned or requantized one, or a server that
samples, parts early. So two answers agree when they begin with the same AGREE_CHARS characters
(whitespace runs read as one space), or are the same when either is shorter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AGREE_CHARS = 48  # about a dozen tokens of English (docs/security.md says how it was calibrated)
_SPACES = re.compile(r"\s+")


def _plain(text: str) -> str:
    return _SPACES.sub(" ", text).strip()


def shared(a: str, b: str) -> int:
    """How many characters the two answers begin with alike (whitespace runs as one space)."""
    a, b = _plain(a), _plain(b)
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agree(a: str, b: str) -> bool:
    """Whether two greedy answers to one challenge are the same model's: alike over their first
    AGREE_CHARS characters, or over the whole of the longer one when that is shorter."""
    return shared(a, b) >= min(AGREE_CHARS, max(len(_plain(a)), len(_plain(b))))


@dataclass(frozen=True)
class Decision:
    """What a cross-check found: whether the node checked passed (None: no verdict), and which of
    its peers, if any, was the odd one out."""

    passed: bool | None
    odd_peer: int | None
    reason: str


def decide(mine: str, peers: list[str]) -> Decision:
    """The node's answer against its peers' answers to the same challenge, in the order asked: it
    passes when it agrees with the first; when it does not, a second peer decides, and whichever of
    the two disagrees with the other two fails. No verdict without a second answer to decide, or
    when all three disagree."""
    if not peers:
        return Decision(None, None, "no peer answered")
    if agree(mine, peers[0]):
        return Decision(True, None, f"agrees with a peer over {shared(mine, peers[0])} characters")
    if len(peers) < 2:
        return Decision(None, None, "disagrees with a peer, and no second peer answered to decide")
    with_mine, between = agree(mine, peers[1]), agree(peers[0], peers[1])
    if between and not with_mine:
        parted = max(shared(mine, peers[0]), shared(mine, peers[1]))
        return Decision(
            False,
            None,
            f"its answer parts from two nodes serving the same artifact after {parted} characters",
        )
    if with_mine and not between:
        parted = shared(peers[0], mine)
        return Decision(
            True,
            0,
            f"a peer's answer parts from two nodes serving the same artifact after {parted} characters",
        )
    return Decision(None, None, "three nodes serving the same artifact answered three ways")
