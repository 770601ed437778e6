"""KV-token budget for one model pool: admit requests only while their KV fits, now and as they decode.

The KV gauge of an inference server reacts after the fact: vLLM allocates blocks only for the tokens it
schedules now, so KV grows during decode and overflows as preemptions long after admission. With the pool's
capacity in tokens (from `vllm:cache_config_info` block_size x num_gpu_blocks, SGLang
`max_total_num_tokens`, TRT-LLM block metrics) the sidecar can instead track what it has admitted itself
and refuse a request that would push the pool past `target_utilization` of capacity.

Each lease has an expected final completion: the caller's completion allowance (usually `max_tokens`, or
the remaining context) times a learned ratio (`CompletionLearner`): per learner key (the request's
tenant), a high quantile of `actual_completion / allowance` over that key's finished requests, with a
floor. It starts at 1.0 (assume the whole allowance is used); only finished requests feed it (cancelled
ones, `actual_completion=None`, would bias it low), and no client's requests move another client's
estimate. Two ways to book it (`BookingMode`):

* `lifetime`: every lease counts prompt + expected completion (never less than prompt + streamed) from
  admission to release. Safe, but a request holds that much KV only at its very end: it starts with its
  prompt and grows one token per engine step, so a full pool booked this way is 15-30 % empty.
* `forecast`: every lease is a trajectory (`forecast.py`): prompt + tokens generated so far now, growing
  one token per step per sequence until its expected final completion, then gone (held at that size until
  its allowance's end where the expected completion is a learned guess below it: `Lease.pieces`, a tenant
  can train its guess down). A request fits when
  the highest total the trajectories reach from now on, with its own added, stays within the budget.
  Tokens generated so far are the streamed count where the response streams, else an estimate from the
  time since admission and the pool's decode pace learned from streams (`LearnedPace`). The engine's own
  KV gauge corrects the sum in both directions (`observe_engine`): at each feed sample, KV in use that
  the leases do not explain (other traffic, progress under-estimated) is added to every forecast until the
  next sample, and, while nothing waits in the engine, what running leases are provably booked for beyond
  the KV in use is taken off. Each running sequence is booked half a KV block on top of its tokens for the
  engine's whole-block rounding (`set_block_tokens`).
  A lease that outlives its expected completion is re-forecast up to its whole allowance.
  Forecasts need the feed: with no engine sample for `fresh_for` seconds (or before the first one), or
  without a known decode pace for leases that do not stream, the budget books as `lifetime` does.

Shared prompt prefixes (`prefix_index`): a lease may bring its prompt's leading chunks (`PromptChunks`).
Chunks that requests in flight already hold are booked as the engine's prefix cache holds them, once per
replica at most: of the holders of a chunk only the last `replicas` admitted pay for it, the others are
credited it (their prompt is booked less the credit, `_Lease.own_prompt`). When a payer is released the next
holder pays again, so what the leases hold now is booked exactly; the error model is in docs/feedback.md.

Fair shares (`kv_fairness`, with a `FairShare`): each admission counts as its tenant's attained KV service,
and a refused request claims the KV it needs from later requests of other tenants in its class (and of
less important ones), its tenant having received less; its retry then fits. Without a
`now` (no clock) or a `FairShare` the budget admits whatever fits, as before.

The budget is a facade over its parts, each with the state it changes: the ledger of leases and their
demand (`ledger.py`, leases in `lease.py`), the booking and its forecast (`booked.py`), the paces it forecasts
at (`pacing.py`), the prefix credit (`prefix_credit.py`), the engine's corrections (`correction.py`), this
replica's share of the pool (`pool_share.py`) and the fair shares and claims (`claims.py`). Its methods say in
which order the parts change; callers see one `KvBudget`.

Pure and synchronous (no asyncio, no clock): callers pass `now` from their own clock.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from extproc.core.engine.pace import LearnedPace
from extproc.core.kv.booked import Booker, BookingMode
from extproc.core.kv.claims import FairClaims
from extproc.core.kv.completion import CompletionLearner
from extproc.core.kv.correction import EngineCorrection
from extproc.core.kv.fairness import FairShare
from extproc.core.kv.fleet import Fleet, Peers, ReplicaShare
from extproc.core.kv.lease import PREFIX_MARGIN_TOKENS
from extproc.core.kv.ledger import Ledger
from extproc.core.kv.pacing import SETTLE_AFTER_S, BudgetPace
from extproc.core.kv.pool_share import PoolShare
from extproc.core.kv.prefix import NO_CHUNKS, PromptChunks
from extproc.core.kv.prefix_credit import PrefixCredit

__all__ = ["PREFIX_MARGIN_TOKENS", "SETTLE_AFTER_S", "BookingMode", "KvBudget"]


def _check_ratios(target: float, share: float, floor: float, prior: float, unconfirmed: float) -> None:
    """`KvBudget`'s ratios in range, each error naming its config key."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"kv_budget.target_utilization: must be in (0, 1], got {target}")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"kv_budget.capacity_share: must be in (0, 1], got {share}")
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"kv_budget.min_completion_ratio: must be in (0, 1], got {floor}")
    if not floor <= prior <= 1.0:
        raise ValueError(
            f"kv_budget.initial_completion_ratio: must be in [min_completion_ratio, 1], got {prior}"
        )
    if not 0.0 <= unconfirmed <= 1.0:
        raise ValueError(f"kv_budget.unconfirmed_share: must be in [0, 1], got {unconfirmed}")


