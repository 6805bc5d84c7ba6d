"""Cross-checks' rule (verify/agreement.py): two greedy answers agree over their first AGREE_CHARS
characters, or whole when shorter; a second peer decides a disagreement, and the odd one out fails."""

from __future__ import annotations

from neuralgrid.verify.agreement import AGREE_CHARS, agree, decide, shared

HONEST = "Your order #48213 shipped on Monday and should arrive by Thursday. Track it in your account."
LATE_TIE = HONEST[:60] + " Friday, and you can track it online."  # parted after a near tie, late
OTHER = "Thank you for reaching out! I'm sorry to hear about the delay with your order."


def test_answers_agree_over_their_beginning_and_whitespace_runs_read_as_one() -> None:
    assert agree(HONEST, HONEST) and agree(HONEST, LATE_TIE)
    assert agree(HONEST, HONEST.replace(" ", "  \n", 3) + "\n")
    assert shared(HONEST, LATE_TIE) >= AGREE_CHARS
    assert not agree(HONEST, OTHER) and shared(HONEST, OTHER) < AGREE_CHARS
    assert not agree(HONEST, HONEST[: AGREE_CHARS // 2] + "X" + HONEST[AGREE_CHARS // 2 + 1 :])


def test_short_answers_agree_only_whole_and_an_empty_one_never() -> None:
    assert agree("Paris.", "Paris.") and not agree("Paris.", "Paris is")
    assert not agree("", "Paris.") and not agree("Paris.", "")
    assert agree("", "")


def test_a_second_peer_decides_a_disagreement_and_the_odd_one_out_fails() -> None:
    assert decide(HONEST, [LATE_TIE]).passed is True
    assert decide(HONEST, []).passed is None
    assert decide(OTHER, [HONEST]).passed is None  # one against one: nobody knows who is right
    cheat = decide(OTHER, [HONEST, LATE_TIE])
    assert cheat.passed is False and cheat.odd_peer is None and "parts from two nodes" in cheat.reason
    peer_cheats = decide(HONEST, [OTHER, LATE_TIE])
    assert peer_cheats.passed is True and peer_cheats.odd_peer == 0
    three_ways = decide(HONEST, [OTHER, "Something else entirely, at length, from a third model here."])
    assert three_ways.passed is None and three_ways.odd_peer is None
