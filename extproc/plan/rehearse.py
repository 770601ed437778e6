"""Rehearsal: replay a traffic sample through the planned limits against the simulated deployment.

Everything runs in one process on virtual time, so a rehearsal is deterministic and takes seconds:

- the engine is the simulator's own clock-free scheduler (`extproc.sim.scheduler.Scheduler` with its
  `BlockPool` and `StepTiming`), sized with the plan's block count, block size and batching limits;
  each `step()` advances the virtual clock by the step's modelled duration;
- admission is the sidecar's own core: `JointLimiter` (slots + TPM bucket, settled to real usage),
  `KvBudget` (booked as the sidecar's default `kv_budget.booking: forecast` does: the peak of the admitted
  requests' KV trajectories plus what the engine's last sample does not explain, against target x
  capacity; `lifetime` books prompt + expected completion for a request's whole life) and
  `AdaptiveController` (KV usage and queue depth sampled once per `feedback_interval_s`, scaling the
  model's limits), all on a `FakeClock` that follows the virtual clock;
- a request is admitted the way the sidecar does it (extproc/admission/deciding/decision.py): context check,
  KV budget, then one slot and `prompt + allowance` tokens on `global` and `model:<name>`; a refused request
  is counted, not retried.

Not modelled: Envoy, the network, HTTP and streaming, tokenizer time, queueing of classes
(`max_wait_seconds`), the asyncio driver of the simulator (its delivery adds no engine time), several
replicas or sidecars. See docs/planning.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.core.clock import FakeClock
from extproc.core.engine.adaptive import AdaptiveConfig, AdaptiveController
from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.limiter.limiter import JointLimiter, Lease, LimitSpec, Rejection
from extproc.plan.traffic import TraceRequest
from extproc.sim.kvcache import BlockPool
from extproc.sim.scheduler import Scheduler, SchedulerConfig, SeqStatus, StepTiming
from extproc.sim.scheduler import Sequence as SimSequence

CONTEXT_LENGTH = "context_length"
KV_BUDGET = "kv_budget"


@dataclass(frozen=True)
class EngineSetup:
    """The simulated replica: what `vllm serve` would allocate and how fast it steps."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    timing: StepTiming

    def validate(self) -> None:
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"cannot rehearse: KV capacity {self.num_gpu_blocks * self.block_size} tokens is below "
                f"max_model_len {self.max_model_len} (vLLM refuses to start); lower --max-model-len"
            )


@dataclass(frozen=True)
class RehearsalLimits:
    """The sidecar settings under test; None disables a mechanism."""

    model: str
    max_tokens: int
    max_concurrency: int | None = None
    tokens_per_minute: int | None = None
    kv_target_utilization: float | None = None
    adaptive: AdaptiveConfig | None = None
    feedback_interval_s: float = 1.0
    kv_booking: BookingMode = BookingMode.FORECAST


@dataclass(frozen=True)
class RehearsalResult:
    """What happened; latencies are engine seconds from arrival."""

    requests: int
    admitted: int
    completed: int
    rejected: dict[str, int]
    preemptions: int
    output_tokens: int
    duration_s: float
    goodput_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    peak_kv_usage: float
    mean_kv_usage: float

    @property
    def rejections(self) -> int:
        return sum(self.rejected.values())

    def to_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "admitted": self.admitted,
            "completed": self.completed,
            "rejections": self.rejections,
            "rejected_by_reason": dict(sorted(self.rejected.items())),
            "preemptions": self.preemptions,
            "output_tokens": self.output_tokens,
            "duration_s": round(self.duration_s, 3),
            "goodput_output_tokens_per_s": round(self.goodput_tokens_per_s, 1),
            "ttft_p50_s": _round(self.ttft_p50_s),
            "ttft_p99_s": _round(self.ttft_p99_s),
            "e2e_p50_s": _round(self.e2e_p50_s),
            "e2e_p99_s": _round(self.e2e_p99_s),
            "peak_kv_usage": round(self.peak_kv_usage, 4),
            "mean_kv_usage": round(self.mean_kv_usage, 4),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(len(ordered), rank) - 1]


