"""A pool of several engines behind a balancer the sidecar cannot steer, in one process on engine time.

The KV budget books one pool: the capacity and the KV in use the feed reports are the sums over the pool's
endpoints. Behind a balancer that does not look at the cache, what the sidecar admits lands on whichever
engine comes next, so one engine can fill while the sum has room. This replay puts `offline.Replay`'s
admission core in front of `--engines` simulated engines of `offline.Deployment`'s size each, the Azure
conversation and code traces at that many times the single engine's rate (`RATE`), behind each of
`BALANCERS`, and compares the budget fed the pool's sum (`aggregate.PoolSnapshot.kv_used_tokens`) with the
sidecar's default reading, that sum plus the spread (`aggregate.spread_tokens`: the KV the pool would hold
were every endpoint as full as the fullest; the feed's `kv_aggregation: max`). The slot and TPM limits are
the single engine's times the engines; one engine alone at `RATE` is the first row of each trace.

Engines step in parallel: each engine without a step under way starts one at the current time, and the
replay takes the step that ends first (`Engines.step`), so engine time only moves forward.

`python -m bench.protection.endpoints` prints the table bench/RESULTS.md quotes and writes
`results/protection-endpoints.json`.
"""

from __future__ import annotations

import argparse
import heapq
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.common import write_json
from bench.protection import trace as tr
from bench.protection.offline import Policy, Replay, policy_for
from bench.protection.run import Deployment, size_limits
from extproc.core.kv.budget import KvBudget
from extproc.core.kv.prefix import NO_CHUNKS, PromptChunks
from extproc.core.limiter.limiter import Lease, LimitSpec
from extproc.kvfeed.subscriber.aggregate import spread_tokens
from extproc.sim.kvcache import BlockPool
from extproc.sim.scheduler import Scheduler, SchedulerConfig, StepResult, StepTiming
from extproc.sim.scheduler import Sequence as SimSequence

ENGINES = 2
RATE = 4.0  # per engine: the offline replay's overload rate
SKEW = 0.8  # the `skewed` balancer's share of the first engine
BALANCERS = ("round_robin", "least_request", "random", "skewed")
"""Envoy's ROUND_ROBIN over the engines a headless Service resolves to; its LEAST_REQUEST (the engine with
fewest requests in it: with two engines Envoy's two random choices see both); `random`: a ClusterIP Service,
where Envoy sees one address and kube-proxy picks an engine per new connection; `skewed`: a picker that
concentrates (`SKEW` of the requests on the first engine, as prefix-aware routing does with a hot prefix)."""


READS = ("sum", "fullest", "engine")
"""What the budget books against: the pool's summed KV in use, that sum plus the spread (the feed's default
`kv_aggregation: max`), or each engine's own, the request checked against the engine the picker named."""


