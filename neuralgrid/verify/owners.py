"""What an owner is told when asking again for a node's verification changes nothing (the gateway's
/api/my/verification and the CLI on a hosted project say it alike)."""

from __future__ import annotations

from collections.abc import Sequence


def nothing_restarted(node_name: str, states: Sequence[tuple[str, str]]) -> str:
    """`states`: the node's (model, state) under verification."""
    said = ", ".join(f"{model} {state}" for model, state in states) or "no model of it is under verification"
    return (
        f"none of {node_name}'s models can start over now ({said}): a model is verified again once it"
        " has failed, an hour after at the soonest"
    )
