"""`EngineTally`: a request's share of what its pool's engines generated, from their counters over time."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from extproc.core.engine import tally as engine_tally
from extproc.core.engine.tally import EngineTally

Reading = tuple[float, float, float]
"""(at, the endpoint's counter, its running sequences)"""
RunSpan = tuple[str, float, float, int]
"""(key, start, stop, sequences): a request of this sidecar's, from its admission to its end here"""


def played(
    readings: Iterable[Reading], runs: Iterable[RunSpan] = (), tally: EngineTally | None = None
) -> EngineTally:
    """A tally told of `runs` and fed `readings` of one endpoint, all in time order (as they come live: a run
    begins and ends before the readings after it)."""
    tally = tally if tally is not None else EngineTally()
    events: list[tuple[float, int, tuple[object, ...]]] = []
    for key, start, stop, sequences in runs:
        events += [(start, 0, ("begin", key, sequences)), (stop, 1, ("end", key))]
    events += [(at, 2, ("observe", counter, running)) for at, counter, running in readings]
    for at, _, event in sorted(events, key=lambda e: (e[0], e[1])):
        if event[0] == "begin":
            tally.begin(event[1], at, int(str(event[2])))
        elif event[0] == "end":
            tally.end(event[1], at)
        else:
            tally.observe("a", float(str(event[1])), float(str(event[2])), at)
    return tally


def test_alone_on_the_engine_a_request_is_charged_every_token_it_generated_whatever_the_interval() -> None:
    # Idle at 0, four sequences running at 2, idle again at 4 after the abort: 281 tokens generated, all ours,
    # wherever in its intervals the request started and ended (the scrapes fall where they fall).
    readings = [(0.0, 1000.0, 0.0), (2.0, 1200.0, 4.0), (4.0, 1281.0, 0.0)]
    assert played(readings, [("r", 0.5, 3.5, 4)]).count("r") == pytest.approx(281.0)
    assert played(readings, [("r", 1.5, 2.5, 4)]).count("r") == pytest.approx(281.0)
    # Ended at 1.5 while four sequences ran at 2: nothing else can be running them, so the engine ran it on
    # until the abort reached it (after 2), and the interval after is its too.
    assert played(readings, [("r", 0.5, 1.5, 4)]).count("r") == pytest.approx(281.0)


def test_among_steady_others_a_request_gets_its_sequences_share_of_its_own_time() -> None:
    # Six unknown sequences run throughout at 10 tokens/s each; ours (4 sequences at the same pace) from 1.0
    # to 2.5, the engine stopping it at once. 0-2: 120 from the others, 40 ours over 1 s; 2-4: 120 + 20 ours
    # over 0.5 s: 40 + 20 by the split (the others at the line between the ends' counts).
    readings = [(0.0, 0.0, 6.0), (2.0, 160.0, 10.0), (4.0, 300.0, 6.0)]
    tally = played(readings, [("r", 1.0, 2.5, 4)])
    assert tally.count("r") == pytest.approx(160.0 * 4 / 16 + 140.0 * 2 / 14)


def test_growth_outside_the_request_is_not_its() -> None:
    readings = [(0.0, 0.0, 2.0), (1.0, 20.0, 2.0), (2.0, 40.0, 0.0), (3.0, 40.0, 0.0)]
    assert played(readings, [("r", 2.5, 2.9, 1)]).count("r") == 0.0


def test_endpoints_sum_and_a_restarted_counter_is_a_new_baseline() -> None:
    tally = EngineTally()
    tally.begin("r", 0.1, 2)
    tally.observe("a", 500.0, 0.0, 0.0)
    tally.observe("b", 900.0, 0.0, 0.05)
    tally.observe("a", 560.0, 2.0, 1.0)
    tally.observe("b", 10.0, 0.0, 1.05)  # b restarted: its new value is a baseline, not -890
    tally.end("r", 1.5)
    tally.observe("a", 580.0, 0.0, 2.0)
    assert tally.count("r") == pytest.approx(80.0)


def test_no_count_where_the_points_do_not_reach_back_to_the_request() -> None:
    tally = played([(1.0, 0.0, 0.0), (2.0, 10.0, 1.0)], [("early", 0.5, 1.5, 1)])
    assert tally.count("early") is None  # nothing read before it started
    assert tally.count("never told") is None
    assert tally.reaches_back(1.0) and not tally.reaches_back(0.5)
    assert tally.covers(2.0) and not tally.covers(2.5)


def test_a_waiter_is_called_at_the_first_point_past_its_time() -> None:
    tally = played([(0.0, 0.0, 0.0)])
    called: list[str] = []
    tally.after(1.5, lambda: called.append("late"))
    tally.after(0.0, lambda: called.append("now"))
    assert called == ["now"]
    tally.observe("a", 5.0, 1.0, 1.0)
    assert called == ["now"]
    tally.observe("a", 9.0, 1.0, 1.6)
    assert called == ["now", "late"]


def test_memory_is_bounded_and_close_readings_share_a_point() -> None:
    tally = EngineTally(max_points=100, min_spacing_s=0.1)
    tally.begin("r", 45.0, 1)
    for i in range(1000):
        if i * 0.05 == 49.0:
            tally.end("r", 49.0)
        tally.observe("a", float(i), 1.0, i * 0.05)  # twice as often as the spacing
    assert len(tally) <= 100
    assert not tally.reaches_back(0.0) and tally.covers(49.9)
    # Its one sequence ran 45-49 (and the one running after is taken for it, run on, to the last point).
    counted = tally.count("r")
    assert counted is not None and counted >= 80.0 and tally.running_on("r")


def test_a_forgotten_endpoint_starts_again_from_its_next_reading() -> None:
    tally = EngineTally()
    tally.begin("r", 0.0, 1)
    tally.observe("a", 100.0, 1.0, 0.0)
    tally.forget("a")
    tally.observe("a", 300.0, 1.0, 1.0)  # its growth while gone is not known to be anyone's
    tally.end("r", 1.5)
    tally.observe("a", 310.0, 0.0, 2.0)
    assert tally.count("r") == pytest.approx(10.0)
    tally.keep(set())
    tally.observe("a", 320.0, 0.0, 3.0)
    assert tally.count("r") == pytest.approx(10.0)


def test_alone_the_steps_the_abort_found_count_though_read_after_the_end() -> None:
    # Ended at 1.5; the reading at 1.6 still shows its four sequences (the abort not in yet), the one at 2.5
    # the engine idle: the 12 tokens between are its last steps.
    tally = played([(0.0, 0.0, 0.0), (1.6, 100.0, 4.0), (2.5, 112.0, 0.0)], [("r", 0.2, 1.5, 4)])
    assert tally.count("r") == pytest.approx(112.0)
    # Beside unknown sequences running before it came, what follows its end is theirs.
    busy = played([(0.0, 0.0, 2.0), (1.6, 100.0, 2.0), (2.5, 130.0, 2.0)], [("r", 0.2, 1.5, 4)])
    counted = busy.count("r")
    assert counted is not None and counted < 100.0


def test_requests_this_sidecar_admitted_beside_it_are_counted_as_they_ran() -> None:
    # Four single-sequence requests from 0.3 to 3.7, readings every second: 80 tokens each, 320 in all.
    readings = [(0.0, 0.0, 0.0), (1.0, 56.0, 4.0), (2.0, 136.0, 4.0), (3.0, 216.0, 4.0), (4.0, 320.0, 0.0)]
    tally = played(readings, [(key, 0.3, 3.7, 1) for key in "abcd"])
    assert [tally.count(key) for key in "abcd"] == pytest.approx([80.0] * 4)


def test_a_closed_loop_of_clients_shares_the_engines_count_by_the_runs_it_saw() -> None:
    # Two clients, one sequence each at 20 tokens/s, each sending its next request as its last one ends:
    # client x at 0-0.5, 0.5-1.7; client y at 0-1.2, 1.2-2.0. Readings at 0, 1 and 2: 2 and 1.7
    # sequence-seconds between them, 40 and 34 tokens.
    spans = [("x1", 0.0, 0.5, 1), ("x2", 0.5, 1.7, 1), ("y1", 0.0, 1.2, 1), ("y2", 1.2, 2.0, 1)]
    tally = played([(-0.1, 0.0, 0.0), (1.0, 40.0, 2.0), (2.05, 74.0, 0.0)], spans)
    counts = {key: tally.count(key) for key, *_ in spans}
    assert sum(c or 0.0 for c in counts.values()) == pytest.approx(74.0)
    assert counts == pytest.approx({"x1": 10.0, "x2": 24.0, "y1": 24.0, "y2": 16.0}, abs=1.0)


def test_runs_ended_long_ago_are_forgotten() -> None:
    readings = [(0.0, 0.0, 0.0), (1.0, 20.0, 2.0), (2.5, 50.0, 0.0)]
    tally = played(readings, [("old", 0.0, 2.0, 1), ("new", 0.0, 2.0, 1)])
    assert tally.count("new") == pytest.approx(25.0)
    for i in range(engine_tally.MAX_ENDED_RUNS):
        tally.begin(f"r{i}", 5.0, 1)
        tally.end(f"r{i}", 6.0)
    assert tally.count("old") is None and tally.count("new") is None  # 20,000 ended since


def test_a_run_never_ended_is_forgotten_past_any_requests_lifetime() -> None:
    tally = played([(0.0, 0.0, 0.0), (1.0, 20.0, 1.0)], [("lost", 0.5, 9e9, 1)])
    assert tally.count("lost") == pytest.approx(20.0)  # its end never told: running still
    tally.begin("much later", engine_tally.MAX_RUN_S + 1.0, 1)
    assert tally.count("lost") is None and tally.figures(engine_tally.MAX_RUN_S + 2.0).running == 1.0


def test_a_run_told_it_ran_longer_moves_its_stop_later_never_earlier() -> None:
    tally = EngineTally()
    tally.observe("a", 0.0, 0.0, 0.0)
    for key in "xy":
        tally.begin(key, 0.0, 1)
    tally.end("x", 1.0)
    tally.ran_until("x", 1.9)  # Envoy read its upstream on until 1.9 s
    tally.ran_until("x", 1.5)  # an earlier end changes nothing
    tally.ran_until("gone", 4.0)  # not kept: nothing
    assert tally.stop_of("x") == 1.9
    tally.observe("a", 40.0, 2.0, 2.0)
    tally.ran_until("y", 4.0)  # not ended yet: it ends there
    tally.ran_until("x", 4.0)
    tally.observe("a", 80.0, 0.0, 4.5)
    assert tally.count("y") == pytest.approx(40.0)  # each ran the whole 4 s: half


def test_a_share_under_its_floor_is_lifted_and_later_shares_over_theirs_pay_it_back() -> None:
    tally = EngineTally()
    assert tally.charge(38.0, floor=45.0) == 45.0  # 7 owed
    assert tally.charge(8.0, floor=3.0) == 3.0  # pays 5, never below its own floor
    assert tally.charge(10.0, floor=4.0) == 8.0  # pays the last 2
    assert tally.charge(10.0, floor=4.0) == 10.0  # nothing owed
    assert tally.charge(0.0, floor=engine_tally.MAX_LIFTED * 2) == engine_tally.MAX_LIFTED * 2
    assert tally.charge(engine_tally.MAX_LIFTED * 3, floor=0.0) == engine_tally.MAX_LIFTED * 2  # owed at most


def test_closing_calls_every_waiter_and_a_failing_one_stops_no_other() -> None:
    tally = played([(0.0, 0.0, 0.0)])
    called: list[str] = []

    def broken() -> None:
        raise RuntimeError("a waiter's bug")

    tally.after(5.0, broken)
    tally.after(9.0, lambda: called.append("last"))
    tally.begin("r", 0.5, 1)
    tally.end("r", 1.0)
    tally.when_done("r", 2.5, lambda: called.append("done"))
    tally.close()
    assert called == ["last", "done"] and not tally.covers(5.0)
    tally.after(20.0, lambda: called.append("after the close"))
    assert called == ["last", "done", "after the close"]
