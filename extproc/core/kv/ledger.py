"""The KV budget's ledger (`KvBudget`): the leases one pool's budget holds, and the sum of their lifetime
footprints kept with them. A lease's footprint changes with its progress, its prompt's exact count, its
shared prefix and the engine's block rounding; each such change goes through `resized`, so the sum is never
recomputed and never drifts from the leases.

The ledger also decides what a new lease is booked to generate (its tenant's learned completion ratio,
bounded by the credit it may take below its allowance, `kv_credit`) and what a released one teaches: the
learned ratio, and the decode pace of a stream.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math

from extproc.core.kv.completion import CompletionLearner
from extproc.core.kv.credit import UnconfirmedCredit
from extproc.core.kv.lease import PREFIX_MARGIN_TOKENS, Lease
from extproc.core.kv.pacing import BudgetPace
from extproc.core.kv.prefix import PromptChunks


class Ledger:
    """The leases of one pool's budget by id, their demand, and what each is expected to generate."""

    def __init__(self, learner: CompletionLearner, unconfirmed_share: float, pace: BudgetPace) -> None:
        self.leases: dict[str, Lease] = {}
        self.demand = 0  # the sum of the leases' lifetime footprints
        self.learner = learner
        # The most of the capacity one tenant's requests may be booked below their allowances (`kv_credit`):
        # by default the margin the default target (0.9) keeps.
        self.credit = UnconfirmedCredit()
        self._unconfirmed = unconfirmed_share
        self._pace = pace
        self._block_slack = 0
        self._block = PREFIX_MARGIN_TOKENS

    @property
    def sequences(self) -> int:
        """The sequences of every lease: the batch they run in is at least that (`BudgetPace._at_batch`)."""
        return sum(lease.sequences for lease in self.leases.values())

    def expected_completion(self, allowance: int, learner_key: str = "", committed: int = 0) -> int:
        """Completion tokens a request of `learner_key` with this allowance is expected to produce: the
        learned share of the allowance, never below what the request declares it will generate
        (`committed`: `min_tokens`, or the whole allowance under `ignore_eos`), so a key's history of short
        answers cannot shrink the booking of a request that says it will run long."""
        allowance = max(0, int(allowance))
        learned = math.ceil(allowance * self.learner.ratio(learner_key))
        return min(allowance, max(learned, int(committed)))

    def new_lease(
        self,
        prompt: int,
        allowance: int,
        learner_key: str,
        now: float | None,
        sequences: int,
        committed: int = 0,
    ) -> Lease:
        """A lease for a request, not yet added: its expected completion learned and within its credit."""
        allowance = max(0, int(allowance))
        learned = self.expected_completion(allowance, learner_key, committed)
        return Lease(
            prompt=max(0, int(prompt)),
            allowance=allowance,
            expected_completion=self.credit.expected(learner_key, allowance, learned),
            learner_key=learner_key,
            sequences=max(1, int(sequences)),
            admitted_at=now,
            slack=self._block_slack * max(1, int(sequences)),
            block=self._block,
        )

    def add(self, lease_id: str, lease: Lease) -> None:
        """An admitted lease: its footprint joins the demand, its credit below its allowance is taken."""
        self.leases[lease_id] = lease
        self.demand += lease.footprint
        self.credit.take(lease.learner_key, lease.allowance - lease.expected_completion)

    def pop(self, lease_id: str, actual_completion: int | None) -> Lease | None:
        """Drop a lease (None: not held); a known `actual_completion` feeds the learned ratio, a watched
        stream the pool's pace."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        self.demand -= lease.footprint
        self.credit.give_back(lease.learner_key, lease.allowance - lease.expected_completion)
        if actual_completion is not None and lease.allowance > 0:
            self.learner.observe(lease.learner_key, actual_completion / lease.allowance)
        self._pace.learn(lease)
        return lease

    def resized(self, lease: Lease, before: int) -> None:
        """`lease`'s footprint changed from `before`: the demand follows."""
        self.demand += lease.footprint - before

    def progress(self, lease_id: str, streamed_tokens: int, now: float | None) -> bool:
        """Cumulative completion tokens streamed so far; the footprint never drops below prompt+streamed.

        With `now`, streamed progress also teaches the pool's decode pace. Returns False for an unknown
        (already released) lease, which is harmless.
        """
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        before = lease.footprint
        lease.streamed = max(lease.streamed, int(streamed_tokens))
        if now is not None and lease.streamed > 0:
            self._pace.streamed(lease, now)
        self.resized(lease, before)
        return True

    def correct_prompt(self, lease: Lease, prompt_tokens: int, chunks: PromptChunks | None) -> int:
        """Lower `lease`'s prompt to its exact count, never raising it, and, given its `chunks` again with
        their texts' tokens counted, credit its shared run in tokens (`KvBudget.correct_prompt`). Returns
        how much its footprint changed."""
        before = lease.footprint
        lease.prompt = max(0, min(lease.prompt, int(prompt_tokens)))
        if chunks is not None and chunks.hashes == lease.chunks.hashes:
            lease.chunks = chunks  # the same chunks, their texts' tokens now counted: credited in tokens
        self.resized(lease, before)
        return lease.footprint - before

    def estimate_progress(self, lease_id: str, tokens: int) -> bool:
        """Completion tokens a request whose stream nobody watches has probably generated (the lean profile,
        from elapsed time and the pool's decode rate): grows its lifetime footprint when it runs past its
        expected length. The forecast does not take it as progress: that estimate counts from admission and
        errs high, and a request taken for further along than it is would be forecast to end too early;
        the forecast estimates unseen progress itself, after the learned first-token delay."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        before = lease.footprint
        lease.estimated = max(lease.estimated, int(tokens))
        self.resized(lease, before)
        return True

    def set_credit_limit(self, capacity: int | None, budget_share: float) -> None:
        """A tenant's unconfirmed credit: `unconfirmed_share` of this replica's fixed share of the cache
        (of every replica's, through a shared store, it adds up to the pool's margin); no bound while the
        capacity is unknown."""
        if capacity is None:
            self.credit.limit = None
        else:
            self.credit.limit = int(capacity * self._unconfirmed * budget_share)

    def set_block_tokens(self, block_tokens: int | None) -> bool:
        """The engine's tokens per KV block (from the feed; None: unknown, no rounding booked). The engine
        allocates whole blocks, so each running sequence's last block is partly empty: half a block on
        average, booked per sequence on top of its tokens. Over n sequences the sum of that slack has a
        spread of about block x sqrt(n / 12), within `target_utilization`'s margin (40 sequences of
        128-token blocks: 234 tokens, 1.4 % of a 16,384-token cache), where booking a whole block each
        would refuse a fifth of such a cache's requests for nothing. True when it changed (every lease
        re-booked)."""
        slack = max(0, int(block_tokens or 0) - 1) // 2
        block = int(block_tokens) if block_tokens and block_tokens > 0 else PREFIX_MARGIN_TOKENS
        if slack == self._block_slack and block == self._block:
            return False
        self._block_slack = slack
        self._block = block
        for lease in self.leases.values():
            before = lease.footprint
            lease.slack = slack * lease.sequences
            lease.block = block
            self.resized(lease, before)
        return True

    def held_by_tenant(self) -> dict[str, float]:
        """The KV each tenant's leases hold now, by their lifetime footprints (the share guard's measure)."""
        held: dict[str, float] = {}
        for lease in self.leases.values():
            held[lease.learner_key] = held.get(lease.learner_key, 0.0) + lease.footprint
        return held

    def shared_prompt_tokens(self) -> int:
        """Prompt tokens of the leases that their shared prefixes spare the booking (credited chunks)."""
        return sum(lease.prompt - lease.own_prompt for lease in self.leases.values())
