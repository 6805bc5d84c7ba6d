"""JSON as clients may send it: the standard, not Python's looser reading of it.

The gateway's request bodies, what nodes answer (read for usage) and the Realtime server's messages
are read with this one function.
"""

from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes) -> Any:
    """Parse JSON text; ValueError for what JSON is not: NaN and Infinity (Python reads them, other
    parsers and Postgres choke on them), and nesting too deep to parse (Python's RecursionError)."""
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _refuse_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")
