"""The ledger's one invariant, which the budget's parts rely on since they change leases apart
(extproc/core/kv/ledger.py): its demand is the sum of its leases' lifetime footprints, whichever part
changed a footprint (progress, a prompt's exact count, the prefix credit, the engine's block size) and in
whatever order."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from extproc.core.kv.budget import KvBudget
from extproc.core.kv.prefix import PromptChunks

SHARED = (11, 12, 13, 14)


def chunks(run: int, counted: bool) -> PromptChunks:
    """The first `run` chunks of one shared prompt, its texts' tokens counted or not."""
    hashes = SHARED[:run]
    tokens = tuple(100 * (i + 1) for i in range(run)) if counted else ()
    return PromptChunks(hashes, 256, 256 * max(1, run), tuple(range(1, run + 1)), tokens)


class LedgerDemand(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.budget = KvBudget(50_000)
        self.ids: list[str] = []
        self.admitted = 0

    @rule(
        prompt=st.integers(0, 2_000),
        allowance=st.integers(0, 1_000),
        run=st.integers(0, 4),
        counted=st.booleans(),
    )
    def admit(self, prompt: int, allowance: int, run: int, counted: bool) -> None:
        self.admitted += 1
        lease_id = f"l{self.admitted}"
        self.budget.admit(lease_id, prompt, allowance, chunks=chunks(run, counted), sequences=1 + run % 2)
        self.ids.append(lease_id)

    @rule(pick=st.integers(0, 50), tokens=st.integers(0, 1_500))
    def progress(self, pick: int, tokens: int) -> None:
        if self.ids:
            self.budget.progress(self.ids[pick % len(self.ids)], tokens, now=float(tokens))

    @rule(pick=st.integers(0, 50), tokens=st.integers(0, 1_500))
    def estimate(self, pick: int, tokens: int) -> None:
        if self.ids:
            self.budget.estimate_progress(self.ids[pick % len(self.ids)], tokens)

    @rule(pick=st.integers(0, 50), prompt=st.integers(0, 2_000))
    def count_prompt(self, pick: int, prompt: int) -> None:
        if self.ids:
            lease_id = self.ids[pick % len(self.ids)]
            lease = self.budget._ledger.leases.get(lease_id)
            run = len(lease.chunks.hashes) if lease is not None else 0
            self.budget.correct_prompt(lease_id, prompt, chunks=chunks(run, True))

    @rule(pick=st.integers(0, 50))
    def release(self, pick: int) -> None:
        if self.ids:
            self.budget.release(self.ids.pop(pick % len(self.ids)))

    @rule(replicas=st.integers(1, 3))
    def replicas(self, replicas: int) -> None:
        self.budget.set_replicas(replicas)

    @rule(block=st.sampled_from([None, 16, 128]))
    def block(self, block: int | None) -> None:
        self.budget.set_block_tokens(block)

    @rule(shares=st.booleans())
    def engine_shares(self, shares: bool) -> None:
        self.budget.set_engine_shares_prefixes(shares)

    @invariant()
    def demand_is_the_sum_of_footprints(self) -> None:
        ledger = self.budget._ledger
        assert ledger.demand == sum(lease.footprint for lease in ledger.leases.values())
        assert self.budget.leases == len(self.ids)


TestLedgerDemand = LedgerDemand.TestCase
TestLedgerDemand.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
