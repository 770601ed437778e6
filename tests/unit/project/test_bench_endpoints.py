"""The pool-of-engines replay (bench/protection/endpoints.py) is the single-engine replay where it has one
engine, and its engines step in parallel with engine time only moving forward."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from bench.protection import trace as tr
from bench.protection.endpoints import Engines, PoolReplay, pooled
from bench.protection.offline import Replay, policy_for
from bench.protection.run import Deployment, size_limits
from extproc.sim.scheduler import SeqStatus, Sequence


def test_one_engine_replays_as_the_single_engine_replay_does() -> None:
    dep = Deployment()
    trace = tr.window(tr.load(tr.SAMPLE_DIR, ("conv",)), tr.TRACE_START_S, 120)
    policy = policy_for("feedback", size_limits(dep, trace), dep.max_model_len)
    assert policy is not None
    alone = Replay(trace, dep, policy, 4.0).run()
    pooled_one = PoolReplay(trace, dep, pooled(policy, 1), 4.0, "round_robin", fullest=True, engines=1).run()
    pooled_figures, figures = asdict(pooled_one), asdict(alone)
    assert pooled_figures.pop("reasons") == figures.pop("reasons")
    assert pooled_figures == pytest.approx(figures, nan_ok=True)  # step ends re-added: ulps differ


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
