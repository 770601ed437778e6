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
* `forecast`: every lease is a trajectory (`kv_forecast`): prompt + tokens generated so far now, growing
  one token per step per sequence until its expected final completion, then gone. A request fits when
  the highest total the trajectories reach from now on, with its own added, stays within the budget.
  Tokens generated so far are the streamed count where the response streams, else an estimate from the
  time since admission and the pool's decode pace learned from streams (`DecodeRate`). The engine's own
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

Pure and synchronous (no asyncio, no clock): callers pass `now` from their own clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from extproc.core.engine.done import EngineDone
from extproc.core.engine.pace import usable_rate
from extproc.core.kv.completion import CompletionLearner
from extproc.core.kv.credit import UnconfirmedCredit
from extproc.core.kv.fairness import ClaimId, FairShare
from extproc.core.kv.fleet import Fleet, Peers, ReplicaShare
from extproc.core.kv.forecast import DecodeRate, Steps, forecast_peaks
from extproc.core.kv.prefix import NO_CHUNKS, PrefixIndex, PromptChunks
from extproc.core.kv.schedule import RetrySchedule

PREFIX_MARGIN_TOKENS = 64
"""What a shared run is credited less while the engine's block size is unknown (`PromptChunks.credit`): about
the one 256-character chunk the credit kept back before it was counted in tokens; with the block size from the
feed, one block (16 on a GPU's vLLM, 128 on its CPU build)."""

SETTLE_AFTER_S = 2.0
"""The least time after admission for a lease to count as held in the engine's gauge (`settle_after`)."""


class BookingMode(enum.StrEnum):
    """How a lease is charged against the budget (see the module docstring)."""

    LIFETIME = "lifetime"
    FORECAST = "forecast"


