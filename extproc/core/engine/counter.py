"""One counter of a pool's engines (a Prometheus counter each endpoint publishes), summed as its growth: an
endpoint's first reading, and its first after its counter went back (a restart) or after it left the feed, is
a baseline, never growth, so an endpoint joining with a large count adds nothing. What the charge tally reads
the engines' generated tokens from (`EngineTally`), and the KV budget their prefilled prompt tokens
(`FeedbackLoop.prompted`). Pure: no clock, no I/O."""

from __future__ import annotations

from collections.abc import Set


class PoolCounter:
    """The growth of one counter over a pool's endpoints, since the first reading of each."""

    __slots__ = ("_endpoints", "total")

    def __init__(self) -> None:
        self._endpoints: dict[str, float] = {}  # endpoint -> its last reading
        self.total = 0.0

    def observe(self, endpoint: str, value: float) -> None:
        before = self._endpoints.get(endpoint)
        self._endpoints[endpoint] = value
        if before is not None and value >= before:
            self.total += value - before

    def forget(self, endpoint: str) -> None:
        """The endpoint's reading is missing (down, or it publishes none): its next one is a baseline."""
        self._endpoints.pop(endpoint, None)

    def keep(self, endpoints: Set[str]) -> None:
        """Forget every endpoint not in `endpoints` (the feed forgot it)."""
        for endpoint in [e for e in self._endpoints if e not in endpoints]:
            del self._endpoints[endpoint]

    @property
    def known(self) -> bool:
        """Whether any endpoint's reading is held (else the total says nothing of now)."""
        return bool(self._endpoints)
