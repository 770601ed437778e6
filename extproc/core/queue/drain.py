"""How fast a class's queue has lately drained, so a newcomer whose line cannot reach it within its wait is
refused at once (with when it can) instead of held the whole wait for a `queue_timeout`.

The pace is measured, not forecast: grants per second of *backlogged* time, the time the class had anyone
waiting (`DrainPace.depth`). While the class waits, every admission of it goes through the queue, so that is
what its capacity gave it, wherever that capacity came from (other replicas' releases included); time with
nobody waiting tells nothing of it and is left out, so an idle hour does not make the queue look slow. The
time since the last grant counts, so a queue that stopped draining reads slower at once.

The judgement leans to waiting: a newcomer is refused only where, even at `OPTIMISM` times the pace measured,
its turn would not come within its wait behind the waiters certainly ahead of it (its own tenant's, in its
order: tenants take turns, so others' waiters may or may not go first). Each of those takes a grant where
its turn comes before its own wait ends, and otherwise leaves the line without one when its wait ends (a
waiter about to time out does not hold the newcomer back). Nothing is refused before `MIN_GRANTS` grants
were seen in the last `HORIZON_S`: from a cold start every request waits. Pure bookkeeping over an
injected clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

MIN_GRANTS = 8
"""Grants that must have been seen (within `HORIZON_S`) before a pace is trusted to refuse anyone."""
KEPT_GRANTS = 32
"""The latest grants the pace is measured over."""
HORIZON_S = 120.0
"""Grants older than this say nothing of the queue now (another load, another scale)."""
OPTIMISM = 2.0
"""How much faster than measured the line could drain before a newcomer is refused: capacity frees in bursts
(a wave of answers ending together), and a refusal the queue would have served is the costlier mistake."""


class DrainPace:
    """One class's grants against its backlogged time."""

    __slots__ = ("_backlogged_s", "_grants", "_since")

    def __init__(self) -> None:
        self._backlogged_s = 0.0  # backlogged time before `_since`
        self._since: float | None = None  # when the current backlog began (None: nobody waits)
        self._grants: deque[tuple[float, float]] = deque(maxlen=KEPT_GRANTS)  # (when, backlog clock then)

    def depth(self, now: float, waiting: int) -> None:
        """The class has `waiting` waiters as of `now`."""
        if waiting and self._since is None:
            self._since = now
        elif not waiting and self._since is not None:
            self._backlogged_s += now - self._since
            self._since = None

    def granted(self, now: float) -> None:
        """A waiter of the class was granted its capacity at `now`."""
        self._grants.append((now, self._clock(now)))

    def rate(self, now: float) -> float | None:
        """Grants per backlogged second since the oldest kept grant within `HORIZON_S`; None until
        `MIN_GRANTS` such grants were seen."""
        recent = [clock for when, clock in self._grants if when >= now - HORIZON_S]
        span = self._clock(now) - recent[0] if recent else 0.0
        if len(recent) < MIN_GRANTS or span <= 0:
            return None
        return (len(recent) - 1) / span

    def out_of_reach(self, now: float, ahead: Sequence[float], end: float) -> float | None:
        """Seconds until a newcomer whose wait ends at `end`, behind waiters whose waits end at `ahead` (in
        their order), is expected to get its turn at the measured pace (its retry-after), where even at
        `OPTIMISM` times that pace its turn would come after `end`; else None."""
        rate = self.rate(now)
        if rate is None or not ahead or now + _turn(now, ahead, OPTIMISM * rate) <= end:
            return None
        return _turn(now, ahead, rate)

    def _clock(self, now: float) -> float:
        """Backlogged seconds so far."""
        return self._backlogged_s + (now - self._since if self._since is not None else 0.0)


def _turn(now: float, ahead: Sequence[float], rate: float) -> float:
    """Seconds from `now` until the grant after those the waiters `ahead` (each leaving when its wait ends
    unless its grant comes first) take, grants coming `rate` a second."""
    served = 0
    for ends in ahead:
        if now + (served + 1) / rate <= ends:
            served += 1
    return (served + 1) / rate
