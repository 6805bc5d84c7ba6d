"""Cross-checks' rule (verify/agreement.py): two greedy answers agree when, where they part, each
one's token is a near tie in the other's distribution; a second peer decides a disagreement, and the
odd one out fails. Answers are read from a chat completion's logprobs as servers send them."""

from __future__ import annotations

from typing import Any

from neuralgrid.verify.agreement import TIE, Step, agree, decide, loss, parting, steps


def answer(*tokens: tuple[str, dict[str, float]]) -> list[Step]:
    return [Step(token, top) for token, top in tokens]


COMMON = [("The", {"The": -1.7, "A": -1.9}), (" colour", {" colour": -1.5, " most": -2.0})]
# Where an honest llama-server and llama-cpp-python parted (measured): " is" -1.44 and " I" -1.49 at
# one, " I" -1.49 and " is" -1.50 at the other.
HONEST = answer(*COMMON, (" is", {" is": -1.44, " I": -1.49, " you": -2.0}))
HONEST_TOO = answer(*COMMON, (" I", {" I": -1.49, " is": -1.50, " you": -2.0}))
OTHER = answer(("Thank", {"Thank": -0.2, "The": -4.0}), (" you", {" you": -0.1}))  # another model
OTHER_TOO = answer(("Thank", {"Thank": -0.3, "The": -3.5}), (" you", {" you": -0.2}))


def test_answers_that_part_at_a_near_tie_agree_and_another_models_do_not() -> None:
    assert parting(HONEST, HONEST) is None and loss(HONEST, HONEST) == 0 and agree(HONEST, HONEST)
    assert parting(HONEST, HONEST_TOO) == 2 and agree(HONEST, HONEST_TOO)
    assert loss(HONEST, HONEST_TOO) < TIE and loss(HONEST_TOO, HONEST) < TIE
    assert not agree(HONEST, OTHER) and loss(OTHER, HONEST) > TIE
    longer = [*HONEST, *HONEST_TOO]
    assert agree(HONEST, HONEST[:2]) is False  # ended after two tokens where the other went on
    assert agree(HONEST, longer) and agree(longer, HONEST)  # ended after three alike: compared no further
    assert not agree([], HONEST) and agree([], [])  # an empty answer agrees with nothing but another


def test_a_liars_own_distribution_does_not_make_it_agree() -> None:
    """A cheat that claims the honest token was its near tie still loses in the honest node's list."""
    liar = answer(("Thank", {"Thank": -0.2, "The": -0.21}), (" you", {" you": -0.1}))
    assert loss(HONEST, liar) < TIE  # its own word
    assert loss(liar, HONEST) > TIE and not agree(HONEST, liar)
    unlisted = answer(
        ("Zebra", {"Zebra": -0.1}),
    )  # not among the honest node's candidates at all
    assert loss(unlisted, HONEST) >= 0.2 and not agree(unlisted, answer(("The", {"The": -0.1, "A": -5.0})))


def test_a_second_peer_decides_a_disagreement_and_the_odd_one_out_fails() -> None:
    assert decide(HONEST, [HONEST_TOO]).passed is True
    assert decide(HONEST, []).passed is None
    assert decide(OTHER, [HONEST]).passed is None  # one against one: nobody knows who is right
    cheat = decide(OTHER, [HONEST, HONEST_TOO])
    assert cheat.passed is False and cheat.odd_peer is None and "parts from two peers" in cheat.reason
    peer_cheats = decide(HONEST, [OTHER, HONEST_TOO])
    assert peer_cheats.passed is True and peer_cheats.odd_peer == 0
    colluding = decide(HONEST, [OTHER, OTHER_TOO])  # two peers of the same other model outvote it
    assert colluding.passed is False


def test_steps_are_read_from_a_chat_completions_logprobs() -> None:
    logprobs: dict[str, Any] = {
        "content": [
            {
                "token": "The",
                "logprob": -1.7,
                "bytes": None,
                "top_logprobs": [{"token": "The", "logprob": -1.7}, {"token": "A", "logprob": -1.9}],
            }
        ]
    }
    assert steps(logprobs) == [Step("The", {"The": -1.7, "A": -1.9})]
    assert steps(None) is None and steps({"content": None}) is None
    assert steps({"content": [{"token": "The", "top_logprobs": []}]}) is None  # no candidates: not asked
    nan = {"content": [{"token": "A", "top_logprobs": [{"token": "A", "logprob": float("nan")}]}]}
    assert steps(nan) is None
