"""The protection modes' admission core in front of the simulator's scheduler, in one process on engine time.

The full benchmark (`run.py`) drives Envoy, the sidecar and the simulator over HTTP on two shared CPU cores,
so its figures move with the machine's load. This replay keeps only what decides who is admitted and what
the engine does with it: the sidecar's pure core (`JointLimiter`, `KvBudget`, `AdaptiveController`, on a
`FakeClock` that follows engine time), configured from the very config `run.sidecar_config` gives the
sidecar (at time scale 1), and the simulator's clock-free `Scheduler` with its `BlockPool` and step timing.
It is deterministic and takes seconds: the tool to compare budget policies, to bound what any policy can
reach, and to separate what a policy does from what the machine adds. Left out: Envoy and HTTP, tokenizer
time, the scrape's own delay (a feed sample reaches the sidecar the moment it is taken, once per engine
second), and the transfer of finished answers (a lease settles at the engine step that finished it).

The client is the benchmark's: every `stream_every`-th request streams (its progress reaches the budget
token by token), `max_tokens` = the generated tokens rounded up to a power of two, and with `retries` a
refused request comes back after 1 s (the sidecar's `retry-after`), at most that many times; TTFT counts
from the first attempt. Unlike the full benchmark, TTFT (and so SLO goodput) is known for every request.

`python -m bench.protection.offline [--full]` prints the table RESULTS.md quotes and writes
`results/protection-offline[-short].json`.
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.common import percentile, write_json
from bench.protection import trace as tr
from bench.protection.run import MODEL, Deployment, Sizing, shape, sidecar_config, size_limits
from extproc.config import parse_config
from extproc.core.clock import FakeClock
from extproc.core.engine.adaptive import AdaptiveConfig, AdaptiveController
from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.completion import CompletionLearner
from extproc.core.kv.prefix import NO_CHUNKS, PromptChunks
from extproc.core.limiter.limiter import JointLimiter, Lease, LimitSpec, Rejection
from extproc.sim.kvcache import BlockPool, PrefixCachingBlockPool, hash_blocks
from extproc.sim.scheduler import Scheduler, SchedulerConfig, SeqStatus, StepTiming
from extproc.sim.scheduler import Sequence as SimSequence

KEY = f"model:{MODEL}"
RETRY_AFTER_S = 1.0
SLO_TTFT_S = 1.0
OVERLOAD_FROM = 0.1  # as run.OVERLOAD_FROM: KV mean from 10 % of the arrival span to its end


@dataclass(frozen=True)
class Policy:
    """One mode's admission, in engine seconds. `budget` builds the KV budget from the capacity in tokens.

    `oracle`: the client's `max_tokens` is the exact output length and every answer streams, so the budget
    knows each request's size and progress: the best any booking can do. `max_prompt`: refuse longer
    prompts outright (a what-if on the admitted mix, not a mode the sidecar offers).
    """

    limits: LimitSpec | None
    adaptive: AdaptiveConfig | None = None
    budget: Callable[[int], KvBudget] | None = None
    fresh_for_s: float = 5.0
    feed_interval_s: float = 1.0
    oracle: bool = False
    max_prompt: int | None = None


def policy_for(mode: str, sizing: Sizing, context_window: int) -> Policy | None:
    """The benchmark mode's sidecar config (`run.sidecar_config` at time scale 1), as core objects."""
    if mode == "envoy":
        return None
    url = None if mode == "static" else "http://127.0.0.1:1/metrics"
    booking = "lifetime" if mode == "feedback-lifetime" else "forecast"
    config = parse_config(sidecar_config(sizing, 1.0, context_window, url, booking))
    limits = config.limits.models[MODEL]
    if url is None:
        return Policy(limits)
    fb = config.feedback
    settings = fb.kv_budget

    def budget(capacity: int) -> KvBudget:
        return KvBudget(
            capacity,
            target_utilization=settings.target_utilization,
            capacity_share=settings.capacity_share,
            booking=BookingMode(settings.booking),
            prefix_sharing=settings.prefix_sharing,
        )

    adaptive = fb.adaptive_default
    return Policy(limits, adaptive, budget, fresh_for_s=adaptive.stale_after_seconds)


def oracle_budget(target: float) -> Callable[[int], KvBudget]:
    """A forecast budget that trusts `max_tokens` as the exact length (the oracle client sends that)."""

    def build(capacity: int) -> KvBudget:
        learner = CompletionLearner(min_samples=10**9)  # never learns below the exact allowance
        return KvBudget(capacity, target_utilization=target, booking=BookingMode.FORECAST, learner=learner)

    return build


@dataclass(eq=False)
class _Flight:
    ident: str
    arrival: float  # of the first attempt: a retried request's TTFT includes its waits
    stream: bool
    seq: SimSequence
    lease: Lease | None
    first_token_at: float | None = None


