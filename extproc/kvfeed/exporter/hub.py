"""Fan-out of samples to any number of Watch subscribers without letting a slow one hurt the rest.

Each subscriber owns a dict of pending samples keyed by (node, endpoint, model): publishing overwrites the
entry, so a subscriber that reads slowly skips intermediate samples instead of queueing them. Memory per
subscriber is bounded by the number of endpoints x models, and `publish` never awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from extproc.kvfeed.sample import FeedSample, SampleKey


class Subscription:
    """Pending samples of one subscriber; iterate with `next_batch()`."""

    def __init__(self, hub: SampleHub, models: frozenset[str]) -> None:
        self._hub = hub
        self.models = models
        self._pending: dict[SampleKey, FeedSample] = {}
        self._event = asyncio.Event()
        self.closed = False

    def wants(self, sample: FeedSample) -> bool:
        return not self.models or sample.model in self.models

    def offer(self, sample: FeedSample) -> None:
        if self.wants(sample):
            self._pending[sample.key] = sample
            self._event.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def next_batch(self) -> list[FeedSample]:
        """Everything newer than what was last returned; waits while there is nothing.

        Returns an empty list once the subscription is closed (the stream should then end).
        """
        while not self._pending:
            if self.closed:
                return []
            self._event.clear()
            await self._event.wait()
        batch = list(self._pending.values())
        self._pending.clear()
        return batch

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._hub._subs.discard(self)
            self._event.set()


class SampleHub:
    """Newest sample per key plus the live subscriptions."""

    def __init__(self) -> None:
        self._latest: dict[SampleKey, FeedSample] = {}
        self._subs: set[Subscription] = set()

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def latest(self) -> list[FeedSample]:
        return list(self._latest.values())

    def publish(self, samples: Iterable[FeedSample]) -> None:
        for sample in samples:
            self._latest[sample.key] = sample
            for sub in self._subs:
                sub.offer(sample)

    def forget_endpoint(self, endpoint: str) -> None:
        """Drop a target that discovery removed, so new subscribers are not told about it."""
        for key in [k for k in self._latest if k[1] == endpoint]:
            del self._latest[key]

    def close_all(self) -> None:
        """End every stream (shutdown): subscribers see a clean end and reconnect elsewhere or later."""
        for sub in list(self._subs):
            sub._pending.clear()
            sub.close()

    def subscribe(self, models: Iterable[str] = ()) -> Subscription:
        """A new subscription, primed with the newest sample of every matching key."""
        sub = Subscription(self, frozenset(models))
        for sample in self._latest.values():
            sub.offer(sample)
        self._subs.add(sub)
        return sub
