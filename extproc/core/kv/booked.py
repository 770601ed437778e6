"""The KV budget's booking (`KvBudget`): what one pool's leases are booked for at a moment, the sum each
decision compares with the budget. `lifetime` books each lease's whole footprint from admission to release;
`forecast` books the highest total their trajectories reach from now on (`forecast_peaks`), corrected by the
engine's last sample (`EngineCorrection`: KV the leases do not explain, leases the engine has finished), and
only while that sample is fresh: without it, forecasts book as `lifetime` does.

The sum a decision computed with its candidate is kept for the admission of that same request right after
it (`would_fit` then `admit`), so admitting does not compute it again; any change to the leases forgets it.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import enum
import math

from extproc.core.kv.forecast import Steps, forecast_peaks
from extproc.core.kv.lease import Lease
from extproc.core.kv.ledger import Ledger
from extproc.core.kv.pacing import BudgetPace
from extproc.core.kv.prefix import PromptChunks

Fit = tuple[float | None, int, int, int, str, int, PromptChunks]
"""A decision's request as `Lease.fit_key` names it."""


class BookingMode(enum.StrEnum):
    """How a lease is charged against the budget (see the module docstring of `budget.py`)."""

    LIFETIME = "lifetime"
    FORECAST = "forecast"


class Booker:
    """The tokens one pool's leases are booked for, and the engine's corrections the forecast takes."""

    def __init__(self, ledger: Ledger, pace: BudgetPace, mode: BookingMode) -> None:
        self._ledger = ledger
        self._pace = pace
        self.mode = BookingMode(mode)
        self.booked = 0  # what the last decision or sample compared with the budget
        self.fresh_until: float | None = None  # the last engine sample's trust runs out then
        self.unexplained = 0.0  # the engine's correction at the last sample (`EngineCorrection`)
        self.finished: frozenset[str] = frozenset()  # leases the engine finished, at the last sample
        self._last_fit: Fit | None = None
        self._booked_with = 0

    @property
    def booked_with(self) -> int:
        """The last decision's sum with its candidate: what a refused request was compared with."""
        return self._booked_with

    def forecasting(self, now: float | None) -> bool:
        """Whether decisions at `now` use the forecast (booking `forecast` and a fresh engine sample)."""
        return (
            self.mode is BookingMode.FORECAST
            and now is not None
            and self.fresh_until is not None
            and now <= self.fresh_until
        )

    def demand_tokens(self) -> int:
        """The leases' lifetime footprints, less those the engine has finished."""
        leases = self._ledger.leases
        finished = sum(leases[i].footprint for i in self.finished if i in leases)
        return self._ledger.demand - finished

    def engine_finished(self) -> int:
        """Leases the engine has finished while their clients still read, at the last sample."""
        return sum(1 for i in self.finished if i in self._ledger.leases)

    def trajectories(self, now: float) -> list[Steps]:
        """Every lease's trajectory from `now` on (in pieces: `Lease.pieces`), but those the engine has
        finished."""
        rate, delay = self._pace.forecast()
        finished = self.finished
        return [
            piece
            for lease_id, lease in self._ledger.leases.items()
            if lease_id not in finished
            for piece in lease.pieces(now, rate, delay)
        ]

    def book(self, now: float | None, extra: Lease | None = None) -> tuple[int, int]:
        """Tokens booked at `now`, without and with `extra`: the forecast peak while forecasting (plus the
        unexplained engine KV), else the lifetime demand."""
        demand = self._ledger.demand
        if not self.forecasting(now):
            return demand, demand + (extra.footprint if extra is not None else 0)
        assert now is not None
        rate, delay = self._pace.forecast()
        added = extra.pieces(now, rate, delay) if extra is not None else ()
        alone, together = forecast_peaks(self.trajectories(now), added)
        return math.ceil(alone + self.unexplained), math.ceil(together + self.unexplained)

    def own_booking(self, now: float) -> int:
        """What this replica's leases are booked for without the engine's correction (the pool's own, which
        every replica computes alike): the figure the other replicas read (`replica_share`)."""
        if self.forecasting(now):
            return math.ceil(forecast_peaks(self.trajectories(now))[0])
        return self._ledger.demand

    def decided(self, fit: Fit, booked: int, booked_with: int) -> None:
        """A decision on the request `fit` booked `booked` without it and `booked_with` with it."""
        self.booked = booked
        self._last_fit = fit
        self._booked_with = booked_with

    def admitted(self, fit: Fit, now: float | None) -> None:
        """The request `fit`, just added to the ledger: booked as its decision computed where it is the one
        just decided on, else booked again."""
        booked = self._booked_with if fit == self._last_fit else None
        self._last_fit = None
        self.booked = booked if booked is not None else self.book(now)[0]

    def changed(self) -> None:
        """The leases or their bookings changed since the last decision: its sum is not an admission's."""
        self._last_fit = None

    def released(self, lease: Lease) -> None:
        """`lease`, just dropped from the ledger: what the engine took off may have been its over-booking,
        now gone with it: taken off once, not twice, until the next sample says again."""
        self._last_fit = None
        if self.unexplained < 0:
            self.unexplained = min(0.0, self.unexplained + lease.footprint)
        if not self._ledger.leases:
            self.booked = 0
