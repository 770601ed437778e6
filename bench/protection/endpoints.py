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
from extproc.core.limiter.limiter import LimitSpec
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

    def add(self, seq: SimSequence) -> None:
        """Route the sequence as the balancer would: in turn, or to the engine with the fewest requests."""
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
    """`Replay` against `Engines`, its budget fed the pool's sum, or that and the spread (`fullest`)."""

    def __init__(
        self,
        trace: list[tr.TraceRequest],
        dep: Deployment,
        policy: Policy,
        rate: float,
        balancer: str,
        fullest: bool,
        engines: int = ENGINES,
    ) -> None:
        super().__init__(trace, dep, policy, rate)
        self.pool = Engines(engines, dep, balancer)
        self.sched = self.pool  # type: ignore[assignment]  # one scheduler's interface, several engines
        self.fullest = fullest
        if self.budget is not None:
            self.budget.set_capacity(dep.kv_tokens * engines)

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


def replay(trace: list[tr.TraceRequest], name: str, engines: int, balancer: str, fullest: bool) -> Row:
    """One row: `trace` at `RATE` per engine through `engines` behind `balancer`, the shipped forecast
    budget fed the pool's sum or its fullest endpoint's reading."""
    dep = Deployment()
    policy = policy_for("feedback", size_limits(dep, trace), dep.max_model_len)
    assert policy is not None
    run = PoolReplay(trace, dep, pooled(policy, engines), RATE * engines, balancer, fullest, engines)
    out = run.run()
    reads = "fullest" if fullest else "sum"
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
        runs = [(1, "round_robin", False)]  # one engine alone at the same load per engine
        runs += [(args.engines, balancer, fullest) for balancer in BALANCERS for fullest in (False, True)]
        for engines, balancer, fullest in runs:
            row = replay(trace, name, engines, balancer, fullest)
            print(row.line(), flush=True)
            rows.append(asdict(row))
    result = {"requests": args.requests, "engines": args.engines, "rate_per_engine": RATE, "rows": rows}
    write_json("protection-endpoints.json", result)
    return result


if __name__ == "__main__":
    main()
