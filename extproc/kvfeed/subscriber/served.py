"""The names the engines serve, each mapped to the pool (base model) whose limits and KV budget it uses.

Fed by every up sample: its pool (`model`) is served under its own name, and the names its engine's model
list gives for it (`served_names`: `--served-model-name` aliases, LoRA adapters) are served in that pool.
A name stays known until no sample has confirmed it for `forget_after` seconds, so that a scrape that
fails (a down sample carries no names) does not turn an engine's aliases into unknown names for a moment.
Bounded by the feed: endpoints x models x `MAX_SERVED_NAMES`.

A name two pools claim goes to the first pool in sorted order, except that a pool's own name is always its
own pool.
"""

from __future__ import annotations

from extproc.kvfeed.sample import FeedSample, SampleKey


class ServedNames:
    """Name to pool, from the feed; pure (the caller passes `now`)."""

    def __init__(self, forget_after: float) -> None:
        self._forget_after = forget_after
        self._seen: dict[SampleKey, tuple[tuple[str, ...], float]] = {}
        self._pools: dict[str, str] | None = None  # cached map, rebuilt after a change

    def observe(self, sample: FeedSample, now: float) -> None:
        if not sample.up:
            return
        names = sample.served_names
        previous = self._seen.get(sample.key)
        if previous is None or previous[0] != names:
            self._pools = None
        self._seen[sample.key] = (names, now)

    def prune(self, now: float) -> None:
        gone = [key for key, (_, seen) in self._seen.items() if now - seen > self._forget_after]
        for key in gone:
            del self._seen[key]
        if gone:
            self._pools = None

    @property
    def listing(self) -> bool:
        """Whether any engine in the feed lists its names (only then is an unlisted name unserved)."""
        return any(names for names, _ in self._seen.values())

    def pool_of(self, name: str) -> str | None:
        """The pool `name` is served in, None when no engine in the feed serves it."""
        return self._map().get(name)

    def _map(self) -> dict[str, str]:
        if self._pools is None:
            pools: dict[str, str] = {}
            for (_, _, pool), (names, _) in sorted(self._seen.items(), key=lambda item: item[0][2]):
                for name in names:
                    pools.setdefault(name, pool)
            for _, _, pool in self._seen:
                pools[pool] = pool
            self._pools = pools
        return self._pools
