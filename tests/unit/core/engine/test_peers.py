"""The other gateway replicas' runs as a charge tally reads them from the store (`PeerRuns`), and what a
replica publishes of its own (`EngineTally.figures`)."""

from __future__ import annotations

import pytest

from extproc.core.engine import peers as engine_peers
from extproc.core.engine import run_on
from extproc.core.engine.peers import PeerRuns, RunFigures
from extproc.core.engine.tally import EngineTally


def test_the_figures_a_replica_publishes_sum_its_runs() -> None:
    tally = EngineTally()
    tally.begin("a", 0.0, 2)
    tally.begin("b", 1.0, 1)
    assert tally.figures(2.0) == RunFigures(seconds=5.0, running=3.0, shown=3.0)
    tally.end("a", 2.0)
    tally.ran_until("a", 2.5)  # Envoy read its upstream on: two sequences 0.5 s more
    tally.observe("e", 0.0, 0.0, -1.0)
    tally.observe("e", 10.0, 1.0, 2.8)  # the engine runs b alone: done with a
    # Shown: b in flight, and a's two sequences, stopped lately (what splits a reading's room).
    assert tally.figures(3.0) == RunFigures(seconds=7.0, running=1.0, shown=3.0)
    shown_until = 2.5 + run_on.SHOWN_AFTER_STOP_S
    assert tally.figures(shown_until + 0.1).shown == 1.0  # a's stop is past the window, found done
    tally.begin("b", 4.0, 1)  # a key begun again replaces its run: b's first stint is not counted twice
    assert tally.figures(5.0).running == 1.0


def test_a_stopped_run_a_reading_found_running_is_shown_past_the_window() -> None:
    tally = EngineTally()
    tally.observe("e", 0.0, 0.0, -1.0)
    tally.begin("a", 0.0, 1)
    tally.end("a", 1.0)
    for second in range(2, 10):
        tally.observe("e", 10.0 * second, 1.0, float(second))  # the engine runs it on (a missed abort)
    assert tally.running_on("a") and tally.figures(9.5).shown == 1.0


def test_the_other_replicas_figures_are_a_counter_each_and_carried_forward_a_while() -> None:
    peers = PeerRuns(max_points=100, min_spacing_s=0.1)
    peers.observe({"b": RunFigures(100.0, 2.0, 3.0)}, at=0.0)
    peers.observe({"b": RunFigures(104.0, 2.0, 2.0), "c": RunFigures(50.0, 1.0, 1.0)}, 2.0)
    # c joined with 50 s of its own before: a baseline, not 50 s in this interval.
    assert peers.seconds_at(2.0) - peers.seconds_at(0.0) == pytest.approx(4.0)
    assert peers.seconds_at(1.0) - peers.seconds_at(0.0) == pytest.approx(2.0)  # along the line
    peers.observe({"c": RunFigures(51.0, 0.0, 0.0), "b": RunFigures(1.0, 1.0, 1.0)}, 3.0)
    # b restarted (its counter went back): a new baseline; c ran 1 s more.
    assert peers.seconds_at(3.0) - peers.seconds_at(2.0) == pytest.approx(1.0)
    assert peers.shown_at(2.5) == 3.0 and peers.shown_at(-1.0) == 0.0
    assert peers.at(2.5).running == 3.0
    assert peers.read_at(2.5) == 2.0 and peers.read_at(-1.0) is None
    # Past the last reading: grown at the sequences then running (one), for `PEER_STALE_S` at most.
    assert peers.seconds_at(4.0) - peers.seconds_at(3.0) == pytest.approx(1.0)
    stale = engine_peers.PEER_STALE_S
    assert peers.seconds_at(3.0 + stale + 10) - peers.seconds_at(3.0) == pytest.approx(stale)
    assert peers.shown_at(3.0 + stale + 0.1) == 0.0 and peers.read_at(3.0 + stale + 0.1) is None
