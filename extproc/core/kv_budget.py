"""KV-token budget for one model pool: admit requests only while their expected KV footprint fits.

The KV gauge of an inference server reacts after the fact: vLLM allocates blocks only for the tokens it
schedules now, so KV grows during decode and overflows as preemptions long after admission. With the pool's
capacity in tokens (from `vllm:cache_config_info` block_size x num_gpu_blocks, SGLang
`max_total_num_tokens`, TRT-LLM block metrics) the sidecar can instead track the footprint it has
admitted itself and refuse a request whose expected footprint would push the pool past
`target_utilization` of capacity.

Footprint of a lease = prompt + expected completion, never less than prompt + tokens streamed so far.
The expected completion is the caller's completion allowance (usually `max_tokens`, or the remaining
context) times a learned ratio (`CompletionLearner`): per learner key (the request's tenant), a high
quantile of `actual_completion / allowance` over that key's finished requests, with a floor. It starts at
1.0 (assume the whole allowance is used); only finished requests feed it (cancelled ones,
`actual_completion=None`, would bias it low), and no client's requests move another client's estimate.

Pure and synchronous (no asyncio, no clock): the limiter calls it under its own locking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.core.completion_learner import CompletionLearner


@dataclass(slots=True)
class _Lease:
    prompt: int
    allowance: int
    expected_completion: int
    learner_key: str = ""
    streamed: int = 0

    @property
    def footprint(self) -> int:
        return self.prompt + max(self.expected_completion, self.streamed)


class KvBudget:
    """Admitted KV demand of one pool against its capacity in tokens.

    `capacity_share` is the fraction of the pool this sidecar may fill, e.g. 1/replicas when several
    sidecar replicas admit into the same pool without sharing state.
    """

    def __init__(
        self,
        capacity_tokens: int | None = None,
        *,
        target_utilization: float = 0.9,
        capacity_share: float = 1.0,
        initial_completion_ratio: float = 1.0,
        min_completion_ratio: float = 0.1,
        learner: CompletionLearner | None = None,
    ) -> None:
        if not 0.0 < target_utilization <= 1.0:
            raise ValueError(f"kv_budget.target_utilization: must be in (0, 1], got {target_utilization}")
        if not 0.0 < capacity_share <= 1.0:
            raise ValueError(f"kv_budget.capacity_share: must be in (0, 1], got {capacity_share}")
        if not 0.0 < min_completion_ratio <= 1.0:
            raise ValueError(f"kv_budget.min_completion_ratio: must be in (0, 1], got {min_completion_ratio}")
        if not min_completion_ratio <= initial_completion_ratio <= 1.0:
            raise ValueError(
                "kv_budget.initial_completion_ratio: must be in [min_completion_ratio, 1], "
                f"got {initial_completion_ratio}"
            )
        self._target = target_utilization
        self._share = capacity_share
        self.learner = learner or CompletionLearner(
            prior=initial_completion_ratio, floor=min_completion_ratio
        )
        self._capacity: int | None = None
        self._leases: dict[str, _Lease] = {}
        self._demand = 0
        self.set_capacity(capacity_tokens)

    # -- read-only views ---------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int | None:
        """Pool capacity in tokens, None while unknown (then every request fits)."""
        return self._capacity

    @property
    def budget_tokens(self) -> int | None:
        """Tokens this sidecar may have admitted: capacity x target_utilization x capacity_share."""
        if self._capacity is None:
            return None
        return int(self._capacity * self._target * self._share)

    @property
    def demand_tokens(self) -> int:
        """Sum of the footprints of live leases."""
        return self._demand

    @property
    def headroom_tokens(self) -> int | None:
        """Budget minus demand; negative when over budget (capacity shrank or streams outgrew estimates)."""
        budget = self.budget_tokens
        return None if budget is None else budget - self._demand

    @property
    def completion_ratio(self) -> float:
        """Learned expected completion as a fraction of the allowance, for requests without a learner key."""
        return self.learner.ratio("")

    @property
    def leases(self) -> int:
        return len(self._leases)

    # -- updates -----------------------------------------------------------------------------------------

    def set_capacity(self, capacity_tokens: int | None) -> None:
        """Update capacity from the feed; 0 or negative means unknown (servers report 0 when unset)."""
        if capacity_tokens is None or capacity_tokens <= 0:
            self._capacity = None
        else:
            self._capacity = int(capacity_tokens)

    def expected_completion(self, allowance: int, learner_key: str = "") -> int:
        """Completion tokens a request of `learner_key` with this allowance is expected to produce."""
        allowance = max(0, int(allowance))
        return min(allowance, math.ceil(allowance * self.learner.ratio(learner_key)))

    def would_fit(
        self, prompt_tokens: int, max_completion: int, learner_key: str = ""
    ) -> tuple[bool, int | None]:
        """Whether a request fits, and the headroom before it. Capacity unknown: (True, None).

        An empty pool always admits, so a request larger than the budget is not starved forever (the
        server's own length validation bounds it).
        """
        headroom = self.headroom_tokens
        if headroom is None:
            return True, None
        need = max(0, int(prompt_tokens)) + self.expected_completion(max_completion, learner_key)
        if not self._leases:
            return True, headroom
        return need <= headroom, headroom

    def admit(
        self, lease_id: str, prompt_tokens: int, expected_completion: int, learner_key: str = ""
    ) -> int:
        """Record an admitted request; `expected_completion` is its completion allowance (max_tokens).

        Returns the footprint charged. A lease id already present is a caller bug: ValueError.
        """
        if lease_id in self._leases:
            raise ValueError(f"kv_budget: lease {lease_id!r} already admitted")
        allowance = max(0, int(expected_completion))
        lease = _Lease(
            prompt=max(0, int(prompt_tokens)),
            allowance=allowance,
            expected_completion=self.expected_completion(allowance, learner_key),
            learner_key=learner_key,
        )
        self._leases[lease_id] = lease
        self._demand += lease.footprint
        return lease.footprint

    def progress(self, lease_id: str, streamed_tokens: int) -> bool:
        """Cumulative completion tokens streamed so far; the footprint never drops below prompt+streamed.

        Returns False for an unknown (already released) lease, which is harmless.
        """
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        before = lease.footprint
        lease.streamed = max(lease.streamed, int(streamed_tokens))
        self._demand += lease.footprint - before
        return True

    def release(self, lease_id: str, actual_completion: int | None = None) -> bool:
        """Drop a lease; a known `actual_completion` feeds the learned ratio. Double release is a no-op."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._demand -= lease.footprint
        if actual_completion is not None and lease.allowance > 0:
            self.learner.observe(lease.learner_key, actual_completion / lease.allowance)
        return True
