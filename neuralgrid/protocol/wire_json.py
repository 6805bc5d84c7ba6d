"""JSON read at the platform's edges.

What clients send (the gateway's request bodies, the Realtime server's messages) is read as the
standard has it, not by Python's looser reading (loads()). What nodes answer is read as servers
write it, NaN and Infinity included (loads_answer()). Either way, JSON nested too deeply to read is
a ValueError like any other that cannot be read, never a RecursionError.
"""

from __future__ import annotations

import json
from typing import Any


def _refuse_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


# One decoder for every request: json.loads with a parse_constant builds a new one each call.
_STANDARD = json.JSONDecoder(parse_constant=_refuse_constant)


def loads(data: str | bytes) -> Any:
    """Parse JSON text; ValueError for what JSON is not: NaN and Infinity (Python reads them, other
    parsers and Postgres choke on them), and nesting too deep to parse (Python's RecursionError)."""
    if isinstance(data, bytes | bytearray):  # as json.loads reads bytes
        data = data.decode(json.detect_encoding(data), "surrogatepass")
    try:
        return _STANDARD.decode(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def loads_answer(data: str | bytes) -> Any:
    """A server's JSON as Python servers write it: NaN and Infinity are read (vLLM's logprobs hold
    -Infinity where a token's probability is zero). ValueError for what cannot be read, nesting too
    deep to parse among it."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None