@dataclass
class Outcome:
    """What one replay measured, in the units of `run.summarize` (engine seconds)."""

    requests: int
    admitted: int
    rejected: int
    attempts: int
    reasons: dict[str, int]
    preemptions: int
    goodput_tok_s: float
    slo_goodput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    kv_mean_overload: float
    kv_peak: float
    engine_busy_s: float
    prefill_s: float
    prefix_hit_rate: float = math.nan  # the engine's prefix-cache hits over queries (tokens)
    booked_mean: float = math.nan  # the budget's booked tokens over the cache, mean over engine busy time

    def line(self) -> str:
        prefix = "" if math.isnan(self.prefix_hit_rate) else f" prefix hits {self.prefix_hit_rate:.0%}"
        booked = "" if math.isnan(self.booked_mean) else f" booked mean {self.booked_mean:.2f}"
        return (
            f"admitted {self.admitted}/{self.requests} preemptions {self.preemptions} goodput "
            f"{self.goodput_tok_s:.0f} (SLO {self.slo_goodput_tok_s:.0f}) TTFT p50 {self.ttft_p50_s:.2f} "
            f"p99 {self.ttft_p99_s:.2f} KV mean {self.kv_mean_overload:.2f} peak {self.kv_peak:.2f} "
            f"busy {self.engine_busy_s:.1f} s (prefill {self.prefill_s:.1f} s){prefix}{booked} "
            f"refusals {self.reasons}"
        )


@dataclass(frozen=True)
class Prefixes:
    """Each request's prompt as a trace's prefix-block ids (Mooncake's `hash_ids`), `id_tokens` tokens each:
    equal ids are equal text, so the engine's prefix cache (the simulator's `PrefixCachingBlockPool`)
    shares them, and the budget sees them as its chunks (`PromptChunks`, one chunk per id)."""

    ids: list[tuple[int, ...]]
    id_tokens: int

    def token_ids(self, index: int, prompt: int) -> list[int]:
        """`prompt` token ids: id h's k-th token is h x id_tokens + k, so equal ids give equal tokens."""
        size = self.id_tokens
        return [h * size + k for h in self.ids[index] for k in range(size)][:prompt]

    def chunks(self, index: int, prompt: int) -> PromptChunks:
        hashes, parent = [], 0
        for h in self.ids[index]:
            parent = hash((parent, h))
            hashes.append(parent)
        # Each id is a block of `id_tokens` known tokens: a "text" the budget credits whole once shared.
        ends = tuple(range(1, len(hashes) + 1))
        tokens = tuple(min(prompt, self.id_tokens * n) for n in ends)
        return PromptChunks(tuple(hashes), self.id_tokens, max(prompt, 1), ends, tokens)