class Engines:
    """`count` schedulers behind a balancer, stepping in parallel, with one scheduler's interface."""

    def __init__(self, count: int, dep: Deployment, balancer: str) -> None:
        timing = StepTiming(
            dep.step_base_ms / 1000, dep.decode_per_seq_ms / 1000, dep.prefill_per_token_ms / 1000
        )
        self.engines = [
            Scheduler(SchedulerConfig(), BlockPool(dep.num_gpu_blocks, dep.block_size), timing)
            for _ in range(count)
        ]
        self.balancer = balancer
        self.turn = 0
        self.random = random.Random(7)
        self.now = 0.0
        self.pending: list[tuple[float, int, StepResult]] = []  # (end, engine, result): steps under way
        self.peaks = [0.0] * count
        self.picked: int | None = None  # the engine a picker chose before admission (`pick`), if any

    def pick(self) -> int:
        """The engine the balancer would send a request to now: in turn, at random, mostly the first
        (`skewed`), or the one with the fewest requests."""
        if self.balancer == "round_robin":
            index = self.turn % len(self.engines)
            self.turn += 1
        elif self.balancer == "random":  # Envoy's RANDOM, or any sticky routing that ignores the cache
            index = self.random.randrange(len(self.engines))
        elif self.balancer == "skewed":  # a picker that concentrates: SKEW of the requests on engine 0
            others = self.random.randrange(1, len(self.engines)) if len(self.engines) > 1 else 0
            index = 0 if self.random.random() < SKEW else others
        else:
            index = min(range(len(self.engines)), key=lambda i: self._requests(i))
        return index

    def add(self, seq: SimSequence) -> None:
        """Route the sequence to the engine picked before its admission, else as the balancer would now."""
        index = self.pick() if self.picked is None else self.picked
        self.picked = None
        self.engines[index].add(seq)

    def _requests(self, index: int) -> int:
        engine = self.engines[index]
        return len(engine.running) + len(engine.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.pending) or any(engine.has_work for engine in self.engines)

    @property
    def waiting(self) -> list[SimSequence]:
        return [seq for engine in self.engines for seq in engine.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(engine.num_preemptions for engine in self.engines)

    @property
    def usages(self) -> list[float]:
        return [engine.kv_usage for engine in self.engines]

    @property
    def kv_usage(self) -> float:
        """The fullest engine's: where the pool preempts first."""
        return max(self.usages)

    def step(self) -> StepResult:
        """Start a step on every engine with work and none under way (at the current time), and hand back
        the one under way that ends first, its duration counted from the current time."""
        started = {index for _, index, _ in self.pending}
        for index, engine in enumerate(self.engines):
            if index not in started and engine.has_work:
                result = engine.step()
                heapq.heappush(self.pending, (self.now + result.duration, index, result))
        end, _, result = heapq.heappop(self.pending)
        result.duration, self.now = end - self.now, end
        self.peaks = [max(peak, usage) for peak, usage in zip(self.peaks, self.usages, strict=True)]
        return result


class PoolReplay(Replay):
    """`Replay` against `Engines`, its budget fed the pool's sum, or that and the spread (`fullest`); or
    (`reads="engine"`) the picker chooses the engine first and each engine has a budget of its own, fed
    that engine's readings alone, as the sidecar books behind a picker it trusts
    (`admission.inference_pool.trust_destination_endpoint`)."""

    def __init__(
        self,
        trace: list[tr.TraceRequest],
        dep: Deployment,
        policy: Policy,
        rate: float,
        balancer: str,
        reads: str,
        engines: int = ENGINES,
    ) -> None:
        super().__init__(trace, dep, policy, rate)
        self.pool = Engines(engines, dep, balancer)
        self.sched = self.pool  # type: ignore[assignment]  # one scheduler's interface, several engines
        self.fullest = reads == "fullest"
        self.budgets: list[KvBudget] = []
        self.engine_of: dict[int, int] = {}  # a request's engine, where each engine has its budget
        if self.budget is not None:
            self.budget.set_capacity(dep.kv_tokens * engines)
        if reads == "engine" and policy.budget is not None:
            self.budgets = [policy.budget(dep.kv_tokens) for _ in range(engines)]
            for budget in self.budgets:
                budget.set_block_tokens(dep.block_size)

    def _sample(self, now: float) -> None:
        """The feed: each engine's own reading to its own budget, where each has one."""
        policy = self.policy
        if not self.budgets or policy is None or now < self.next_sample:
            super()._sample(now)
            return
        budgets, self.budgets, self.budget = self.budgets, [], None
        super()._sample(now)  # the adaptive scale alone
        self.budgets, self.budget = budgets, budgets[0]
        for engine, budget in zip(self.pool.engines, budgets, strict=True):
            used = engine.kv_usage * self.dep.kv_tokens
            budget.observe_engine(used, now, policy.fresh_for_s, float(len(engine.waiting)))

    def _admit(
        self, ident: str, prompt: int, max_tokens: int, now: float, chunks: PromptChunks = NO_CHUNKS
    ) -> Lease | str | None:
        """The picker first, where each engine has its budget: the request is checked against the budget
        of the engine it will run on."""
        if not self.budgets:
            return super()._admit(ident, prompt, max_tokens, now, chunks)
        index = self.pool.picked = self.pool.pick()
        self.budget = self.budgets[index]
        self.engine_of[int(ident.split(".")[0])] = index
        return super()._admit(ident, prompt, max_tokens, now, chunks)

    def _emitted(self, seq: SimSequence, now: float) -> None:
        if self.budgets:
            self.budget = self.budgets[self.engine_of[seq.seq_id]]
        super()._emitted(seq, now)

    def _kv_used_tokens(self) -> float:
        """The pool's summed use, and with `fullest` its spread (the feed's `kv_aggregation: max`)."""
        endpoints = [(usage, self.dep.kv_tokens) for usage in self.pool.usages]
        used = sum(usage * capacity for usage, capacity in endpoints)
        return used + spread_tokens(endpoints) if self.fullest else used


@dataclass(frozen=True)
class Row:
    trace: str
    engines: int
    balancer: str
    budget_reads: str
    preemptions: int
    tok_s_per_engine: float
    ttft_p99_s: float
    kv_peaks: tuple[float, ...]
    admitted: int
    rejected: int

    def line(self) -> str:
        peaks = " / ".join(f"{peak:.2f}" for peak in self.kv_peaks)
        return (
            f"{self.trace:5s} {self.engines} x {self.balancer:14s} {self.budget_reads:8s} "
            f"preempt {self.preemptions:3d}  {self.tok_s_per_engine:6.0f} tok/s/engine  "
            f"TTFT p99 {self.ttft_p99_s:5.2f} s  KV peaks {peaks}  "
            f"admitted {self.admitted} refused {self.rejected}"
        )


def pooled(policy: Policy, engines: int) -> Policy:
    """The single engine's limits times `engines` (the config an operator sizes for the pool)."""
    limits = policy.limits or LimitSpec()
    scaled = LimitSpec(
        max_concurrency=None if limits.max_concurrency is None else limits.max_concurrency * engines,
        tokens_per_minute=None if limits.tokens_per_minute is None else limits.tokens_per_minute * engines,
    )
    return replace(policy, limits=scaled)


def replay(trace: list[tr.TraceRequest], name: str, engines: int, balancer: str, reads: str) -> Row:
    """One row: `trace` at `RATE` per engine through `engines` behind `balancer`, the shipped forecast
    budget fed the pool's sum (`sum`) or its fullest endpoint's reading (`fullest`), or one budget per
    engine behind a picker that names the engine first (`engine`)."""
    dep = Deployment()
    policy = policy_for("feedback", size_limits(dep, trace), dep.max_model_len)
    assert policy is not None
    run = PoolReplay(trace, dep, pooled(policy, engines), RATE * engines, balancer, reads, engines)
    out = run.run()
    peaks = tuple(round(peak, 3) for peak in run.pool.peaks)
    return Row(
        name,
        engines,
        balancer,
        reads,
        out.preemptions,
        out.goodput_tok_s / engines,
        out.ttft_p99_s,
        peaks,
        out.admitted,
        out.rejected,
    )


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(prog="python -m bench.protection.endpoints", description=__doc__)
    parser.add_argument("--requests", type=int, default=800, help="trace requests (default 800)")
    parser.add_argument(
        "--engines", type=int, default=ENGINES, help=f"engines in the pool (default {ENGINES})"
    )
    args = parser.parse_args(argv)
    directory = tr.traces_dir()
    if directory is None:
        print(f"endpoints: Azure traces not found (set ${tr.ENV_VAR}); skipped")
        return None
    rows = []
    for name in ("conv", "code"):
        trace = tr.window(tr.load(directory, (name,)), tr.TRACE_START_S, args.requests)
        runs = [(1, "round_robin", "sum")]  # one engine alone at the same load per engine
        runs += [(args.engines, balancer, reads) for balancer in BALANCERS for reads in READS]
        for engines, balancer, reads in runs:
            row = replay(trace, name, engines, balancer, reads)
            print(row.line(), flush=True)
            rows.append(asdict(row))
    result = {"requests": args.requests, "engines": args.engines, "rate_per_engine": RATE, "rows": rows}
    write_json("protection-endpoints.json", result)
    return result


if __name__ == "__main__":
    main()
