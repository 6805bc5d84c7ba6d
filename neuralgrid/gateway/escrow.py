"""Budgets spent from escrow: money renew_escrows() holds on a key for this gateway, from which the
gateway takes each leased request's hold without asking Postgres.

The escrow is held inside the key's budget (api_keys.reserved_usd), so every placement anywhere sees
it as spent-for-now; record_jobs() moves each job's hold from the escrow to the job, whose end charges
what it really cost, as before. A key whose escrow cannot cover a request's hold is served the old
way, one round trip, where its budget is checked (and the answer capped) in SQL.

The hold is priced as private.budget_hold() prices it (tests/gateway/test_escrow.py holds the two to
the same figures): about four bytes a prompt token, the answer at its full length, at the catalog's
per-token prices.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from decimal import Decimal
from uuid import UUID

from neuralgrid.db import queries as q

IDLE_S = 10.0  # a key not served from escrow in this long gives its escrow back
ROUND = Decimal("0.00000001")  # jobs.reserved_usd's scale


def budget_hold(prices: q.ModelKind | None, prompt_bytes: int, max_output_tokens: int) -> Decimal:
    """What a request holds on its key's budget until it ends (private.budget_hold())."""
    if prices is None:
        return Decimal(0)
    hold = (
        Decimal(prompt_bytes) / 4 * (prices.input_usd_per_mtok or 0)
        + max_output_tokens * (prices.output_usd_per_mtok or 0)
    ) / Decimal(1_000_000)
    return hold.quantize(ROUND)


class Escrows:
    """The escrow this gateway holds per key, and what its requests have taken of it since."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._usd: dict[UUID, Decimal] = {}  # as the last renewal left it, less holds written since
        self._taken: dict[UUID, Decimal] = {}  # holds of jobs whose start is not yet written
        self._wanted: dict[UUID, tuple[float, Decimal]] = {}  # when last asked, the largest hold
        self._held = False  # Postgres may hold an escrow here (due(), renewed())

    def want(self, key_id: UUID, hold: Decimal) -> None:
        """The key is asked for now, with a hold this large: the next renewals keep it an escrow."""
        _, largest = self._wanted.get(key_id, (0.0, Decimal(0)))
        self._wanted[key_id] = (self.clock(), max(largest, hold))

    def take(self, key_id: UUID, hold: Decimal) -> bool:
        """Take a hold from the key's escrow; False when it cannot cover it (nor hold it at all)."""
        self.want(key_id, hold)
        if not self.covers(key_id, hold):
            return False
        self._taken[key_id] = self._taken.get(key_id, Decimal(0)) + hold
        return True

    def covers(self, key_id: UUID, hold: Decimal) -> bool:
        """Whether the key's escrow could cover the hold now (take() would), taking nothing."""
        escrow = self._usd.get(key_id)
        return escrow is not None and escrow > 0 and escrow - self._taken.get(key_id, Decimal(0)) >= hold

    def give_back(self, key_id: UUID, hold: Decimal) -> None:
        """A hold taken for a job that was never dispatched."""
        self._taken[key_id] = self._taken.get(key_id, Decimal(0)) - hold

    def written(self, key_id: UUID, hold: Decimal) -> None:
        """A job's start is in Postgres: its hold left the escrow there, and leaves it here."""
        self._taken[key_id] = self._taken.get(key_id, Decimal(0)) - hold
        if key_id in self._usd:
            self._usd[key_id] -= hold

    def wants(self) -> list[dict[str, object]]:
        """renew_escrows()'s keys: each key asked for lately, wanting room for a few of its largest
        holds (SQL caps it at platform_settings.escrow_usd and at what the key has free)."""
        now = self.clock()
        for key_id in [k for k, (at, _) in self._wanted.items() if now - at >= IDLE_S]:
            del self._wanted[key_id]
        return [
            {"key": str(key_id), "want_usd": str(max(largest * 8, Decimal("0.01")))}
            for key_id, (_, largest) in sorted(self._wanted.items(), key=lambda item: str(item[0]))
        ]

    def due(self) -> list[dict[str, object]] | None:
        """wants(), or None when no renewal is needed: none wanted, and none held since a renewal
        wanting none came back (a gateway whose keys have no budget sends none: each holds the
        journal's lock a round trip)."""
        wants = self.wants()
        if not wants and not self._held:
            return None
        self._held = True  # until its answer comes back: Postgres may hold what it asks for
        return wants

    def renewed(self, rows: Iterable[q.EscrowRow]) -> None:
        self._usd = {row.api_key_id: row.usd for row in rows if row.usd is not None}
        self._held = bool(self._usd)