@dataclass(eq=False)
class _Flight:
    """An admitted request while the engine works on it."""

    request: TraceRequest
    seq: SimSequence
    lease: Lease | None
    first_token_at: float | None = None


@dataclass
class _Sidecar:
    """The sidecar's admission core for one model pool, on the rehearsal's fake clock."""

    limits: RehearsalLimits
    clock: FakeClock
    capacity_tokens: int
    limiter: JointLimiter = field(init=False)
    budget: KvBudget | None = field(init=False)
    controller: AdaptiveController | None = field(init=False)
    next_sample_at: float = 0.0

    def __post_init__(self) -> None:
        lim = self.limits
        self.limiter = JointLimiter(clock=self.clock)
        spec = LimitSpec(max_concurrency=lim.max_concurrency, tokens_per_minute=lim.tokens_per_minute)
        self.limiter.apply_limits({"global": LimitSpec(), self.key: spec})
        self.budget = None
        if lim.kv_target_utilization is not None:
            self.budget = KvBudget(
                self.capacity_tokens, target_utilization=lim.kv_target_utilization, booking=lim.kv_booking
            )
        self.controller = None
        if lim.adaptive is not None:
            self.controller = AdaptiveController(lim.adaptive, now=self.clock())
            self.limiter.set_scale(self.key, self.controller.state.scale)

    @property
    def key(self) -> str:
        return f"model:{self.limits.model}"

    def admit(self, request: TraceRequest, allowance: int, ident: str) -> Lease | str:
        """A lease, or the rejection reason (as the sidecar's `x-extproc-reject-reason`)."""
        now = self.clock()
        if self.budget is not None:
            fits, _ = self.budget.would_fit(request.prompt_tokens, allowance, now=now)
            if not fits:
                return KV_BUDGET
        result = self.limiter.acquire(["global", self.key], request.prompt_tokens + allowance)
        if isinstance(result, Rejection):
            return result.reason.value
        if self.budget is not None:
            self.budget.admit(ident, request.prompt_tokens, allowance, now=now)
        return result

    def progress(self, ident: str, streamed: int) -> None:
        if self.budget is not None:
            self.budget.progress(ident, streamed, now=self.clock())

    def settle(self, flight: _Flight, ident: str) -> None:
        if flight.lease is not None:
            self.limiter.release(flight.lease, flight.request.prompt_tokens + flight.seq.num_output)
        if self.budget is not None:
            self.budget.release(ident, flight.seq.num_output)

    def sample(self, now: float, kv_usage: float, waiting: int) -> None:
        """The KV feed: one reading per interval drives the adaptive scale and refreshes the budget's
        view of the engine (as `extproc.kvfeed.subscriber.runtime` does on every fresh sample)."""
        if now < self.next_sample_at:
            return
        self.next_sample_at = now + self.limits.feedback_interval_s
        if self.budget is not None:
            fresh_for = (self.limits.adaptive or AdaptiveConfig()).stale_after_seconds
            self.budget.observe_engine(kv_usage * self.capacity_tokens, now, fresh_for)
        if self.controller is not None:
            state = self.controller.observe(kv_usage, float(waiting), newest_sample_at=now, now=now)
            self.limiter.set_scale(self.key, state.scale)


def rehearse(
    requests: Sequence[TraceRequest], engine: EngineSetup, limits: RehearsalLimits | None
) -> RehearsalResult:
    """Replay `requests` (arrival order) with the sidecar's `limits`, or with none (the baseline)."""
    engine.validate()
    return _Run(requests, engine, limits).run()


