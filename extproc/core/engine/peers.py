"""The other gateway replicas' runs of a pool, as a charge tally reads them from the shared store.

Beside other replicas, each with a tally of its own, a pool's running count holds their requests too: taken
for unknown ones, every replica took the whole growth for its own (two gateways charged a flood 2.00 times
what vLLM counted). So each replica publishes its runs' figures through the store (`RunFigures`, beside its
KV figures: `KvBoard.exchange_runs`), and each tally keeps the others' over time (`PeerRuns`): their
sequence-seconds count beside its own runs in each interval, their runs in flight and stopped-but-open in
each reading's room (`run_on`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.core.engine.series import Series

PEER_STALE_S = 3.0
"""How long past the last reading of the other replicas' runs their figures are carried forward (their
sequence-seconds growing at the sequences they then ran): the store publishes them every
`kv_fleet.PUBLISH_EVERY_S` while a pool changes and at each feed sample, and a budget trusts the last answer
as long (`kv_fleet.PEERS_FRESH_S`); past it, a store gone says nothing of them."""


@dataclass(frozen=True, slots=True)
class RunFigures:
    """One replica's runs of a pool as the other replicas' tallies need them: `seconds`, the sequence-seconds
    they ran in flight since its tally began (a counter: only its growth between two readings means
    anything); `running`, the sequences in flight now; `shown`, those and the sequences of its stopped runs
    the engine may still run (`run_on.RunOn.shown`), what a reading's running count may still hold of
    them."""

    seconds: float = 0.0
    running: float = 0.0
    shown: float = 0.0


class PeerRuns:
    """The other replicas' runs of one pool over time, read from the store: their figures summed at each
    reading, the sequence-seconds as a counter (each replica's own a baseline of its first reading, one gone
    and back a new one, as an endpoint's generation counter is). Bounded as the tally's points are
    (`series.Series`)."""

    def __init__(self, max_points: int, min_spacing_s: float) -> None:
        self._last: dict[str, float] = {}  # replica -> its seconds last read
        self._seconds = 0.0
        self._readings: Series[RunFigures] = Series(max_points, min_spacing_s)

    def observe(self, replicas: Mapping[str, RunFigures], at: float) -> None:
        """The figures of every other live replica, read at `at`; a replica not among them is gone."""
        for name, figures in replicas.items():
            before = self._last.get(name)
            if before is not None and figures.seconds >= before:
                self._seconds += figures.seconds - before
        self._last = {name: figures.seconds for name, figures in replicas.items()}
        running = sum(f.running for f in replicas.values())
        shown = sum(f.shown for f in replicas.values())
        self._readings.add(at, RunFigures(self._seconds, running, shown))

    def seconds_at(self, at: float) -> float:
        """Their sequence-seconds by `at`: between two readings, along the line between them; before the
        first, its value; past the last, grown at the sequences then running, for `PEER_STALE_S` at most."""
        readings = self._readings
        times, items = readings.times, readings.items
        if not times:
            return 0.0
        i = readings.at_or_before(at) + 1
        if i == 0:
            return items[0].seconds
        t0, s0 = times[i - 1], items[i - 1].seconds
        if i == len(times):
            return s0 + items[i - 1].running * min(at - t0, PEER_STALE_S)
        t1, s1 = times[i], items[i].seconds
        return s0 + (s1 - s0) * (at - t0) / (t1 - t0) if t1 > t0 else s1

    def at(self, at: float) -> RunFigures:
        """Their figures as the last reading at or before `at` summed them; none where that reading is over
        `PEER_STALE_S` older (or none is)."""
        readings = self._readings
        i = readings.at_or_before(at)
        if i < 0 or at - readings.times[i] > PEER_STALE_S:
            return RunFigures()
        return readings.items[i]

    def read_at(self, at: float) -> float | None:
        """When the reading `at` gives was read; None where it gives none."""
        readings = self._readings
        i = readings.at_or_before(at)
        if i < 0 or at - readings.times[i] > PEER_STALE_S:
            return None
        return readings.times[i]

    def shown_at(self, at: float) -> float:
        """Their sequences that may be running at `at` (`RunFigures.shown`, as `at` gives it)."""
        return self.at(at).shown
