"""The named statement: what every statement of the platform is, whichever domain it is of."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from psycopg.rows import BaseRowFactory

__all__ = ["Query"]


R = TypeVar("R", covariant=True)


@dataclass(frozen=True)
class Query(Generic[R]):
    """A named statement, the row factory that types its rows, and the parameter a NotFound from it
    is about (for the API's error)."""

    name: str
    sql: str
    rows: BaseRowFactory[R]
    subject: str | None = None
