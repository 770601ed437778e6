"""Confirming that the engine is done with a lease before its slots go back early (`done.py`), and the
KV budget telling whoever watches its leases (`KvBudget.on_engine_done`), on sample times given."""

from __future__ import annotations

from extproc.core.engine.done import CONFIRM_SAMPLES, EngineDone
from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.completion import CompletionLearner


def told(done: EngineDone, finished: set[str], now: float, hold_s: float = 2.0) -> int:
    """How many callbacks a sample hands out (each run, as the budget runs them)."""
    callbacks = done.sample(finished, now, hold_s)
    for callback in callbacks:
        callback()
    return len(callbacks)


def test_a_lease_is_confirmed_in_consecutive_samples_spanning_the_hold_and_told_once() -> None:
    done, calls = EngineDone(), []
    done.watch("a", lambda: calls.append("a"))
    assert told(done, {"a"}, now=10.0) == 0  # one sample: a guess
    assert told(done, {"a"}, now=11.0) == 0  # two, but within 2 s
    assert told(done, {"a"}, now=12.0) == 1
    assert calls == ["a"]
    assert told(done, {"a"}, now=13.0) == 0  # told once
    assert done.watched == 0


def test_a_sample_that_does_not_find_it_starts_it_over() -> None:
    done, calls = EngineDone(), []
    done.watch("a", lambda: calls.append("a"))
    told(done, {"a"}, now=10.0)
    told(done, set(), now=11.0)  # the stream resumed: the engine runs it
    assert told(done, {"a"}, now=12.0) == 0  # first again
    assert told(done, {"a"}, now=13.0) == 0
    assert told(done, {"a"}, now=14.0) == 1


def test_with_no_hold_two_samples_are_still_needed() -> None:
    done, calls = EngineDone(), []
    done.watch("a", lambda: calls.append("a"))
    assert CONFIRM_SAMPLES == 2
    assert told(done, {"a"}, now=10.0, hold_s=0.0) == 0
    assert told(done, {"a"}, now=10.0, hold_s=0.0) == 1


def test_only_watched_leases_are_kept_and_a_forgotten_one_is_never_told() -> None:
    done, calls = EngineDone(), []
    done.watch("a", lambda: calls.append("a"))
    told(done, {"a", "x", "y"}, now=10.0)
    done.forget("a")
    assert told(done, {"a", "x", "y"}, now=20.0) == 0
    assert calls == [] and done.watched == 0
    assert done.sample({"x"}, 30.0, 0.0) == []


# -- the budget ----------------------------------------------------------------------------------------------


def slow_readers() -> KvBudget:
    """Two answers nobody sees (lean), admitted at 0 and 1, the pool's pace known; `settle_after` is 2 s."""
    learner = CompletionLearner(min_samples=10**6)
    b = KvBudget(100_000, target_utilization=1.0, booking=BookingMode.FORECAST, learner=learner)
    b.pace.observe_stream(100, 1.0)
    b.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    b.admit("a", 100, 2_000, now=0.0)
    b.admit("b", 100, 2_000, now=1.0)
    return b


def test_the_budget_tells_a_watcher_once_the_engine_is_confirmed_done() -> None:
    b, calls = slow_readers(), []
    b.on_engine_done("a", lambda: calls.append("a"))
    b.on_engine_done("b", lambda: calls.append("b"))
    b.on_engine_done("unknown", lambda: calls.append("unknown"))  # not booked here: never told
    assert b.settle_after() == 2.0
    b.observe_engine(2_100, now=30.0, fresh_for=5.0, waiting=0, running=1)  # one done: "a", furthest
    b.observe_engine(2_100, now=31.0, fresh_for=5.0, waiting=0, running=1)
    assert calls == []  # found twice, but over 1 s only
    b.observe_engine(2_100, now=32.0, fresh_for=5.0, waiting=0, running=1)
    assert calls == ["a"]
    b.observe_engine(0, now=33.0, fresh_for=5.0, waiting=0, running=0)
    b.observe_engine(0, now=35.0, fresh_for=5.0, waiting=0, running=0)
    assert calls == ["a", "b"]  # each once


def test_a_lease_that_runs_again_or_is_released_is_not_told() -> None:
    b, calls = slow_readers(), []
    b.on_engine_done("a", lambda: calls.append("a"))
    b.on_engine_done("b", lambda: calls.append("b"))
    b.observe_engine(2_100, now=30.0, fresh_for=5.0, waiting=0, running=1)
    b.observe_engine(4_200, now=31.0, fresh_for=5.0, waiting=0, running=2)  # both run after all
    b.observe_engine(2_100, now=32.0, fresh_for=5.0, waiting=0, running=1)
    b.observe_engine(2_100, now=33.0, fresh_for=5.0, waiting=0, running=1)
    assert calls == []  # found again since 32 s only
    assert b.release("a", 2_000)
    b.observe_engine(0, now=36.0, fresh_for=5.0, waiting=0, running=0)
    b.observe_engine(0, now=40.0, fresh_for=5.0, waiting=0, running=0)
    assert calls == ["b"]  # the released lease is forgotten
