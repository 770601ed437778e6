"""How much of its completion allowance a request is expected to use, learned per client, robustly.

The KV budget books a request's expected completion (allowance x ratio) for its whole life. If one
learned ratio served everybody, any client could lower it for all: forty requests that stop after a few
tokens would make every other client's 4,000-token request look like a 200-token one, and the budget would
admit far more than the cache holds. So the ratio is learned per learner key (a tenant, or a class), only
from that key's own finished requests, and robustly:

* the estimate is a high quantile (default p90) of the key's recent samples, so a burst of short answers
  moves it only once they are most of what the key sends, and a single long answer is not averaged away;
* until a key has `min_samples` samples it uses the prior (default 1.0: the whole allowance);
* it never falls below `floor`;
* it is only an expectation for requests that say nothing: the budget never expects less than what a
  request declares it will generate (`min_tokens`, or its whole allowance under `ignore_eos`; see
  `KvBudget.expected_completion`), so a key cannot train its own forecast down to under-book those.

Pure and synchronous; memory is bounded by `max_keys` (least recently used keys are forgotten and start
again from the prior, which is the safe direction).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class CompletionLearner:
    window: int = 64
    quantile: float = 0.9
    min_samples: int = 8
    prior: float = 1.0
    floor: float = 0.1
    max_keys: int = 4096
    _samples: OrderedDict[str, deque[float]] = field(default_factory=OrderedDict, init=False)
    _cache: dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.floor <= 1.0:
            raise ValueError(f"floor must be in (0, 1], got {self.floor}")
        if not self.floor <= self.prior <= 1.0:
            raise ValueError(f"prior must be in [floor, 1], got {self.prior}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if self.window < 1 or self.min_samples < 1 or self.max_keys < 1:
            raise ValueError("window, min_samples and max_keys must be >= 1")

    def ratio(self, key: str) -> float:
        """Expected completion as a fraction of the allowance for a request of `key`."""
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        samples = self._samples.get(key)
        if samples is None or len(samples) < self.min_samples:
            value = self.prior
        else:
            ordered = sorted(samples)
            rank = min(len(ordered) - 1, max(0, math.ceil(self.quantile * len(ordered)) - 1))
            value = ordered[rank]
        value = min(1.0, max(self.floor, value))
        self._cache[key] = value
        return value

    def observe(self, key: str, ratio: float) -> None:
        """A finished request of `key` used `ratio` of its allowance."""
        sample = min(1.0, max(0.0, ratio))
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=self.window)
            while len(self._samples) > self.max_keys:
                forgotten, _ = self._samples.popitem(last=False)
                self._cache.pop(forgotten, None)
        else:
            self._samples.move_to_end(key)
        samples.append(sample)
        self._cache.pop(key, None)

    @property
    def keys(self) -> int:
        return len(self._samples)
