"""A slot refusal's `retry-after` from the leases this replica holds open on the refused key.

The store's estimate is an average; the open requests say better when a slot frees: each one's expected
length (the KV budget's learned completion, else its whole allowance), what it has streamed, and its pool's
decode rate (`core/queue/slot_eta.py`). Leases held by other replicas of a shared store are not seen
here, so the store's estimate stays when this replica holds none on the key.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from extproc.core.limiter.limiter import Reason, Rejection
from extproc.core.queue.slot_eta import MIN_REMAINING_S, OpenLease, RetryHints, remaining_times

ETA_CACHE_S = 0.05
"""How long a key's open-lease remaining times are reused for retry hints."""


@dataclass
class SlotHints:
    """Retry hints for slot refusals, from one pass over the open leases per key and `ETA_CACHE_S`."""

    hints: RetryHints = field(default_factory=RetryHints)
    _etas: dict[str, tuple[float, list[float]]] = field(default_factory=dict)

    def apply(
        self, rejection: Rejection, now: float, open_leases: Callable[[str], list[OpenLease]]
    ) -> Rejection:
        """`rejection` with the hint in place of the store's estimate (unchanged where there is none)."""
        if rejection.reason is not Reason.CONCURRENCY:
            return rejection
        hint = self.hint(rejection.key, now, open_leases)
        if hint is None:
            return rejection
        return replace(rejection, retry_after_s=hint, status=replace(rejection.status, reset_requests_s=hint))

    def hint(self, key: str, now: float, open_leases: Callable[[str], list[OpenLease]]) -> float | None:
        """When a slot on `key` is expected to free for the next client refused there, from the leases open
        here; None when this replica holds none. Also the `retry-after` of an engine's own refusal: its
        queue frees when the requests it runs end."""
        cached = self._etas.get(key)
        if cached is None or now - cached[0] > ETA_CACHE_S:
            # One pass over the open requests per key and 50 ms, however many refusals a flood brings.
            cached = self._etas[key] = (now, remaining_times(open_leases(key)))
            if len(self._etas) > 1024:
                self._etas = {key: cached}
        etas = [max(MIN_REMAINING_S, eta - (now - cached[0])) for eta in cached[1]]
        return self.hints.hint(key, etas, now)

    def starts(
        self,
        rejection: Rejection,
        open_leases: Callable[[str], list[OpenLease]],
        runs: Sequence[float],
        held: Sequence[float] = (),
    ) -> list[float] | None:
        """When each of a line of requests refused so is expected to get its capacity, in the order they
        will be admitted, each holding it for its run (seconds): the slots the open leases free (and those
        `held` for the given seconds by leases not open yet: granted, their requests not resumed), each
        taken again by the next in line, a slot at a time; for a token refusal, the tokens' refill for all.
        None where this replica cannot tell (its leases are not the ones open on the key).

        No hint is handed out (the successive-slot bookkeeping of `RetryHints` is for clients sent away):
        this is what deadlines are compared with.
        """
        if rejection.reason is Reason.TOKENS:
            refill = rejection.retry_after_s
            return None if refill is None else [refill] * len(runs)
        if rejection.reason is not Reason.CONCURRENCY:
            return None
        # Read afresh, not through the 50 ms cache of the retry hints: a lease the queue granted moves from
        # `held` to the open leases between two reads, and a stale read would miss its slot altogether.
        free = sorted([*remaining_times(open_leases(rejection.key)), *held])  # sorted: a heap
        if not free:
            return None
        out = []
        for run in runs:
            out.append(free[0])
            heapq.heapreplace(free, free[0] + run)
        return out