class Replay:
    """One trace slice at one rate through one policy (None: straight to the engine). With `prefixes` the
    engine caches prompt prefixes as vLLM does, and a budget that shares prefixes is told each prompt's."""

    def __init__(
        self,
        trace: list[tr.TraceRequest],
        dep: Deployment,
        policy: Policy | None,
        rate: float,
        stream_every: int = 4,
        retries: int = 0,
        drain_s: float = 60.0,
        prefixes: Prefixes | None = None,
    ) -> None:
        self.dep = dep
        self.policy = policy
        self.retries = retries
        self.drain_s = drain_s
        self.prefixes = prefixes
        self.clock = FakeClock(0.0)
        timing = StepTiming(
            dep.step_base_ms / 1000, dep.decode_per_seq_ms / 1000, dep.prefill_per_token_ms / 1000
        )
        pool_type = BlockPool if prefixes is None else PrefixCachingBlockPool
        self.sched = Scheduler(SchedulerConfig(), pool_type(dep.num_gpu_blocks, dep.block_size), timing)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.booked_area = 0.0
        oracle = policy is not None and policy.oracle
        self.shapes: list[tuple[int, int, int, bool]] = []
        self.events: list[tuple[float, int, int, int]] = []  # (time, order, request, attempt)
        for i, req in enumerate(trace):
            prompt, want, max_tokens = shape(req, dep.max_model_len)
            stream = oracle or i % stream_every == 0
            self.shapes.append((prompt, want, want if oracle else max_tokens, stream))
            heapq.heappush(self.events, (req.t / rate, i, i, 0))
        self.arrivals = [req.t / rate for req in trace]
        self.span = self.arrivals[-1] if self.arrivals else 0.0
        self.order = len(trace)
        self.limiter = JointLimiter(clock=self.clock)
        self.controller: AdaptiveController | None = None
        self.budget: KvBudget | None = None
        if policy is not None:
            self.limiter.apply_limits({KEY: policy.limits or LimitSpec()})
            if policy.adaptive is not None:
                self.controller = AdaptiveController(policy.adaptive, now=0.0)
                self.limiter.set_scale(KEY, self.controller.state.scale)
            if policy.budget is not None:
                self.budget = policy.budget(dep.kv_tokens)
                self.budget.set_block_tokens(dep.block_size)
        self.next_sample = 0.0
        self.flights: dict[int, _Flight] = {}
        self.reasons: dict[str, int] = {}
        self.ttft: list[float] = []
        self.tokens = 0
        self.slo_tokens = 0
        self.admitted = 0
        self.attempts = 0
        self.final_rejections = 0
        self.kv_area = 0.0
        self.kv_time = 0.0
        self.kv_peak = 0.0
        self.busy = 0.0
        self.prefill = 0.0

    def run(self) -> Outcome:
        now = 0.0
        deadline = self.span + self.drain_s
        sched = self.sched
        while (self.events or sched.has_work) and now < deadline:
            if not sched.has_work and self.events:
                now = max(now, self.events[0][0])
            self.clock.now = max(self.clock.now, now)
            self._sample(now)
            while self.events and self.events[0][0] <= now:
                _, _, index, attempt = heapq.heappop(self.events)
                self._arrive(now, index, attempt)
            if not sched.has_work:
                continue
            result = sched.step()
            self.prefix_queries += result.prefix_queries
            self.prefix_hits += result.prefix_hits
            self._account(now, result.duration, result.num_prefill_tokens)
            now += result.duration
            self.clock.now = now
            for seq in result.emitted:
                self._emitted(seq, now)
        return self._outcome()

    # -- the feed ------------------------------------------------------------------------------------------

    def _sample(self, now: float) -> None:
        policy = self.policy
        if policy is None or now < self.next_sample:
            return
        self.next_sample = now + policy.feed_interval_s
        usage = self.sched.kv_usage
        if self.controller is not None:
            waiting = float(len(self.sched.waiting))
            state = self.controller.observe(usage, waiting, newest_sample_at=now, now=now)
            self.limiter.set_scale(KEY, state.scale)
        if self.budget is not None:
            waiting = float(len(self.sched.waiting))
            self.budget.observe_engine(self._kv_used_tokens(), now, policy.fresh_for_s, waiting)

    def _kv_used_tokens(self) -> float:
        """The KV in use the feed gives the budget: the engine's."""
        return self.sched.kv_usage * self.dep.kv_tokens

    # -- requests ------------------------------------------------------------------------------------------

    def _arrive(self, now: float, index: int, attempt: int) -> None:
        prompt, want, max_tokens, stream = self.shapes[index]
        self.attempts += 1
        ident = f"{index}.{attempt}"
        decision = self._admit(ident, prompt, max_tokens, now, self._chunks(index, prompt))
        if isinstance(decision, str):
            self.reasons[decision] = self.reasons.get(decision, 0) + 1
            if attempt < self.retries:
                self.order += 1
                heapq.heappush(self.events, (now + RETRY_AFTER_S, self.order, index, attempt + 1))
            else:
                self.final_rejections += 1
            return
        seq = SimSequence(index, prompt, want)
        if self.prefixes is not None:
            ids = self.prefixes.token_ids(index, prompt)
            seq.prompt_hashes = hash_blocks(ids, self.dep.block_size, 0)
        self.sched.add(seq)
        self.flights[index] = _Flight(ident, self.arrivals[index], stream, seq, decision)
        self.admitted += 1

    def _chunks(self, index: int, prompt: int) -> PromptChunks:
        budget = self.budget
        if self.prefixes is None or budget is None or not budget.prefix_sharing:
            return NO_CHUNKS
        return self.prefixes.chunks(index, prompt)

    def _admit(
        self, ident: str, prompt: int, max_tokens: int, now: float, chunks: PromptChunks = NO_CHUNKS
    ) -> Lease | str | None:
        """The lease (None without a sidecar), or the refusal reason; the budget is asked first."""
        policy = self.policy
        if policy is None:
            return None
        if policy.max_prompt is not None and prompt > policy.max_prompt:
            return "prompt_cap"
        budget = self.budget
        if budget is not None:
            fits, _ = budget.would_fit(prompt, max_tokens, now=now, chunks=chunks)
            if not fits:
                return "kv_budget"
            budget.admit(ident, prompt, max_tokens, now=now, chunks=chunks)
        result = self.limiter.acquire([KEY], prompt + max_tokens)
        if isinstance(result, Rejection):
            if budget is not None:
                budget.release(ident)
            return str(result.reason.value)
        return result

    def _emitted(self, seq: SimSequence, now: float) -> None:
        flight = self.flights[seq.seq_id]
        if flight.first_token_at is None:
            flight.first_token_at = now
        if flight.stream and self.budget is not None:
            self.budget.progress(flight.ident, seq.num_output, now=now)
        if seq.status is not SeqStatus.FINISHED:
            return
        del self.flights[seq.seq_id]
        self.tokens += seq.num_output
        ttft = flight.first_token_at - flight.arrival
        self.ttft.append(ttft)
        if ttft <= SLO_TTFT_S:
            self.slo_tokens += seq.num_output
        if flight.lease is not None:
            self.limiter.release(flight.lease, seq.prompt_tokens + seq.num_output)
        if self.budget is not None:
            self.budget.release(flight.ident, seq.num_output)

    # -- figures -------------------------------------------------------------------------------------------

    def _account(self, now: float, duration: float, prefill_tokens: int) -> None:
        usage = self.sched.kv_usage
        if OVERLOAD_FROM * self.span <= now <= self.span:
            self.kv_area += usage * duration
            self.kv_time += duration
        self.kv_peak = max(self.kv_peak, usage)
        if self.budget is not None:
            self.booked_area += self.budget.booked_tokens / self.dep.kv_tokens * duration
        self.busy += duration
        self.prefill += prefill_tokens * self.dep.prefill_per_token_ms / 1000

    def _outcome(self) -> Outcome:
        span = self.span or math.nan
        return Outcome(
            requests=len(self.arrivals),
            admitted=self.admitted,
            rejected=self.final_rejections,
            attempts=self.attempts,
            reasons=dict(sorted(self.reasons.items())),
            preemptions=self.sched.num_preemptions,
            goodput_tok_s=self.tokens / span,
            slo_goodput_tok_s=self.slo_tokens / span,
            ttft_p50_s=percentile(self.ttft, 50),
            ttft_p99_s=percentile(self.ttft, 99),
            kv_mean_overload=self.kv_area / self.kv_time if self.kv_time else math.nan,
            kv_peak=self.kv_peak,
            engine_busy_s=self.busy,
            prefill_s=self.prefill,
            prefix_hit_rate=self.prefix_hits / self.prefix_queries if self.prefix_queries else math.nan,
            booked_mean=self.booked_area / self.busy if self.budget is not None and self.busy else math.nan,
        )


