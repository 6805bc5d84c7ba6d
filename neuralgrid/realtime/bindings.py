"""postgres_changes subscriptions: what a channel asked for, and whether a change matches it."""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

EVENTS = ("*", "INSERT", "UPDATE", "DELETE")
OPERATORS = ("eq", "neq", "lt", "lte", "gt", "gte", "in")
_CONDITION = re.compile(r"^\s*(?P<column>[^=\s]+)\s*=\s*(?P<op>[a-z]+)\.(?P<value>.*)$", re.S)


class BindingError(ValueError):
    """Parameters Realtime cannot subscribe with (reported in a `system` message; the channel stays)."""


@dataclass(frozen=True, slots=True)
class Condition:
    column: str
    op: str
    value: str | tuple[str, ...]

    def holds(self, record: dict[str, Any]) -> bool:
        if self.column not in record:
            return False
        actual = record[self.column]
        if isinstance(self.value, tuple):
            return _text(actual) in self.value
        if self.op == "eq":
            return _text(actual) == self.value
        if self.op == "neq":
            return _text(actual) != self.value
        left, right = _comparable(actual, self.value)
        if left is None or right is None:
            return False
        outcome: bool = {"lt": left < right, "lte": left <= right, "gt": left > right, "gte": left >= right}[
            self.op
        ]
        return outcome


def _text(value: Any) -> str | None:
    """A JSON value as Postgres would print it, which is how filter values are written."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _comparable(actual: Any, wanted: str) -> tuple[Any, Any]:
    if isinstance(actual, int | float) and not isinstance(actual, bool):
        try:
            return actual, float(wanted)
        except ValueError:
            return None, None
    return _text(actual), wanted


def split_filter(text: str) -> list[str]:
    """Comma-separated conditions; commas inside in(...) belong to the list."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(0, depth - 1)
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p for p in parts if p.strip()]


def parse_filter(text: str | None) -> tuple[Condition, ...]:
    if text is None or not text.strip():
        return ()
    conditions = []
    for part in split_filter(text):
        match = _CONDITION.match(part)
        if not match or match["op"] not in OPERATORS:
            raise BindingError(
                f"invalid filter {part.strip()!r}: use column=op.value with op one of {OPERATORS}"
            )
        value: str | tuple[str, ...] = match["value"]
        if match["op"] == "in":
            inner = match["value"].strip()
            if not (inner.startswith("(") and inner.endswith(")")):
                raise BindingError(f"invalid filter {part.strip()!r}: in takes a list, e.g. id=in.(1,2)")
            value = tuple(v.strip().strip('"') for v in inner[1:-1].split(","))
        conditions.append(Condition(match["column"], match["op"], value))
    return tuple(conditions)


@dataclass(frozen=True, slots=True)
class Binding:
    id: int
    event: str
    schema: str
    table: str
    filter: str | None
    conditions: tuple[Condition, ...]

    def reply(self) -> dict[str, Any]:
        echoed: dict[str, Any] = {
            "id": self.id,
            "event": self.event,
            "schema": self.schema,
            "table": self.table,
        }
        if self.filter is not None:
            echoed["filter"] = self.filter
        return echoed

    def matches(self, schema: str, table: str, kind: str, record: dict[str, Any] | None) -> bool:
        if (
            self.event.upper() not in ("*", kind)
            or self.schema not in ("*", schema)
            or self.table not in ("*", table)
        ):
            return False
        if kind == "DELETE" or record is None:  # as on Supabase, deletes cannot be filtered
            return True
        return all(c.holds(record) for c in self.conditions)


def parse_binding(raw: Any) -> Binding:
    if not isinstance(raw, dict):
        raise BindingError("each postgres_changes entry is an object")
    event = str(raw.get("event") or "*").upper()
    schema, table, text = raw.get("schema"), raw.get("table", "*"), raw.get("filter")
    if event not in EVENTS:
        raise BindingError(f"invalid event {event!r}: use one of {EVENTS}")
    if not isinstance(schema, str) or not schema or not isinstance(table, str) or not table:
        raise BindingError("postgres_changes needs a schema and a table (or *)")
    if text is not None and not isinstance(text, str):
        raise BindingError("filter must be a string")
    conditions = parse_filter(text)
    # The same parameters always get the same id, as on Supabase (a hash of them).
    key = json.dumps([event, schema, table, text]).encode()
    return Binding(zlib.crc32(key) & 0x7FFFFFFF, raw.get("event") or "*", schema, table, text, conditions)
