"""Input rules the API, the CLI and fleet files share: pydantic's errors in our words, and what the
database can hold without rounding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def message(error: Mapping[str, Any]) -> str:
    """One error's message (an item of ValidationError.errors()): a validator's own words, without
    the "Value error, " pydantic puts before them."""
    cause = error.get("ctx", {}).get("error") if error.get("type") == "value_error" else None
    return str(cause) if cause is not None else str(error["msg"])


# What api_keys holds (checked by the API and the CLI before it is written, never rounded): limits in
# integer columns, budgets in numeric(12,4).
KEY_LIMIT_MAX = 2**31 - 1
KEY_BUDGET_MAX_USD = 10**8
