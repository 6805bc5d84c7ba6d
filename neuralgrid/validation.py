"""pydantic's validation errors in our words, for every place that shows one (API, CLI, fleet files)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def message(error: Mapping[str, Any]) -> str:
    """One error's message (an item of ValidationError.errors()): a validator's own words, without
    the "Value error, " pydantic puts before them."""
    cause = error.get("ctx", {}).get("error") if error.get("type") == "value_error" else None
    return str(cause) if cause is not None else str(error["msg"])
