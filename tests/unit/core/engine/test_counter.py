"""A pool's counter summed as its growth over endpoints (extproc/core/engine/counter.py): what the KV budget
reads the engines' prefilled prompt tokens from. A first reading, a restart and a return are baselines."""

from __future__ import annotations

from extproc.core.engine.counter import PoolCounter


def test_growth_over_endpoints_from_each_ones_first_reading() -> None:
    counter = PoolCounter()
    assert not counter.known
    counter.observe("a", 1_000.0)
    counter.observe("b", 50_000.0)  # an endpoint joining with a large count adds nothing
    assert counter.known and counter.total == 0.0
    counter.observe("a", 1_500.0)
    counter.observe("b", 50_100.0)
    assert counter.total == 600.0


def test_a_restart_and_a_return_start_new_baselines() -> None:
    counter = PoolCounter()
    counter.observe("a", 1_000.0)
    counter.observe("a", 1_200.0)
    counter.observe("a", 10.0)  # restarted: its counter went back
    counter.observe("a", 60.0)
    assert counter.total == 250.0
    counter.forget("a")  # down, or no reading
    assert not counter.known
    counter.observe("a", 5_000.0)
    assert counter.total == 250.0
    counter.keep(set())
    assert not counter.known
