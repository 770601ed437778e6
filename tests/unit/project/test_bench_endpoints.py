"""The pool-of-engines replay (bench/protection/endpoints.py) is the single-engine replay where it has one
engine, and its engines step in parallel with engine time only moving forward."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from bench.protection import trace as tr
from bench.protection.endpoints import Engines, PoolReplay, pooled
from bench.protection.offline import Replay, policy_for
from bench.protection.run import Deployment, size_limits
from extproc.sim.scheduler import SeqStatus, Sequence, StepResult


@pytest.mark.parametrize("reads", ["fullest", "engine"])
def test_one_engine_replays_as_the_single_engine_replay_does(reads: str) -> None:
    """Either reading of a pool of one is the single engine's: its sum plus spread, or its own budget."""
    dep = Deployment()
    trace = tr.window(tr.load(tr.SAMPLE_DIR, ("conv",)), tr.TRACE_START_S, 120)
    policy = policy_for("feedback", size_limits(dep, trace), dep.max_model_len)
    assert policy is not None
    alone = Replay(trace, dep, policy, 4.0).run()
    pooled_one = PoolReplay(trace, dep, pooled(policy, 1), 4.0, "round_robin", reads, engines=1).run()
    pooled_figures, figures = asdict(pooled_one), asdict(alone)
    assert pooled_figures.pop("reasons") == figures.pop("reasons")
    assert pooled_figures == pytest.approx(figures, nan_ok=True)  # step ends re-added: ulps differ


def test_each_engine_budget_books_what_its_picker_sent_it() -> None:
    """Behind a picker that names the engine first, each engine's budget holds the leases of the requests
    sent there and nothing else, and ends empty."""
    dep = Deployment()
    trace = tr.window(tr.load(tr.SAMPLE_DIR, ("conv",)), tr.TRACE_START_S, 120)
    policy = policy_for("feedback", size_limits(dep, trace), dep.max_model_len)
    assert policy is not None
    run = PoolReplay(trace, dep, pooled(policy, 2), 8.0, "skewed", "engine", engines=2)
    held: list[tuple[int, int]] = []
    step = run.pool.step

    def watched() -> StepResult:
        held.append((run.budgets[0].leases, run.budgets[1].leases))
        return step()

    run.pool.step = watched  # type: ignore[method-assign]
    out = run.run()
    assert out.admitted > 0
    assert max(first for first, _ in held) > max(second for _, second in held) > 0  # 80 % go to the first
    assert [budget.leases for budget in run.budgets] == [0, 0]
    counts = [sum(1 for engine in run.engine_of.values() if engine == i) for i in (0, 1)]
    assert counts[0] > counts[1] > 0


def test_engines_share_the_requests_and_step_in_parallel() -> None:
    engines = Engines(2, Deployment(), "round_robin")
    sequences = [Sequence(i, 100 * (i + 1), 5) for i in range(4)]
    for seq in sequences:
        engines.add(seq)
    assert [len(engine.waiting) for engine in engines.engines] == [2, 2]
    ends, steps = [], 0
    while engines.has_work:
        result = engines.step()
        assert result.duration >= 0
        ends.append(engines.now)
        steps += 1
    assert ends == sorted(ends) and all(seq.status is SeqStatus.FINISHED for seq in sequences)
    alone = Engines(1, Deployment(), "round_robin")
    for seq in [Sequence(i, 100 * (i + 1), 5) for i in range(4)]:
        alone.add(seq)
    while alone.has_work:
        alone.step()
    assert engines.now < alone.now  # two engines ran the same work in less time than one