class KvBudget:
    """Admitted KV demand of one pool against its capacity in tokens.

    `capacity_share` is the most of the pool this sidecar may fill. Replicas that share a store divide the
    pool by demand through it (`fleet`, `kv_fleet`): each may book what the others have not, up to that
    ceiling, and its fallback share while the store cannot say; without a shared store it is the fixed
    fraction each replica fills, 1/replicas where several admit into one pool.
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
        booking: BookingMode = BookingMode.LIFETIME,
        pace: LearnedPace | None = None,
        prefix_sharing: bool = True,
        fairness: FairShare | None = None,
        unconfirmed_share: float = 0.1,
    ) -> None:
        _check_ratios(
            target_utilization,
            capacity_share,
            min_completion_ratio,
            initial_completion_ratio,
            unconfirmed_share,
        )
        self.prefix_sharing = prefix_sharing
        learner = learner or CompletionLearner(prior=initial_completion_ratio, floor=min_completion_ratio)
        self._pace = BudgetPace(pace, booked_sequences=lambda: self._ledger.sequences)
        self._ledger = Ledger(learner, unconfirmed_share, self._pace)
        self._booker = Booker(self._ledger, self._pace, booking)
        self._prefix = PrefixCredit(self._ledger)
        self._share = PoolShare(target_utilization, capacity_share, self._ledger)
        self._engine = EngineCorrection(self._ledger, self._booker, self._pace, self._share)
        self._claims = FairClaims(self._ledger, fairness)
        # The parts callers read, each created once (never replaced, so these name them for good).
        self.booking = self._booker.mode
        self.learner, self.credit = self._ledger.learner, self._ledger.credit
        self.pace: LearnedPace = self._pace.learned
        self.fairness, self.schedule = self._claims.fairness, self._claims.schedule
        self.fleet: Fleet = self._share.fleet
        self.set_capacity(capacity_tokens)

    # -- read-only views ---------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int | None:
        """Pool capacity in tokens, None while unknown (then every request fits)."""
        return self._share.capacity

    @property
    def budget_tokens(self) -> int | None:
        """Tokens this sidecar may have admitted: its share of capacity x target (`PoolShare.budget`)."""
        return self._share.budget(self._booker.booked, self._booker.unexplained)

    @property
    def demand_tokens(self) -> int:
        """Sum of the leases' lifetime footprints, less those the engine has finished (`observe_engine`)."""
        return self._booker.demand_tokens()

    @property
    def engine_finished(self) -> int:
        """Leases the engine has finished while their clients still read, at the last sample."""
        return self._booker.engine_finished()

    @property
    def booked_tokens(self) -> int:
        """What the last decision compared with the budget (the forecast peak, or the lifetime demand)."""
        return self._booker.booked

    @property
    def unexplained_tokens(self) -> int:
        """The engine's correction at the last sample, added to forecasts (`observe_engine`)."""
        return round(self._booker.unexplained)

    @property
    def headroom_tokens(self) -> int | None:
        """Budget minus booked tokens; negative when over budget (capacity shrank, estimates too low)."""
        return None if (budget := self.budget_tokens) is None else budget - self._booker.booked

    @property
    def completion_ratio(self) -> float:
        """Learned expected completion as a fraction of the allowance, for requests without a learner key."""
        return self._ledger.learner.ratio("")

    @property
    def leases(self) -> int:
        return len(self._ledger.leases)

    @property
    def shared_prompt_tokens(self) -> int:
        """Prompt tokens of the leases that their shared prefixes spare the booking (credited chunks)."""
        return self._ledger.shared_prompt_tokens()

    @property
    def replicas(self) -> int:
        """Replicas a shared chunk may be held on at most (see `set_replicas`)."""
        return self._prefix.replicas

    def forecasting(self, now: float | None) -> bool:
        """Whether decisions at `now` use the forecast (booking `forecast` and a fresh engine sample)."""
        return self._booker.forecasting(now)

    def retry_after(self, now: float | None) -> float | None:
        """After a refusal by `would_fit` at `now`: when it is expected to fit (`Fleet.releases` too) and a
        promise of that place (`kv_schedule`); None with no pace or nothing to wait for."""
        fleet, booked = self.fleet, self._booker.booked_with
        eta = self._claims.retry_after(now, self.budget_tokens, self._pace, booked, *fleet.releases(now))
        return fleet.told(eta, now)

    # -- updates -----------------------------------------------------------------------------------------

    def set_capacity(self, capacity_tokens: int | None) -> None:
        """Update capacity from the feed; 0 or negative means unknown (servers report 0 when unset)."""
        self._share.set_capacity(capacity_tokens)

    def set_replicas(self, replicas: int) -> None:
        """How many replicas serve the pool (the feed): a chunk is booked once per replica at most."""
        if self._prefix.set_replicas(replicas):
            self._booker.changed()

    def set_engine_shares_prefixes(self, shares: bool) -> None:
        """Whether the pool's engines share prompt prefixes (the feed: vLLM's `enable_prefix_caching`)."""
        if self._prefix.set_engine_shares(shares):
            self._booker.changed()

    def set_block_tokens(self, block_tokens: int | None) -> None:
        """The engine's tokens per KV block (the feed; None: unknown), its rounding booked per sequence."""
        if self._ledger.set_block_tokens(block_tokens):
            self._booker.changed()

    def observe_engine(
        self,
        used_tokens: float | None,
        now: float,
        fresh_for: float,
        waiting: float | None = None,
        running: float | None = None,
        prompted: float | None = None,
    ) -> None:
        """A fresh engine sample (KV tokens in use, trusted `fresh_for` s; requests waiting and running; the
        prompt tokens prefilled, a counter): what it corrects is `EngineCorrection.observe`'s."""
        self._share.seen(now)
        self._engine.observe(used_tokens, now, fresh_for, waiting, running, prompted)

    def budget_share(self) -> float:
        """The fixed share of the pool this replica books against while the others are unknown."""
        return self._share.budget_share()

    def share_through_store(self, fallback_share: float) -> None:
        """Replicas share this pool through a store (`Fleet.share_through_store`)."""
        self._share.share_through_store(fallback_share)

    def observe_peers(self, peers: Peers | None, now: float) -> None:
        """The other replicas' figures of this pool, as the shared store answered at `now` (None: not)."""
        self._share.observe_peers(peers, now)
        self._booker.changed()

    def replica_share(self, now: float) -> ReplicaShare:
        """This replica's figures of the pool for the others (`kv_fleet.ReplicaShare`)."""
        return self._engine.replica_share(now)

    def on_engine_done(self, lease_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` once, when the engine is confirmed done with a lease booked here, never after."""
        self._engine.on_engine_done(lease_id, callback)

    def observe_fed_pace(self, tokens_per_second: float | None, running: float | None = None) -> None:
        """The engines' pace per sequence, and their running sequences (`BudgetPace.observe_fed_pace`)."""
        self._pace.observe_fed_pace(tokens_per_second, running)

    def decode_rate(self) -> float | None:
        """The pace the forecast takes unseen answers to progress at (`BudgetPace.decode_rate`)."""
        return self._pace.decode_rate()

    def assume_pace(self, tokens_per_second: float | None) -> None:
        """The pace hints take where none is learned or fed (`BudgetPace.assume_pace`)."""
        self._pace.assume_pace(tokens_per_second)

    def hint_rate(self) -> float | None:
        """The pace a refusal's `retry-after` is forecast at (`BudgetPace.hint_rate`)."""
        return self._pace.hint_rate()

    def settle_after(self) -> float:
        """Seconds after admission past which a lease is in the engine's gauge (`BudgetPace.settle_after`)."""
        return self._pace.settle_after()

    def expected_completion(self, allowance: int, learner_key: str = "", committed: int = 0) -> int:
        """Completion tokens a request is expected to produce (`Ledger.expected_completion`)."""
        return self._ledger.expected_completion(allowance, learner_key, committed)

    def would_fit(
        self,
        prompt_tokens: int,
        max_completion: int,
        learner_key: str = "",
        *,
        now: float | None = None,
        sequences: int = 1,
        committed: int = 0,
        chunks: PromptChunks = NO_CHUNKS,
        rank: int = 0,
        claim: bool = True,
    ) -> tuple[bool, int | None]:
        """Whether a request fits at `now`, and the headroom before it. Capacity unknown: (True, None). An
        empty pool always admits, so a request larger than the budget is not starved forever (the server's
        own length validation bounds it). Without `now` the booking is `lifetime`. Its prompt's `chunks`
        shared with the leases in flight are booked once. With fair shares, it must leave the KV another
        refused request claims (`rank`: its class's order, 0 first), and a refusal may make it the
        claimant (not with `claim` False: a check on a bound, which the exact count decides again)."""
        self._share.seen(now)
        self.fleet.decided(now)
        if self._share.capacity is None:
            return True, None
        candidate = self._ledger.new_lease(
            prompt_tokens, max_completion, learner_key, now, sequences, committed
        )
        candidate.chunks = self._prefix.chunks(chunks)
        booked, booked_with, spared = self._prefix.book_with(candidate, partial(self._booker.book, now))
        # admit() right after this decision books the same request: it reuses the sum just computed.
        self._booker.decided(candidate.fit_key(now), booked, booked_with)
        budget = self.budget_tokens or 0  # after the booking: a fleet's budget reads what is booked now
        headroom = budget - booked
        self._claims.unrefused()
        if not self._ledger.leases and self.fleet.others_booked(now) <= 0:
            return True, headroom
        return self._claims.fits(candidate, rank, booked_with, budget, now, claim, spared), headroom

    def admit(
        self,
        lease_id: str,
        prompt_tokens: int,
        expected_completion: int,
        learner_key: str = "",
        *,
        now: float | None = None,
        sequences: int = 1,
        committed: int = 0,
        chunks: PromptChunks = NO_CHUNKS,
        rank: int = 0,
    ) -> int:
        """Record an admitted request; `expected_completion` is its completion allowance (max_tokens), of
        which it declares it will generate at least `committed`; its prompt's `chunks` are shared with the
        other leases as the engine's prefix cache shares them. Returns the lifetime footprint charged; a
        lease id already present is a caller bug: ValueError."""
        if lease_id in self._ledger.leases:
            raise ValueError(f"kv_budget: lease {lease_id!r} already admitted")
        self._share.seen(now)
        self.fleet.decided(now)
        lease = self._ledger.new_lease(
            prompt_tokens, expected_completion, learner_key, now, sequences, committed
        )
        lease.chunks = self._prefix.chunks(chunks)
        self._ledger.add(lease_id, lease)
        self._prefix.admitted(lease_id, lease)
        self._booker.admitted(lease.fit_key(now), now)
        self._claims.admitted(lease, rank, now)
        return lease.footprint

    def progress(self, lease_id: str, streamed_tokens: int, now: float | None = None) -> bool:
        """Cumulative completion tokens streamed so far (`Ledger.progress`); False for an unknown lease."""
        if not self._ledger.progress(lease_id, streamed_tokens, now):
            return False
        self._booker.changed()
        return True

    def correct_prompt(
        self, lease_id: str, prompt_tokens: int, now: float | None = None, chunks: PromptChunks | None = None
    ) -> bool:
        """Lower a lease's prompt to its exact count (it was booked on a bound, `provisional.py`); never
        raises it. With `chunks` (its chunks, their texts' tokens now counted), its shared run is credited in
        tokens; with fair shares and `now`, its tenant's service is lowered as much (`FairClaims.served`).
        False for an unknown (already released) lease, which is harmless."""
        lease = self._ledger.leases.get(lease_id)
        if lease is None:
            return False
        self._booker.changed()
        change = self._ledger.correct_prompt(lease, prompt_tokens, chunks)
        self._claims.served(lease.learner_key, change, now)
        return True

    def estimate_progress(self, lease_id: str, tokens: int) -> bool:
        """Unseen progress a caller estimated (`Ledger.estimate_progress`); False for an unknown lease."""
        if not self._ledger.estimate_progress(lease_id, tokens):
            return False
        self._booker.changed()
        return True

    def observe_unseen_stream(
        self, first_token_after_s: float, tokens_per_sequence: float, seconds: float
    ) -> None:
        """A completed stream this budget did not watch teaches the pool's pace (`BudgetPace`)."""
        self._pace.observe_unseen_stream(first_token_after_s, tokens_per_sequence, seconds)

    def release(self, lease_id: str, actual_completion: int | None = None) -> bool:
        """Drop a lease; a known `actual_completion` feeds the learned ratio. Double release is a no-op."""
        lease = self._ledger.pop(lease_id, actual_completion)
        if lease is None:
            return False
        self._engine.forget(lease_id)
        self._prefix.released(lease_id, lease)
        self._booker.released(lease)
        return True