class _Run:
    def __init__(
        self, requests: Sequence[TraceRequest], engine: EngineSetup, limits: RehearsalLimits | None
    ) -> None:
        self.requests = list(requests)
        self.engine = engine
        self.max_tokens = limits.max_tokens if limits is not None else engine.max_model_len
        self.clock = FakeClock(0.0)
        capacity = engine.num_gpu_blocks * engine.block_size
        self.sidecar = _Sidecar(limits, self.clock, capacity) if limits is not None else None
        pool = BlockPool(engine.num_gpu_blocks, engine.block_size)
        config = SchedulerConfig(engine.max_num_seqs, engine.max_num_batched_tokens)
        self.scheduler = Scheduler(config, pool, engine.timing)
        self.flights: dict[int, _Flight] = {}
        self.rejected: dict[str, int] = {}
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.output_tokens = 0
        self.admitted = 0
        self.last_finish = 0.0
        self.peak_kv = 0.0
        self.kv_time = 0.0

    def run(self) -> RehearsalResult:
        now = 0.0
        index = 0
        sched = self.scheduler
        while index < len(self.requests) or sched.has_work:
            if not sched.has_work and index < len(self.requests):
                now = max(now, self.requests[index].arrival_s)
            self._tick(now)
            while index < len(self.requests) and self.requests[index].arrival_s <= now:
                self._arrive(self.requests[index], index)
                index += 1
            if not sched.has_work:
                continue
            result = sched.step()
            self.kv_time += sched.kv_usage * result.duration
            self.peak_kv = max(self.peak_kv, sched.kv_usage)
            now += result.duration
            self._tick(now)
            for seq in result.emitted:
                self._emitted(seq, now)
        return self._result(now)

    def _tick(self, now: float) -> None:
        self.clock.now = max(self.clock.now, now)
        if self.sidecar is not None:
            sched = self.scheduler
            self.sidecar.sample(now, sched.kv_usage, len(sched.waiting))

    def _arrive(self, request: TraceRequest, index: int) -> None:
        limit = self.engine.max_model_len
        if request.prompt_tokens >= limit:
            self._reject(CONTEXT_LENGTH)
            return
        allowance = min(self.max_tokens, limit - request.prompt_tokens)
        lease: Lease | None = None
        if self.sidecar is not None:
            decision = self.sidecar.admit(request, allowance, str(index))
            if isinstance(decision, str):
                self._reject(decision)
                return
            lease = decision
        output = max(1, min(request.output_tokens, allowance))
        seq = SimSequence(index, request.prompt_tokens, output)
        self.scheduler.add(seq)
        self.flights[index] = _Flight(request, seq, lease)
        self.admitted += 1

    def _reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _emitted(self, seq: SimSequence, now: float) -> None:
        flight = self.flights[seq.seq_id]
        if flight.first_token_at is None:
            flight.first_token_at = now
            self.ttft.append(now - flight.request.arrival_s)
        ident = str(seq.seq_id)
        if self.sidecar is not None:
            self.sidecar.progress(ident, seq.num_output)
        if seq.status is SeqStatus.FINISHED:
            del self.flights[seq.seq_id]
            self.e2e.append(now - flight.request.arrival_s)
            self.output_tokens += seq.num_output
            self.last_finish = now
            if self.sidecar is not None:
                self.sidecar.settle(flight, ident)

    def _result(self, end: float) -> RehearsalResult:
        duration = max(self.last_finish, end)
        return RehearsalResult(
            requests=len(self.requests),
            admitted=self.admitted,
            completed=len(self.e2e),
            rejected=dict(self.rejected),
            preemptions=self.scheduler.num_preemptions,
            output_tokens=self.output_tokens,
            duration_s=duration,
            goodput_tokens_per_s=self.output_tokens / duration if duration > 0 else 0.0,
            ttft_p50_s=percentile(self.ttft, 0.5),
            ttft_p99_s=percentile(self.ttft, 0.99),
            e2e_p50_s=percentile(self.e2e, 0.5),
            e2e_p99_s=percentile(self.e2e, 0.99),
            peak_kv_usage=self.peak_kv,
            mean_kv_usage=self.kv_time / duration if duration > 0 else 0.0,
        )