@dataclass(slots=True)
class _Lease:
    prompt: int
    allowance: int
    expected_completion: int
    learner_key: str = ""
    streamed: int = 0
    estimated: int = 0  # completion tokens a caller guessed, unseen (lean profile): footprint only
    sequences: int = 1
    admitted_at: float | None = None
    first_progress: tuple[float, int] | None = None  # (when, streamed) at the first streamed token
    last_progress_at: float | None = None
    chunks: PromptChunks = NO_CHUNKS
    credited: int = 0  # leading chunks other leases pay for (`PrefixIndex`)
    # The engine's whole-block rounding of its sequences' last blocks (`KvBudget.set_block_tokens`).
    slack: int = 0
    margin: int = PREFIX_MARGIN_TOKENS  # one engine block, kept back from a shared run's credit
    # A sample since admission counted at least this lease's sequences running (`KvBudget._mark_running`).
    engine_ran: bool = False

    def settled_by(self, before: float) -> bool:
        """Admitted by `before`: long enough ago to be in the engine's gauges (`KvBudget.settle_after`)."""
        return self.admitted_at is not None and self.admitted_at <= before

    @property
    def own_prompt(self) -> int:
        """The prompt's KV this lease is booked for: all of it, less the shared chunks others pay for."""
        return self.prompt - self.chunks.credit(self.credited, self.prompt, self.margin)

    @property
    def footprint(self) -> int:
        """What `lifetime` booking charges: prompt (less its credited prefix) + expected completion, never
        less than streamed (or than a caller's estimate of unseen progress)."""
        return self.own_prompt + self.slack + max(self.expected_completion, self.streamed, self.estimated)

    def generated(self, now: float, rate: float | None, delay: float) -> float | None:
        """Completion tokens so far: streamed, else estimated at `rate` tokens per second per sequence
        after `delay` (the pool's pace, see `DecodeRate`); None when unknowable."""
        if self.first_progress is not None:
            return float(self.streamed)
        if self.admitted_at is None or rate is None:
            return None
        running = now - self.admitted_at - delay
        guess = running * rate * self.sequences if running > 0 else 0.0
        if guess < self.streamed:
            guess = float(self.streamed)
        return guess if guess < self.allowance else float(self.allowance)

    def trajectory(self, now: float, rate: float | None, delay: float) -> Steps:
        """This lease's KV from now on, in engine steps: (base, slope, end) as `kv_forecast.Trajectory`."""
        done = self.generated(now, rate, delay)
        if done is None:
            # Nobody knows how far it is: its expected final size, for as long as it may still run.
            return (float(self.footprint), 0.0, self.expected_completion / self.sequences)
        final = float(self.expected_completion)
        if done >= final:
            # Past what was expected: it may run to its allowance (the server enforces that bound).
            final = done if done > self.allowance else float(self.allowance)
        return (self.own_prompt + self.slack + done, float(self.sequences), (final - done) / self.sequences)


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
        pace: DecodeRate | None = None,
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
        self._target = target_utilization
        # The most of the capacity one tenant's requests may be booked below their allowances (`kv_credit`):
        # by default the margin the default target (0.9) keeps.
        self._unconfirmed = unconfirmed_share
        self.credit = UnconfirmedCredit()
        self._share = capacity_share
        self.booking = BookingMode(booking)
        self.prefix_sharing = prefix_sharing
        self.learner = learner or CompletionLearner(
            prior=initial_completion_ratio, floor=min_completion_ratio
        )
        self.pace = pace or DecodeRate()
        self.fairness = fairness
        self.schedule = RetrySchedule()
        self._refused: tuple[ClaimId, int, float] | None = None  # the last refusal's (id, footprint, run)
        self._over_share = False  # whether the last refusal was for its tenant's share (`kv_fairness`)
        self._capacity: int | None = None
        self._leases: dict[str, _Lease] = {}
        self._prefixes = PrefixIndex()
        self._block_slack = 0
        self._prefix_margin = PREFIX_MARGIN_TOKENS
        self._fed_rate: float | None = None
        self._demand = 0
        self._fresh_until: float | None = None
        self._unexplained = 0.0
        self._finished: frozenset[str] = frozenset()  # leases the engine finished, at the last sample
        self._engine_done = EngineDone()  # who is told once the engine is confirmed done with a lease
        self._booked = 0
        self._last_fit: tuple[float | None, int, int, int, str, int, PromptChunks] | None = None
        self._booked_with = 0
        self.fleet = Fleet()
        self._engine_shares = True  # the pool's engines share prompt prefixes (`set_engine_shares_prefixes`)
        self._seen_at: float | None = None  # the latest `now` a caller passed: the others' figures' age
        self._sent_booked = 0  # what it had booked when its figures were last taken (`replica_share`)
        self.set_capacity(capacity_tokens)

    # -- read-only views ---------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int | None:
        """Pool capacity in tokens, None while unknown (then every request fits)."""
        return self._capacity

    @property
    def budget_tokens(self) -> int | None:
        """Tokens this sidecar may have admitted: capacity x target_utilization, less what the other
        replicas have booked where a shared store says, at most `capacity_share` of it (`Fleet.budget`)."""
        if self._capacity is None:
            return None
        target = self._capacity * self._target
        own = max(0.0, self._booked - self._unexplained)  # as of the last decision or sample
        return self.fleet.budget(target, self._share, self._seen_at, self._unexplained, own)

    @property
    def demand_tokens(self) -> int:
        """Sum of the leases' lifetime footprints (prompt + expected completion, or more once streamed),
        less those the engine has finished (`observe_engine`)."""
        finished = sum(self._leases[i].footprint for i in self._finished if i in self._leases)
        return self._demand - finished

    @property
    def engine_finished(self) -> int:
        """Leases the engine has finished while their clients still read, at the last sample."""
        return sum(1 for i in self._finished if i in self._leases)

    @property
    def booked_tokens(self) -> int:
        """What the last decision compared with the budget: the forecast peak plus the KV the engine
        reported beyond the leases, or the lifetime demand when not forecasting."""
        return self._booked

    @property
    def unexplained_tokens(self) -> int:
        """The engine's correction at the last sample, added to forecasts: KV in use that the leases did not
        account for, or, negative, what settled leases were booked for beyond the KV in use
        (`observe_engine`)."""
        return round(self._unexplained)

    @property
    def headroom_tokens(self) -> int | None:
        """Budget minus booked tokens; negative when over budget (capacity shrank, estimates too low)."""
        budget = self.budget_tokens
        return None if budget is None else budget - self._booked

    @property
    def completion_ratio(self) -> float:
        """Learned expected completion as a fraction of the allowance, for requests without a learner key."""
        return self.learner.ratio("")

    @property
    def leases(self) -> int:
        return len(self._leases)

    @property
    def shared_prompt_tokens(self) -> int:
        """Prompt tokens of the leases that their shared prefixes spare the booking (credited chunks)."""
        return sum(lease.prompt - lease.own_prompt for lease in self._leases.values())

    @property
    def replicas(self) -> int:
        """Replicas a shared chunk may be held on at most (see `set_replicas`)."""
        return self._prefixes.replicas

    def forecasting(self, now: float | None) -> bool:
        """Whether decisions at `now` use the forecast (booking `forecast` and a fresh engine sample)."""
        return (
            self.booking is BookingMode.FORECAST
            and now is not None
            and self._fresh_until is not None
            and now <= self._fresh_until
        )

    def retry_after(self, now: float | None) -> float | None:
        """After a refusal by `would_fit` at `now`: in how many seconds that request is expected to fit, and
        a promise of that place so the next refused request is sent later (`kv_schedule`). None when no pace
        at all is known (`hint_rate`) or nothing is admitted.

        Leases end at their forecast ends (`trajectory`: expected completion less tokens done, in steps
        of one token per sequence) at the pace, plus the first-token delay still ahead of a lease with no
        progress yet; each end frees its lifetime footprint from the booking the refused request was
        compared with. The refused request is expected to run its own expected completion at that pace.
        """
        budget = self.budget_tokens
        rate = self.hint_rate()
        refused = self._refused
        if budget is None or now is None or rate is None or rate <= 0 or not self._leases or refused is None:
            return None
        owner, footprint, completion = refused
        fair = self.fairness
        delay = self.pace.first_token_delay
        if fair is not None and self._over_share:
            return self._share_eta(fair, owner, now, rate, delay)
        first = fair is not None and fair.holds(owner, now)
        served = fair.standing(owner.tenant, now) if fair is not None else 0.0
        releases = [
            (self._seconds_left(lease, now, rate, delay), lease.footprint) for lease in self._leases.values()
        ]
        duration = delay + completion / rate
        priority = (float(owner.rank), served)
        standing = None if fair is None else (lambda tenant: fair.standing(tenant, now))
        eta = self.schedule.eta(
            owner,
            now,
            self._booked_with,
            budget,
            releases,
            duration,
            footprint,
            first,
            priority,
            owner.tenant,
            standing,
        )
        if fair is not None:
            fair.waits(owner, now + eta + fair.claim_ttl_s)  # its tenant waits until it is due back
            if first:
                fair.keep_until(owner, now + eta)  # the claim waits for its owner's return
        return eta

    def _share_eta(self, fair: FairShare, owner: ClaimId, now: float, rate: float, delay: float) -> float:
        """A request refused for its tenant's share: back when the tenant's first lease ends and its share
        falls. It takes no place in the schedule: the places are the waiting tenants' (module docstring
        of `kv_fairness`), and a flood's refusals would push them later."""
        ends = [
            self._seconds_left(lease, now, rate, delay)
            for lease in self._leases.values()
            if lease.learner_key == owner.tenant
        ]
        eta = min(ends, default=0.0)
        fair.waits(owner, now + eta + fair.claim_ttl_s)
        return eta

    @staticmethod
    def _seconds_left(lease: _Lease, now: float, rate: float, delay: float) -> float:
        _, _, end = lease.trajectory(now, rate, delay)
        seconds = max(0.0, end) / rate
        if lease.first_progress is None and lease.admitted_at is not None:
            seconds += max(0.0, delay - (now - lease.admitted_at))
        return seconds

    # -- updates -----------------------------------------------------------------------------------------

    def set_capacity(self, capacity_tokens: int | None) -> None:
        """Update capacity from the feed; 0 or negative means unknown (servers report 0 when unset)."""
        if capacity_tokens is None or capacity_tokens <= 0:
            self._capacity = None
            self.credit.limit = None
        else:
            self._capacity = int(capacity_tokens)
            self._set_credit_limit()

    def _set_credit_limit(self) -> None:
        """A tenant's unconfirmed credit: `unconfirmed_share` of this replica's fixed share of the cache
        (of every replica's, through a shared store, it adds up to the pool's margin)."""
        if self._capacity is not None:
            self.credit.limit = int(self._capacity * self._unconfirmed * self.budget_share())

    def set_replicas(self, replicas: int) -> None:
        """How many replicas serve the pool (from the feed): a shared chunk is booked once per replica at
        most. A change re-books the prefix credit of the leases whose payment it changes (only those holding
        a chunk with more holders than the smaller count), in place: a replica coming or going costs the
        shared chunks, not a rebuild of every lease."""
        replicas = max(1, int(replicas))
        if replicas == self._prefixes.replicas:
            return
        self._last_fit = None
        self._credit(self._prefixes.set_replicas(replicas), 1)

    def set_engine_shares_prefixes(self, shares: bool) -> None:
        """Whether the pool's engines share prompt prefixes (the feed: vLLM's `enable_prefix_caching`, True
        when no engine says). An engine that does not holds every prompt whole, however many requests
        share its text: no request is credited another's chunks, and the leases in flight are booked whole
        again at once. Sharing back on credits new leases only."""
        if shares == self._engine_shares:
            return
        self._engine_shares = shares
        self._last_fit = None
        if shares:
            return
        self._prefixes = PrefixIndex(self._prefixes.replicas)
        for lease in self._leases.values():
            self._set_credit(lease, 0)
            lease.chunks = NO_CHUNKS

    def set_block_tokens(self, block_tokens: int | None) -> None:
        """The engine's tokens per KV block (from the feed; None: unknown, no rounding booked). The engine
        allocates whole blocks, so each running sequence's last block is partly empty: half a block on
        average, booked per sequence on top of its tokens. Over n sequences the sum of that slack has a
        spread of about block x sqrt(n / 12), within `target_utilization`'s margin (40 sequences of
        128-token blocks: 234 tokens, 1.4 % of a 16,384-token cache), where booking a whole block each
        would refuse a fifth of such a cache's requests for nothing."""
        slack = max(0, int(block_tokens or 0) - 1) // 2
        margin = int(block_tokens) if block_tokens and block_tokens > 0 else PREFIX_MARGIN_TOKENS
        if slack == self._block_slack and margin == self._prefix_margin:
            return
        self._block_slack = slack
        self._prefix_margin = margin
        self._last_fit = None
        for lease in self._leases.values():
            before = lease.footprint
            lease.slack = slack * lease.sequences
            lease.margin = margin
            self._demand += lease.footprint - before

    def observe_engine(
        self,
        used_tokens: float | None,
        now: float,
        fresh_for: float,
        waiting: float | None = None,
        running: float | None = None,
    ) -> None:
        """A fresh engine sample: KV tokens in use now (None when not published), trusted `fresh_for` s, the
        requests waiting in the engine's queue and those running (None when not published).

        The engine's gauge wins where the two disagree, in both directions, until the next sample:

        * KV in use (this sidecar's share of it) beyond what every lease's current KV explains (other
          traffic, progress under-estimated) is added to every forecast;
        * KV the settled leases provably do not hold is taken off: when nothing waits in the engine, every
          lease admitted more than `settle_after` ago is running there and holds its blocks, so those
          leases hold at most the KV in use. Their prompts (less shared prefixes) and the tokens seen
          streamed are a floor of what they hold while they run, and of what they will hold until they
          end; booked beyond the KV in use, that floor is over-booked for the rest of their lives (a
          prefix shared that the chunks missed, prompts the engine's tokenizer makes shorter, an answer
          the engine finished while its client still reads). Estimated progress and block rounding are
          left out: taking an over-estimate of either off would lower the forecast of each lease's final
          size, which does not depend on them. Leases admitted since may not be in the gauge yet (they
          count as holding nothing); a request waiting (queued, or preempted and waiting to resume) holds
          nothing now but needs its KV back, so with anything waiting nothing is taken off.
        * Leases the engine has finished are booked nothing until the next sample (`_engine_finished`): an
          answer the engine generated whole while its client still reads it (a slow reader in the lean
          profile, whose lease ends with the proxy's report) holds no KV there. Once that finding holds
          over samples, whoever asked (`on_engine_done`) is told, at the end of this call.
        """
        self._fresh_until = now + max(0.0, fresh_for)
        self._seen(now)
        self._unexplained = 0.0
        self._mark_running(running, now)
        self._finished = self._engine_finished(now, waiting, running)
        if used_tokens is not None and math.isfinite(used_tokens):
            self._unexplained = self._correction(max(0.0, used_tokens), now, waiting)
        self._booked = self._book(now)[0]
        self._last_fit = None
        for told in self._engine_done.sample(self._finished, now, self.settle_after()):
            told()

    def _correction(self, used: float, now: float, waiting: float | None) -> float:
        """`observe_engine`'s correction of the forecasts from the KV in use (`used`, the pool's): upward by
        what no lease explains, downward by what the settled leases are booked for beyond the KV in use.

        With the other replicas' figures (`fleet`), their leases explain their part of `used`, and hold at
        least their floor of it. Without them, upward this replica takes its share of `used` as its own,
        as before; downward it compares its settled leases with the whole of `used`: the others may hold
        nothing, and a part of `used` taken for theirs would take off KV this replica's leases hold."""
        explained = settled = 0.0
        settled_before = now - self.settle_after()
        rate, delay = self.decode_rate(), self.pace.first_token_delay
        for lease_id, lease in self._leases.items():
            if lease_id in self._finished:
                continue
            explained += lease.trajectory(now, rate, delay)[0]
            if lease.settled_by(settled_before):
                settled += lease.own_prompt + lease.streamed
        # Downward, the whole gauge: what the others' leases held is one exchange old, and taken off `used`
        # after they released it, left this replica's leases less room than they hold (an idle replica booked
        # -2,903 tokens).
        others = self.fleet.held_by_others(now)
        mine = used * self.budget_share() if others is None else used - others
        if mine > explained:
            return mine - explained
        if waiting == 0 and settled > used:
            return used - settled
        return 0.0

    def budget_share(self) -> float:
        """The fixed share of the pool this replica books against while the others are unknown."""
        fleet = self.fleet
        return min(self._share, fleet.fallback_share) if fleet.shared else self._share

    def share_through_store(self, fallback_share: float) -> None:
        """Replicas share this pool through a store (`Fleet.share_through_store`)."""
        self.fleet.share_through_store(fallback_share)
        self._set_credit_limit()

    def observe_peers(self, peers: Peers | None, now: float) -> None:
        """The other replicas' figures of this pool, as the shared store answered at `now` to the exchange of
        this replica's last figures (`replica_share`) (None: it did not answer; the last answer is trusted
        `kv_fleet.PEERS_FRESH_S`)."""
        self._seen(now)
        self.fleet.observe(peers, now, self._sent_booked)
        self._last_fit = None

    def replica_share(self, now: float) -> ReplicaShare:
        """This replica's figures of the pool for the others (`kv_fleet.ReplicaShare`)."""
        held = 0.0
        settled = candidates = 0
        settled_before = now - self.settle_after()
        rate, delay = self.decode_rate(), self.pace.first_token_delay
        for lease_id, lease in self._leases.items():
            if lease_id in self._finished:
                continue
            held += lease.trajectory(now, rate, delay)[0]
            if lease.settled_by(settled_before):
                settled += lease.sequences
                if self._may_be_finished(lease, now):
                    candidates += lease.sequences
        if self.forecasting(now):
            booked = math.ceil(forecast_peaks(self._trajectories(now))[0])
        else:
            booked = self._demand
        self._sent_booked = booked
        return ReplicaShare(booked, math.ceil(held), settled, candidates)

    def _may_be_finished(self, lease: _Lease, now: float) -> bool:
        """Whether the engine may have finished `lease` unseen (`_engine_finished`'s candidates): a stream
        stalled `settle_after` or more, or an answer nobody sees that a sample counted running."""
        if lease.first_progress is None:
            return lease.engine_ran
        return now - (lease.last_progress_at or now) >= self.settle_after()

    def _seen(self, now: float | None) -> None:
        if now is not None and (self._seen_at is None or now > self._seen_at):
            self._seen_at = now

    def on_engine_done(self, lease_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` once, at a feed sample, when the engine is confirmed to have finished the lease
        while its client still reads (`engine_done`: found so in consecutive samples over `settle_after`);
        never after its release. Nothing for a lease not booked here."""
        if lease_id in self._leases:
            self._engine_done.watch(lease_id, callback)

    def _mark_running(self, running: float | None, now: float) -> None:
        """Marks the leases the engine may have started: this sample counts at least their sequences
        running (those that may be this replica's, `Fleet.running_mine`). A lease nobody sees progress on
        (lean) is found finished only once so marked (`_engine_finished`): before the engine counts it, a
        request can spend seconds in its API server or on the way there, and an engine that runs nothing
        then would have it found finished before it began (in CI's engine tier, vLLM counted a slow reader
        running seconds after the sidecar had given its slot back). Another lease's sequences can stand in
        for its own: a guard against an idle engine's count, not proof."""
        if running is None or not math.isfinite(running):
            return
        count = self.fleet.running_mine(max(0.0, running), now)
        for lease in self._leases.values():
            if not lease.engine_ran and count >= lease.sequences:
                lease.engine_ran = True

    def _engine_finished(self, now: float, waiting: float | None, running: float | None) -> frozenset[str]:
        """The leases the engine has finished, by count: with nothing waiting, every lease admitted more
        than `settle_after` ago runs there (its sequences are among `running`) unless the engine has
        finished it. Where the settled leases' sequences outnumber the engine's running ones, that many are
        done (`Fleet.finished_allowance`: of the whole pool's settled leases where the other replicas' are
        known, divided between the replicas by their candidates; else of this replica's against every
        running sequence, since any of them may be another replica's). They are taken first from streams
        whose progress stopped `settle_after` ago or more (a slow reader's answer reaches the sidecar at its
        client's pace, behind the proxy's full buffers), longest stalled first, then from those whose
        progress nobody sees and that a sample has counted running (`_mark_running`), furthest into their
        expected answer first, never more sequences than the excess. A wrong guess books too little only
        until the next sample: the KV in use that the remaining leases do not explain is added back to every
        forecast."""
        if waiting != 0 or running is None or not math.isfinite(running) or not self.forecasting(now):
            return frozenset()
        settled_before = now - self.settle_after()
        settled = {
            lease_id: lease for lease_id, lease in self._leases.items() if lease.settled_by(settled_before)
        }
        rate, delay = self.decode_rate(), self.pace.first_token_delay

        def progress(item: tuple[str, _Lease]) -> tuple[float, float]:
            lease = item[1]
            done = lease.generated(now, rate, delay)
            fraction = (done or 0.0) / max(1, lease.expected_completion)
            return (-fraction, lease.admitted_at or 0.0)

        def stalled_for(item: tuple[str, _Lease]) -> float:
            return now - (item[1].last_progress_at or now)

        finished: list[str] = []
        unseen = sorted(
            (item for item in settled.items() if item[1].first_progress is None and item[1].engine_ran),
            key=progress,
        )
        # A stream whose progress stopped for `settle_after` is read slower than it was generated (the inline
        # profile sees an answer only as the proxy passes it on, at its client's pace): longest stalled first.
        after = self.settle_after()
        streams = (item for item in settled.items() if item[1].first_progress is not None)
        stalled = sorted(
            (item for item in streams if stalled_for(item) >= after), key=stalled_for, reverse=True
        )
        candidates = [*stalled, *unseen]
        excess = self.fleet.finished_allowance(
            sum(lease.sequences for lease in settled.values()),
            sum(lease.sequences for _, lease in candidates),
            max(0.0, running),
            now,
        )
        for lease_id, lease in candidates:
            if lease.sequences > excess:
                break
            excess -= lease.sequences
            finished.append(lease_id)
        return frozenset(finished)

    def observe_fed_pace(self, tokens_per_second: float | None) -> None:
        """The engine's own decode pace per sequence at the last sample (from its counters, `kvfeed.pace`),
        None when unknown: it bounds the learned pace from above (`decode_rate`)."""
        self._fed_rate = usable_rate(tokens_per_second)

    def decode_rate(self) -> float | None:
        """The pace the forecast takes unseen answers to progress at: the one learned from finished streams,
        or the engine's current one where that is slower. A pace learned from a stream decoded at low load
        runs fast under a full batch; taken as it is, it has admitted answers look further along, and so
        ending sooner, than they are (a burst of forty let in on a pace learned from one warm-up stream
        took the cache to 0.98). A slower pace only makes the forecast keep KV longer. None while none is
        learned: such leases book their whole footprint, as before."""
        learned = self.pace.tokens_per_second
        if learned is None or self._fed_rate is None:
            return learned
        return min(learned, self._fed_rate)

    _assumed_rate: float | None = None  # the pace hints take with no other (`assume_pace`)

    def assume_pace(self, tokens_per_second: float | None) -> None:
        """The pace a refusal's `retry-after` is forecast at where neither a learned nor a fed one exists
        (`admission.assumed_decode_tokens_per_second`): hints only, never what is booked."""
        self._assumed_rate = usable_rate(tokens_per_second)

    def hint_rate(self) -> float | None:
        """The pace a refusal's `retry-after` is forecast at: the forecast's own (`decode_rate`), else the
        engines' pace from the feed, else the assumed one; None with none of them.

        Before a stream has shown a pace the forecast has none (its unseen leases book their whole footprint,
        the safe side), but a hint still needs one: without it the first burst after a start was told a flat
        second while the answers it waited for ran four (the `openai` SDK's two retries spent before
        anything freed: 7 of 40 answered on vLLM). The feed's pace is the engines' own under the batch they
        run now, what the leases will end at."""
        for rate in (self.decode_rate(), self._fed_rate, self._assumed_rate):
            if rate is not None:
                return rate
        return None

    def settle_after(self) -> float:
        """Seconds after admission past which a lease is taken to be in the engine's KV gauge when nothing
        waits there: twice the pool's learned first-token delay, at least 2 s (the request's transfer, the
        engine's tokenizing and a scrape's age)."""
        return max(SETTLE_AFTER_S, 2.0 * self.pace.first_token_delay)

    def expected_completion(self, allowance: int, learner_key: str = "", committed: int = 0) -> int:
        """Completion tokens a request of `learner_key` with this allowance is expected to produce: the
        learned share of the allowance, never below what the request declares it will generate
        (`committed`: `min_tokens`, or the whole allowance under `ignore_eos`), so a key's history of short
        answers cannot shrink the booking of a request that says it will run long."""
        allowance = max(0, int(allowance))
        learned = math.ceil(allowance * self.learner.ratio(learner_key))
        return min(allowance, max(learned, int(committed)))

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
        """Whether a request fits at `now`, and the headroom before it. Capacity unknown: (True, None).

        An empty pool always admits, so a request larger than the budget is not starved forever (the
        server's own length validation bounds it). Without `now` the booking is `lifetime`. With its
        prompt's `chunks`, the prefix it shares with the leases in flight is booked once (module docstring).
        With fair shares, it must also leave the KV another refused request claims (`rank`: its class's
        order, 0 the most important), and a refusal may make it the claimant (not with `claim` False: a
        check on a bound, which the exact count decides again).
        """
        self._seen(now)
        if self._capacity is None:
            return True, None
        chunks = chunks if self._engine_shares else NO_CHUNKS
        candidate = self._new_lease(prompt_tokens, max_completion, learner_key, now, sequences, committed)
        candidate.chunks = chunks
        self._booked, booked_with = self._book_candidate(now, candidate)
        budget = self.budget_tokens or 0  # after the booking: a fleet's budget reads what is booked now
        headroom = budget - self._booked
        # admit() right after this decision books the same request: it reuses the sum just computed.
        self._last_fit = (
            now,
            candidate.prompt,
            candidate.allowance,
            candidate.expected_completion,
            learner_key,
            candidate.sequences,
            chunks,
        )
        self._booked_with = booked_with
        self._over_share = False
        if not self._leases and self.fleet.others_booked(now) <= 0:
            return True, headroom
        claimant = self._claim_id(candidate, rank)
        fair = self.fairness
        if fair is None or now is None:
            fits = booked_with <= budget
        else:
            fits = self._fits_fairly(fair, claimant, candidate, booked_with, now, claim)
        if not fits:
            # What `retry_after` fits in the schedule: this request, its footprint, its run in engine steps.
            self._refused = (
                claimant,
                candidate.footprint,
                candidate.expected_completion / candidate.sequences,
            )
        return fits, headroom

    def _fits_fairly(
        self, fair: FairShare, claimant: ClaimId, candidate: _Lease, booked_with: int, now: float, claim: bool
    ) -> bool:
        """`would_fit` with fair shares: the candidate fits beside another tenant's claim, and its tenant is
        not over its share while another tenant waits (`kv_fairness`). A refusal claims only for a tenant
        within its share (not on a bound's check, nor beyond the whole budget), and its tenant waits."""
        budget = self.budget_tokens or 0
        footprint = candidate.footprint
        over = fair.others_wait(claimant, now) and fair.over_share(
            claimant, self._held_by_tenant(), footprint, now
        )
        fits = not over and booked_with + fair.withheld(claimant, now) <= budget
        self._over_share = over
        if not fits and claim:
            if over:
                fair.waits(claimant, now + fair.claim_ttl_s)
            elif footprint <= budget:  # one larger fits only an empty pool: it neither claims nor waits
                fair.refused(claimant, footprint, now)
        return fits

    def _held_by_tenant(self) -> dict[str, float]:
        """The KV each tenant's leases hold now, by their lifetime footprints (the share guard's measure)."""
        held: dict[str, float] = {}
        for lease in self._leases.values():
            held[lease.learner_key] = held.get(lease.learner_key, 0.0) + lease.footprint
        return held

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
        which it declares it will generate at least `committed` (see `expected_completion`); `chunks`, its
        prompt's leading chunks, are shared with the other leases as the engine's prefix cache shares them.

        Returns the lifetime footprint charged. A lease id already present is a caller bug: ValueError.
        """
        if lease_id in self._leases:
            raise ValueError(f"kv_budget: lease {lease_id!r} already admitted")
        self._seen(now)
        chunks = chunks if self._engine_shares else NO_CHUNKS
        lease = self._new_lease(prompt_tokens, expected_completion, learner_key, now, sequences, committed)
        lease.chunks = chunks
        fit = (
            now,
            lease.prompt,
            lease.allowance,
            lease.expected_completion,
            learner_key,
            lease.sequences,
            chunks,
        )
        booked = self._booked_with if fit == self._last_fit else None
        self._last_fit = None
        self._leases[lease_id] = lease
        self._demand += lease.footprint
        self.credit.take(lease.learner_key, lease.allowance - lease.expected_completion)
        self._credit(self._prefixes.add(lease_id, chunks.hashes), 1)
        self._booked = booked if booked is not None else self._book(now)[0]
        claimant = self._claim_id(lease, rank)
        self.schedule.kept(claimant)
        if self.fairness is not None and now is not None:
            self.fairness.admitted(claimant, lease.footprint, now)
        return lease.footprint

    def progress(self, lease_id: str, streamed_tokens: int, now: float | None = None) -> bool:
        """Cumulative completion tokens streamed so far; the footprint never drops below prompt+streamed.

        With `now`, streamed progress also teaches the pool's decode pace. Returns False for an unknown
        (already released) lease, which is harmless.
        """
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        self._last_fit = None
        before = lease.footprint
        streamed = max(lease.streamed, int(streamed_tokens))
        if now is not None and streamed > 0:
            if lease.first_progress is None:
                lease.first_progress = (now, streamed)
                if lease.admitted_at is not None:
                    self.pace.observe_first_token(now - lease.admitted_at)
            lease.last_progress_at = now
        lease.streamed = streamed
        self._demand += lease.footprint - before
        return True

    def correct_prompt(
        self, lease_id: str, prompt_tokens: int, now: float | None = None, chunks: PromptChunks | None = None
    ) -> bool:
        """Lower a lease's prompt to its exact count (it was booked on a bound, `provisional.py`); never
        raises it. With fair shares and `now`, its tenant's attained service is lowered by as much: counted
        at the bound's footprint, a tenant of short prompts (whose byte bound is about twice their count) had
        received twice its due by that measure, so a tenant of long prompts won every rounding past its
        share and held 54-63 % of the cache per window. With `chunks` (its chunks, their texts' tokens now
        counted), its shared run is credited in tokens. False for an unknown (already released) lease,
        which is harmless."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        self._last_fit = None
        before = lease.footprint
        lease.prompt = max(0, min(lease.prompt, int(prompt_tokens)))
        if chunks is not None and chunks.hashes == lease.chunks.hashes:
            lease.chunks = chunks  # the same chunks, their texts' tokens now counted: credited in tokens
        self._demand += lease.footprint - before
        if self.fairness is not None and now is not None:
            self.fairness.served(lease.learner_key, lease.footprint - before, now)
        return True

    def estimate_progress(self, lease_id: str, tokens: int) -> bool:
        """Completion tokens a request whose stream nobody watches has probably generated (the lean profile,
        from elapsed time and the pool's decode rate): grows its lifetime footprint when it runs past its
        expected length. The forecast does not take it as progress: that estimate counts from admission and
        errs high, and a request taken for further along than it is would be forecast to end too early;
        the forecast estimates unseen progress itself, after the learned first-token delay."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        self._last_fit = None
        before = lease.footprint
        lease.estimated = max(lease.estimated, int(tokens))
        self._demand += lease.footprint - before
        return True

    def observe_unseen_stream(
        self, first_token_after_s: float, tokens_per_sequence: float, seconds: float
    ) -> None:
        """A completed stream this budget did not watch (the lean profile reports it when it ends): its
        first-token delay and its decode rate teach the pool's pace, as a watched stream does on release."""
        self.pace.observe_first_token(first_token_after_s)
        self.pace.observe_stream(tokens_per_sequence, seconds)

    def release(self, lease_id: str, actual_completion: int | None = None) -> bool:
        """Drop a lease; a known `actual_completion` feeds the learned ratio. Double release is a no-op."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._engine_done.forget(lease_id)
        self._last_fit = None
        self._demand -= lease.footprint
        self.credit.give_back(lease.learner_key, lease.allowance - lease.expected_completion)
        self._credit(self._prefixes.remove(lease_id, lease.chunks.hashes), -1)
        if self._unexplained < 0:
            # What the engine took off may have been this lease's over-booking, now gone with it: taken off
            # once, not twice, until the next sample says again.
            self._unexplained = min(0.0, self._unexplained + lease.footprint)
        if actual_completion is not None and lease.allowance > 0:
            self.learner.observe(lease.learner_key, actual_completion / lease.allowance)
        if lease.first_progress is not None and lease.last_progress_at is not None:
            first_at, first_count = lease.first_progress
            tokens = (lease.streamed - first_count) / lease.sequences
            self.pace.observe_stream(tokens, lease.last_progress_at - first_at)
        if not self._leases:
            self._booked = 0
        return True

    # -- internals ---------------------------------------------------------------------------------------

    def _new_lease(
        self,
        prompt: int,
        allowance: int,
        learner_key: str,
        now: float | None,
        sequences: int,
        committed: int = 0,
    ) -> _Lease:
        allowance = max(0, int(allowance))
        learned = self.expected_completion(allowance, learner_key, committed)
        return _Lease(
            prompt=max(0, int(prompt)),
            allowance=allowance,
            expected_completion=self.credit.expected(learner_key, allowance, learned),
            learner_key=learner_key,
            sequences=max(1, int(sequences)),
            admitted_at=now,
            slack=self._block_slack * max(1, int(sequences)),
            margin=self._prefix_margin,
        )

    @staticmethod
    def _claim_id(lease: _Lease, rank: int) -> ClaimId:
        """How the request of `lease` is known on its retries (`kv_fairness`): a client retries one body."""
        chunks = lease.chunks
        if chunks.hashes:
            return ClaimId(rank, lease.learner_key, lease.sequences, (chunks.hashes[-1], chunks.text_chars))
        return ClaimId(rank, lease.learner_key, lease.sequences, (lease.prompt, lease.allowance))

    def _credit(self, changes: dict[str, int], sign: int) -> None:
        """Shared chunks newly credited to (`sign` 1) or paid again by (-1) the leases named."""
        for lease_id, chunks in changes.items():
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._set_credit(lease, lease.credited + sign * chunks)

    def _set_credit(self, lease: _Lease, credited: int) -> None:
        before = lease.footprint
        lease.credited = max(0, credited)
        self._demand += lease.footprint - before

    def _book_candidate(self, now: float | None, candidate: _Lease) -> tuple[int, int]:
        """`_book` with `candidate` added, the chunks it would credit to the leases that hold them credited
        for as long as the sum takes (then as before: the candidate is not admitted yet). The index is only
        read (`PrefixIndex.would_credit`): the check costs the candidate's chunks, not their holders."""
        hashes = candidate.chunks.hashes
        changes = self._prefixes.would_credit(hashes) if hashes else None
        if not changes:
            return self._book(now, candidate)
        alone = self._book(now)[0]
        self._credit(changes, 1)
        try:
            together = self._book(now, candidate)[1]
        finally:
            self._credit(changes, -1)
        return alone, together

    def _trajectories(self, now: float) -> list[Steps]:
        rate, delay = self.decode_rate(), self.pace.first_token_delay
        finished = self._finished
        return [
            lease.trajectory(now, rate, delay)
            for lease_id, lease in self._leases.items()
            if lease_id not in finished
        ]

    def _book(self, now: float | None, extra: _Lease | None = None) -> tuple[int, int]:
        """Tokens booked at `now`, without and with `extra`: the forecast peak while forecasting (plus the
        unexplained engine KV), else the lifetime demand."""
        if not self.forecasting(now):
            return self._demand, self._demand + (extra.footprint if extra is not None else 0)
        assert now is not None
        rate, delay = self.decode_rate(), self.pace.first_token_delay
        added = extra.trajectory(now, rate, delay) if extra is not None else None
        alone, together = forecast_peaks(self._trajectories(now), added)
        return math.ceil(alone + self._unexplained), math.ceil(together + self._unexplained)
