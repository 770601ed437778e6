"""Which admitted requests the engine has finished, confirmed before anything irreversible follows.

The KV budget infers at each feed sample which of its leases the engine has finished while their clients
still read (`EngineCorrection._engine_finished`: by the engine's running count, taken from the streams stalled
longest, then from those nobody sees). Booking such a lease nothing until the next sample is cheap to get
wrong: the next sample books it again. Giving its concurrency slot back is not: a slot freed for a stream
that then resumes lets one more request onto the engine than its limit. So a lease is confirmed finished
only once it has been found finished in `CONFIRM_SAMPLES` consecutive samples spanning at least the
budget's `settle_after` (2 s or more): a stream stalled that long behind a full proxy buffer with the
engine's count short of it, sample after sample, is one its engine has let go. A sample that does not find
it starts it over.

Whoever holds a lease asks to be told (`watch`); each is told at most once. Memory: one entry per lease
watched (its callback) and one per watched lease found finished at the last sample; a lease is forgotten
when it is released.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

CONFIRM_SAMPLES = 2
"""Consecutive feed samples a lease must be found finished in before it is confirmed."""


class EngineDone:
    """The leases watched for their engine's end, and how long each has been found finished."""

    __slots__ = ("_since", "_watching")

    def __init__(self) -> None:
        self._watching: dict[str, Callable[[], None]] = {}
        self._since: dict[str, tuple[float, int]] = {}  # found finished since (when, samples), consecutively

    def watch(self, lease_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` once `lease_id` is confirmed finished (replaces an earlier one)."""
        self._watching[lease_id] = callback

    def forget(self, lease_id: str) -> None:
        """The lease is released: nothing more to tell."""
        self._watching.pop(lease_id, None)
        self._since.pop(lease_id, None)

    @property
    def watched(self) -> int:
        return len(self._watching)

    def sample(self, finished: Collection[str], now: float, hold_s: float) -> list[Callable[[], None]]:
        """A feed sample found `finished` done at `now`: the callbacks of the leases it confirms (found in
        `CONFIRM_SAMPLES` samples in a row spanning `hold_s` or more), each handed out once, for the caller
        to run once its own state is consistent."""
        since: dict[str, tuple[float, int]] = {}
        confirmed: list[str] = []
        for lease_id in finished:
            if lease_id not in self._watching:
                continue
            first, samples = self._since.get(lease_id, (now, 0))
            samples += 1
            if samples >= CONFIRM_SAMPLES and now - first >= hold_s:
                confirmed.append(lease_id)
            else:
                since[lease_id] = (first, samples)
        self._since = since
        return [self._watching.pop(lease_id) for lease_id in confirmed]
