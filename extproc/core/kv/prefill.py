"""Evidence that admitted requests' prompts are prefilled, from the engines' own count: what the KV budget's
downward correction needs before it takes KV off a lease (`EngineCorrection`). A prompt in chunked prefill
runs with only its first chunks in the cache; taken for resident, its uncomputed part came off the booking,
and a second long prompt was admitted into room the first still needed.

The count is the pool's prompt-token counter (vLLM's `vllm:prompt_tokens_total`, grown by a prompt's whole
length, cached part included, when its prefill completes: vllm 0.32.0 v1/metrics/stats.py
`IterationStats.update_from_output`, loggers.py 1262), summed over the pool's endpoints as growth
(`core.engine.counter.PoolCounter`). Each lease keeps the value read at the last sample before it was first
seen here, so the growth since is at least what was prefilled since its admission (a lease booked before the
counter was known starts from its first value: less, the cautious side).

A lease counts as prefilled once the growth since its baseline covers `EVIDENCE_SHARE` of the prompts of every
lease still booked whose baseline is as late or later, its own included: one long prompt completing does not
vouch for another admitted beside it (two 100,000-token prompts in prefill, the first done: neither the
second, nor the first alone, is evidenced by 100,000 against 200,000). Necessary, not sufficient: a request
released since, or another replica's, grows the counter too. The share leaves room for the engine's
tokenizer counting a prompt a little shorter than the sidecar books it, which a prefill completing alone
must still evidence. Where the engines publish no counter the evidence is unknown (`prefilled` says so) and
the caller keeps its older rule; a counter that goes missing for a sample or a few keeps the last reading
(new leases get no baseline meanwhile) for `MISSING_SAMPLES` samples before it counts as unknown.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import groupby

from extproc.core.kv.lease import Lease

EVIDENCE_SHARE = 0.8
"""The share of the prompts booked since a baseline that the counter's growth must cover."""
MISSING_SAMPLES = 10
"""Samples without a counter after which the evidence counts as unknown (the engines no longer publish it)."""


class PrefillEvidence:
    """Which of one pool's leases the engines' prompt counter says may be wholly prefilled."""

    __slots__ = ("_evidenced", "_missing", "_prompted", "_since")

    def __init__(self) -> None:
        self._prompted: float | None = None  # the counter at the last sample that carried it
        self._since: dict[str, float] = {}  # per lease: the counter before its admission
        self._missing = 0  # samples in a row without the counter
        self._evidenced: frozenset[str] = frozenset()

    @property
    def known(self) -> bool:
        """Whether the engines publish the counter (else `prefilled` is no evidence either way)."""
        return self._prompted is not None

    def prefilled(self, lease_id: str) -> bool:
        """Whether the counter allows `lease_id` to be wholly prefilled (False where it is unknown too)."""
        return lease_id in self._evidenced

    def sample(self, prompted: float | None, leases: Mapping[str, Lease]) -> None:
        """An engine sample with the pool's counter (`prompted`; None: not published), the leases booked."""
        if prompted is None or not math.isfinite(prompted):
            self._missed(leases)
            return
        self._missing = 0
        before = prompted if self._prompted is None else self._prompted
        since = self._since
        self._since = {lease_id: since.get(lease_id, before) for lease_id in leases}
        self._prompted = prompted
        self._evidenced = self._evidence(prompted, leases)

    def _missed(self, leases: Mapping[str, Lease]) -> None:
        self._missing += 1
        if self._missing > MISSING_SAMPLES:
            self._prompted = None
            self._since.clear()
            self._evidenced = frozenset()
            return
        self._since = {lease_id: at for lease_id, at in self._since.items() if lease_id in leases}
        if self._prompted is not None:
            self._evidenced = self._evidence(self._prompted, leases)

    def _evidence(self, prompted: float, leases: Mapping[str, Lease]) -> frozenset[str]:
        """The leases whose baseline's growth covers the prompts booked from that baseline on."""
        needed = 0.0
        evidenced: list[str] = []
        latest_first = sorted(self._since.items(), key=lambda item: item[1], reverse=True)
        for baseline, group in groupby(latest_first, key=lambda item: item[1]):
            ids = [lease_id for lease_id, _ in group]
            needed += sum(leases[lease_id].prompt for lease_id in ids)
            if prompted - baseline >= EVIDENCE_SHARE * needed:
                evidenced.extend(ids)
        return frozenset(evidenced)