def scenarios(sizing: Sizing, context_window: int) -> list[tuple[str, Policy | None]]:
    """The benchmark's modes, plus what bounds them: an oracle client, and a mix without long prompts."""
    forecast = policy_for("feedback", sizing, context_window)
    assert forecast is not None and forecast.adaptive is not None
    # At target 1.0 the adaptive KV term (0.92-0.98) would bind first: keep only its queue term.
    unwatched = replace(forecast.adaptive, low_watermark=0.99, high_watermark=1.0)
    return [
        ("envoy", None),
        ("static", policy_for("static", sizing, context_window)),
        ("feedback-lifetime", policy_for("feedback-lifetime", sizing, context_window)),
        ("feedback", forecast),
        ("feedback, oracle client", replace(forecast, budget=oracle_budget(0.9), oracle=True)),
        (
            "feedback, oracle client, target 1.0",
            replace(forecast, budget=oracle_budget(1.0), oracle=True, adaptive=unwatched),
        ),
        ("feedback, prompts over 1,200 refused", replace(forecast, max_prompt=1200)),
    ]


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(prog="python -m bench.protection.offline", description=__doc__)
    parser.add_argument("--full", action="store_true", help="the full run's 1,200 requests (default 400)")
    args = parser.parse_args(argv)
    directory = tr.traces_dir()
    if directory is None:
        print(f"offline: Azure traces not found (set ${tr.ENV_VAR}); skipped")
        return None
    dep = Deployment()
    trace = tr.window(tr.load(directory, ("conv",)), tr.TRACE_START_S, 1200 if args.full else 400)
    sizing = size_limits(dep, trace)
    rows = []
    modes = scenarios(sizing, dep.max_model_len)
    runs = [(4.0, retries, name, policy) for retries in (0, 3) for name, policy in modes]
    if args.full:  # the benchmark's modes at the lower rates too
        runs = [(rate, 0, name, policy) for rate in (1.0, 2.0) for name, policy in modes[:4]] + runs
    for rate, retries, name, policy in runs:
        if retries and (policy is None or policy.oracle or policy.max_prompt is not None):
            continue
        outcome = Replay(trace, dep, policy, rate, retries=retries).run()
        label = f"{rate:g}x {name}" + (f", retry {retries}" if retries else "")
        print(f"{label:44s} {outcome.line()}", flush=True)
        rows.append({"scenario": name, "retries": retries, "rate": rate, **asdict(outcome)})
    result = {"requests": len(trace), "short": not args.full, "rows": rows}
    write_json(f"protection-offline{'' if args.full else '-short'}.json", result)
    return result


if __name__ == "__main__":
    main()
