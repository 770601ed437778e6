"""When an engine's counters were read, on this sidecar's clock: what a charge tally's point is stamped at.

A sample's values are the engine's when its exporter read the metrics page (`FeedSample.sample_time`, the
exporter's wall clock then), not when the sample reached the sidecar. On the real-engine tier's two busy
cores samples came 0-4.6 s after their reading, often two at once (an exporter's interval of 2 s), while a
stream of a flood lasted half a second: stamped on arrival, the tokens a stream generated before its client
left fell in an interval after its stop, and its neighbours' shares took them (a clean-clone CI run charged
a flood of streams through two gateways 1.175 times what vLLM counted with every abort in time; eight such
floods in a row here, 2 within 5 % stamped on arrival, 7 stamped at their reading).

The exporter's wall clock is not the sidecar's: the two differ by their skew (milliseconds under NTP, but
nothing bounds it) besides the delivery delay. So the delay of one sample is its offset (arrival wall time
less `sample_time`) over the least offset of the endpoint's last `WINDOW` samples, the one taken for
delivered at once: a constant skew cancels, and a clock stepped either way is relearned, forward at once,
back within the window. The delay is capped at `MAX_DELAY_S`. Pure: the caller passes both clocks' readings.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Set

WINDOW = 120
"""Samples of one endpoint whose least offset is taken for a timely delivery: two minutes at the shipped
1 s interval, four at the engine tier's 2 s; a saturated host delivered in time at least every few
samples there."""
MAX_DELAY_S = 30.0
"""The most a sample's reading is taken to precede its arrival: past it, a clock stepped since the window's
least offset is likelier than a sample that old (a feed that slow is stale anyway: `stale_after`)."""


class _Offsets:
    """The offsets of one endpoint's last `WINDOW` samples, and their least, kept by a monotonic deque."""

    __slots__ = ("_count", "_least")

    def __init__(self) -> None:
        self._count = 0
        self._least: deque[tuple[int, float]] = deque()  # (index, offset), offsets increasing

    def add(self, offset: float) -> float:
        """One sample's offset; the least of the window it closes."""
        least, index = self._least, self._count
        self._count += 1
        while least and least[-1][1] >= offset:
            least.pop()
        least.append((index, offset))
        while least[0][0] <= index - WINDOW:
            least.popleft()
        return least[0][1]


class ReadTimes:
    """Each endpoint's samples' reading times on the sidecar's monotonic clock (see the module docstring)."""

    def __init__(self) -> None:
        self._offsets: dict[Hashable, _Offsets] = {}

    def read_at(self, endpoint: Hashable, sample_time: float, received: float, received_wall: float) -> float:
        """When the sample of `endpoint` read at `sample_time` (its exporter's wall clock) was read, on the
        clock that reads `received` at its arrival, when the sidecar's wall clock read `received_wall`."""
        offsets = self._offsets.get(endpoint)
        if offsets is None:
            offsets = self._offsets[endpoint] = _Offsets()
        offset = received_wall - sample_time
        delay = offset - offsets.add(offset)
        return received - min(delay, MAX_DELAY_S)

    def keep(self, endpoints: Set[Hashable]) -> None:
        """Forget every endpoint not in `endpoints` (the feed forgot it)."""
        for endpoint in [e for e in self._offsets if e not in endpoints]:
            del self._offsets[endpoint]
