"""`EngineTally`: a request's share of what its pool's engines generated, from their counters over time."""

from __future__ import annotations

import pytest

from extproc.core.engine import tally as engine_tally
from extproc.core.engine.tally import EngineTally


def tally_of(*readings: tuple[float, float, float], endpoint: str = "a") -> EngineTally:
    """A tally fed (at, counter, running) readings of one endpoint."""
    tally = EngineTally()
    for at, counter, running in readings:
        tally.observe(endpoint, counter, running, at)
    return tally


def test_alone_on_the_engine_a_request_is_charged_every_token_it_generated_whatever_the_interval() -> None:
    # Idle at 0, four sequences running at 2, idle again at 4 after the abort: 281 tokens generated, all ours,
    # wherever in its intervals the request started and ended (the scrapes fall where they fall).
    tally = tally_of((0.0, 1000.0, 0.0), (2.0, 1200.0, 4.0), (4.0, 1281.0, 0.0))
    assert tally.count(0.5, 3.5, sequences=4) == pytest.approx(281.0)
    assert tally.count(1.5, 2.5, sequences=4) == pytest.approx(281.0)
    # Ended at 1.5 with four sequences running at 2 where nothing but it ran before: its own, run on until
    # the abort reached the engine (up to `SHOWN_AFTER_STOP_S` past its stop; the next test has others).
    assert tally.count(0.5, 1.5, sequences=4) == pytest.approx(281.0 - 81.0)
    # Read at 1.5 + 5 s, four sequences are nobody's to a count: another's, who shares the interval.
    late = tally_of((0.0, 1000.0, 0.0), (6.6, 1200.0, 4.0), (8.0, 1281.0, 0.0))
    assert late.count(0.5, 1.5, sequences=4) == pytest.approx(200.0 * 4.0 / (2.0 * 6.6 + 4.0))


def test_among_steady_others_a_request_gets_its_sequences_share_of_its_own_time() -> None:
    # Six others run throughout at 10 tokens/s each; ours (4 sequences at the same pace) from 1.0 to 2.5.
    tally = tally_of((0.0, 0.0, 6.0), (2.0, 160.0, 10.0), (4.0, 300.0, 6.0))
    # 0-2: 120 from the others, 40 ours over 1 s; 2-4: 120 + 20 ours over 0.5 s.
    assert tally.count(1.0, 2.5, sequences=4) == pytest.approx(60.0)


def test_growth_outside_the_request_is_not_its() -> None:
    tally = tally_of((0.0, 0.0, 2.0), (1.0, 20.0, 2.0), (2.0, 40.0, 0.0), (3.0, 40.0, 0.0))
    assert tally.count(2.5, 3.0, sequences=1) == 0.0


def test_endpoints_sum_and_a_restarted_counter_is_a_new_baseline() -> None:
    tally = EngineTally()
    tally.observe("a", 500.0, 0.0, 0.0)
    tally.observe("b", 900.0, 0.0, 0.05)
    tally.observe("a", 560.0, 2.0, 1.0)
    tally.observe("b", 10.0, 0.0, 1.05)  # b restarted: its new value is a baseline, not -890
    tally.observe("a", 580.0, 0.0, 2.0)
    assert tally.count(0.1, 1.5, sequences=2) == pytest.approx(80.0)


def test_no_count_where_the_points_do_not_reach_around_the_request() -> None:
    tally = tally_of((1.0, 0.0, 0.0), (2.0, 10.0, 1.0))
    assert tally.count(0.5, 1.5, sequences=1) is None  # nothing read before it started
    assert tally.count(1.5, 2.5, sequences=1) is None  # nor after it ended, yet
    assert tally.reaches_back(1.0) and not tally.reaches_back(0.5)
    assert tally.covers(2.0) and not tally.covers(2.5)


def test_a_waiter_is_called_at_the_first_point_past_its_time() -> None:
    tally = tally_of((0.0, 0.0, 0.0))
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
    for i in range(1000):
        tally.observe("a", float(i), 1.0, i * 0.05)  # twice as often as the spacing
    assert len(tally) <= 100
    assert not tally.reaches_back(0.0) and tally.covers(49.9)
    # One sequence ran throughout: at the window's start it counts as another's, at its end as its own run
    # on (`SHOWN_AFTER_STOP_S`), so the share is a hair off.
    assert tally.count(45.0, 49.0, sequences=1) == pytest.approx(80.0, rel=0.02)


def test_a_forgotten_endpoint_starts_again_from_its_next_reading() -> None:
    tally = EngineTally()
    tally.observe("a", 100.0, 1.0, 0.0)
    tally.forget("a")
    tally.observe("a", 300.0, 1.0, 1.0)  # its growth while gone is not known to be anyone's
    tally.observe("a", 310.0, 0.0, 2.0)
    assert tally.count(0.0, 2.0, sequences=1) == pytest.approx(10.0)
    tally.keep(set())
    tally.observe("a", 320.0, 0.0, 3.0)
    assert tally.count(0.0, 3.0, sequences=1) == pytest.approx(10.0)


def test_alone_the_steps_the_abort_found_count_though_read_after_the_end() -> None:
    # Ended at 1.5; the reading at 1.6 still shows its four sequences (the abort not in yet), the one at 2.5
    # the engine idle: the 12 tokens between are its last steps.
    tally = tally_of((0.0, 0.0, 0.0), (1.6, 100.0, 4.0), (2.5, 112.0, 0.0))
    assert tally.count(0.2, 1.5, sequences=4, tail=0.5) == pytest.approx(112.0)
    # Among others still running after its end, what follows it is theirs.
    busy = tally_of((0.0, 0.0, 2.0), (1.6, 100.0, 6.0), (2.5, 130.0, 2.0))
    counted = busy.count(0.2, 1.5, sequences=4, tail=0.5)
    assert counted is not None and counted < 100.0


def test_requests_this_sidecar_admitted_beside_it_are_counted_as_they_ran() -> None:
    # Four single-sequence requests from 0.3 to 3.7, readings every second: 80 tokens each, 320 in all. The
    # running counts alone cannot tell when the others came and went inside an interval: the mean of its
    # ends gives each 0.3/(1.5+0.3) of the first interval's tokens, 91 in all; the others' runs, known here,
    # give each its own.
    readings = [(0.0, 0.0, 0.0), (1.0, 56.0, 4.0), (2.0, 136.0, 4.0), (3.0, 216.0, 4.0), (4.0, 320.0, 0.0)]
    tally = tally_of(*readings)
    assert tally.count(0.3, 3.7, sequences=1) == pytest.approx(90.9, abs=0.1)
    for key in "abcd":
        tally.begin(key, 0.3, 1)
        tally.end(key, 3.7)
    assert tally.count(0.3, 3.7, sequences=1, key="a") == pytest.approx(80.0)


def test_a_closed_loop_of_clients_shares_the_engines_count_by_the_runs_it_saw() -> None:
    # Two clients, one sequence each at 20 tokens/s, each sending its next request as its last one ends:
    # client x at 0-0.5, 0.5-1.7; client y at 0-1.2, 1.2-2.0. Readings at 0, 1 and 2: 2 and 1.7
    # sequence-seconds between them, 40 and 34 tokens.
    tally = tally_of((0.0, 0.0, 0.0), (1.0, 40.0, 2.0), (2.0, 74.0, 0.0))
    for key, start, stop in (("x1", 0.0, 0.5), ("x2", 0.5, 1.7), ("y1", 0.0, 1.2), ("y2", 1.2, 2.0)):
        tally.begin(key, start, 1)
        tally.end(key, stop)
    counts = {
        key: tally.count(start, stop, 1, key=key)
        for key, start, stop in (("x1", 0.0, 0.5), ("x2", 0.5, 1.7), ("y1", 0.0, 1.2), ("y2", 1.2, 2.0))
    }
    assert counts == pytest.approx({"x1": 10.0, "x2": 24.0, "y1": 24.0, "y2": 16.0})


def test_runs_ended_long_ago_are_forgotten() -> None:
    tally = tally_of((0.0, 0.0, 0.0), (1.0, 20.0, 2.0), (2.0, 40.0, 0.0))
    tally.begin("old", 0.0, 1)
    tally.end("old", 2.0)
    for i in range(engine_tally.MAX_ENDED_RUNS):
        tally.begin(f"r{i}", 5.0, 1)
        tally.end(f"r{i}", 6.0)
    # The old run is gone: the one counted shares the intervals with an unknown other, by the running
    # counts at their ends (half of each interval), where the known run ran all of both.
    assert tally.count(0.0, 2.0, sequences=1) == pytest.approx(80 / 3)
    tally.begin("old", 0.0, 1)
    tally.end("old", 2.0)
    tally.end("old", 9.0)  # once
    assert tally.count(0.0, 2.0, sequences=1, key="new") == pytest.approx(20.0)


def test_closing_calls_every_waiter_and_a_failing_one_stops_no_other() -> None:
    tally = tally_of((0.0, 0.0, 0.0))
    called: list[str] = []

    def broken() -> None:
        raise RuntimeError("a waiter's bug")

    tally.after(5.0, broken)
    tally.after(9.0, lambda: called.append("last"))
    tally.close()
    assert called == ["last"] and not tally.covers(5.0)
    tally.after(20.0, lambda: called.append("after the close"))
    assert called == ["last", "after the close"]


def test_a_run_never_ended_is_forgotten_past_any_requests_lifetime() -> None:
    tally = tally_of((0.0, 0.0, 0.0), (1.0, 20.0, 2.0), (2.0, 40.0, 0.0))
    tally.begin("lost", 0.0, 1)  # its end never told
    assert tally.count(0.0, 2.0, sequences=1, key="new") == pytest.approx(20.0)
    tally.begin("much later", engine_tally.MAX_RUN_S + 1.0, 1)
    assert tally.count(0.0, 2.0, sequences=1, key="new") == pytest.approx(80 / 3)


def test_runs_the_engine_ran_on_after_their_clients_left_still_share_every_token() -> None:
    """Two clients in a closed loop, each leaving its stream after 0.4-1.3 s and sending the next at once,
    while the engine runs each on for 0.3-1.2 s until the abort reaches it (a saturated host), one sequence
    at 20 tokens/s. The readings show the aborted runs still running past their stops: counted as this
    sidecar's, not as another replica's, every token the engine generated is someone's share (the sum 747
    of 756; taking them for another replica's gave 458)."""
    pace, lags, waits = 20.0, (0.3, 0.8, 1.2, 0.5), (0.4, 1.3, 0.7, 1.0, 0.9)
    runs: list[tuple[str, float, float, float]] = []  # key, start, the client's stop, the engine's stop
    for client in "xy":
        at = 0.05 if client == "x" else 0.3
        for i in range(12):
            stop = at + waits[(i + len(client + str(i))) % len(waits)]
            runs.append((f"{client}{i}", at, stop, stop + lags[i % len(lags)]))
            at = stop
    end = max(engine_stop for *_, engine_stop in runs)

    def generated(t: float) -> float:
        return sum(pace * max(0.0, min(t, e) - s) for _, s, _, e in runs)

    def running(t: float) -> float:
        return sum(1.0 for _, s, _, e in runs if s < t < e)

    tally = EngineTally()
    for _key, start, _stop, _ in runs:
        tally.begin(_key, start, 1)
    for _key, _start, stop, _ in runs:
        tally.end(_key, stop)
    for tick in range(int(end) + 4):
        tally.observe("a", generated(float(tick)), running(float(tick)), float(tick))
    counts = [tally.count(start, stop, 1, tail=1.5, key=key) for key, start, stop, _ in runs]
    assert all(c is not None for c in counts)
    assert sum(c or 0.0 for c in counts) == pytest.approx(generated(end), rel=0.02)


def test_a_share_under_its_floor_is_lifted_and_later_shares_over_theirs_pay_it_back() -> None:
    tally = EngineTally()
    assert tally.charge(38.0, floor=45.0) == 45.0  # 7 owed
    assert tally.charge(8.0, floor=3.0) == 3.0  # pays 5, never below its own floor
    assert tally.charge(10.0, floor=4.0) == 8.0  # pays the last 2
    assert tally.charge(10.0, floor=4.0) == 10.0  # nothing owed
    assert tally.charge(0.0, floor=engine_tally.MAX_LIFTED * 2) == engine_tally.MAX_LIFTED * 2
    assert tally.charge(engine_tally.MAX_LIFTED * 3, floor=0.0) == engine_tally.MAX_LIFTED * 2  # owed at most


def test_a_run_told_it_ran_longer_moves_its_stop_later_never_earlier() -> None:
    tally = tally_of((0.0, 0.0, 0.0), (2.0, 40.0, 2.0), (4.0, 80.0, 0.0))
    for key in "xy":
        tally.begin(key, 0.0, 1)
    tally.end("x", 1.0)
    tally.ran_until("x", 4.0)  # Envoy read its upstream on until 4 s
    tally.ran_until("x", 3.0)  # an earlier end changes nothing
    tally.ran_until("y", 4.0)  # not ended yet: it ends there
    tally.ran_until("gone", 4.0)  # not kept: nothing
    assert tally.count(0.0, 4.0, 1, key="y") == pytest.approx(40.0)  # each ran the whole 4 s: half


# -- beside other gateway replicas ---------------------------------------------------------------------------


def closed_loop_runs(clients: str) -> list[tuple[str, float, float, float]]:
    """Each client in a closed loop of streams it leaves after 0.4-1.3 s, the engine running each on for
    0.3-1.2 s after (a saturated host): (key, start, the client's stop, the engine's stop)."""
    lags, waits = (0.3, 0.8, 1.2, 0.5), (0.4, 1.3, 0.7, 1.0, 0.9)
    runs: list[tuple[str, float, float, float]] = []
    for n, client in enumerate(clients):
        at = 0.05 + 0.25 * n
        for i in range(12):
            stop = at + waits[(i + n + len(str(i))) % len(waits)]
            runs.append((f"{client}{i}", at, stop, stop + lags[(i + n) % len(lags)]))
            at = stop
    return runs


def fleet_counts(exchange: bool) -> tuple[float, float]:
    """Clients x and z through replica A, y through replica B, one engine at 20 tokens/s a sequence read
    every second by both; each replica's tally tells the other its runs every 0.05 s (`exchange`), as the
    store's exchange does, in time order with the runs' begins and ends. (the counts summed, generated)."""
    pace = 20.0
    runs = closed_loop_runs("xyz")
    end = max(engine_stop for *_, engine_stop in runs)
    replicas = {"A": EngineTally(), "B": EngineTally()}
    home = {key: replicas["B" if key[0] == "y" else "A"] for key, *_ in runs}
    events = [(start, 0, key) for key, start, _, _ in runs] + [(stop, 1, key) for key, _, stop, _ in runs]
    events += [(tick * 0.05, 2, "") for tick in range(int((end + 4) / 0.05))]
    for at, kind, key in sorted(events):
        if kind == 0:
            home[key].begin(key, at, 1)
        elif kind == 1:
            home[key].end(key, at)
        else:
            if exchange:
                replicas["A"].observe_peers({"b": replicas["B"].figures(at)}, at)
                replicas["B"].observe_peers({"a": replicas["A"].figures(at)}, at)
            if at == round(at):
                generated = sum(pace * max(0.0, min(at, e) - s) for _, s, _, e in runs)
                running = sum(1.0 for _, s, _, e in runs if s < at < e)
                for tally in replicas.values():
                    tally.observe("engine", generated, running, at)
    counts = [home[key].count(start, stop, 1, tail=1.5, key=key) for key, start, stop, _ in runs]
    assert all(c is not None for c in counts)
    return sum(c or 0.0 for c in counts), sum(pace * (e - s) for _, s, _, e in runs)


def test_beside_another_replica_each_charges_only_its_share_of_the_late_steps() -> None:
    """Three clients, two through one gateway and one through another, whose streams the engine runs on
    after each client left. Alone, a replica takes the running count's room for its own stopped runs, so
    each took most of the growth (the sum 1.70 times what was generated here; two gateways in front of vLLM
    charged a flood 2.00 times): told each other's runs, 0.994, late steps included."""
    charged, generated = fleet_counts(exchange=True)
    assert charged == pytest.approx(generated, rel=0.03)
    alone, _ = fleet_counts(exchange=False)
    assert alone > 1.5 * generated


def test_a_replica_missing_from_the_stores_answers_a_while_keeps_its_counter() -> None:
    """b's figures expire in the store while it runs two sequences (both replicas frozen, or the store
    stalled): the answers at 1 and 2 miss it. Back at 4 with 8 s more, those 8 s are spread over its gap,
    not taken for a new baseline (lost: the other replica's counts took those steps). Missing past
    `PEER_GAP_S`, it starts a new baseline."""
    peers = engine_tally.PeerRuns()
    peers.observe({"b": engine_tally.RunFigures(100.0, 2.0, 2.0)}, at=0.0)
    peers.observe({}, at=1.0)
    peers.observe({}, at=2.0)
    peers.observe({"b": engine_tally.RunFigures(108.0, 2.0, 2.0)}, at=4.0)
    assert peers.seconds_at(2.0) - peers.seconds_at(0.0) == pytest.approx(4.0)
    assert peers.seconds_at(4.0) - peers.seconds_at(0.0) == pytest.approx(8.0)
    gone = 4.0 + engine_tally.PEER_GAP_S + 1.0
    peers.observe({}, at=gone)
    peers.observe({"b": engine_tally.RunFigures(500.0, 1.0, 1.0)}, at=gone + 1.0)
    assert peers.seconds_at(gone + 1.0) - peers.seconds_at(4.0) == pytest.approx(0.0)


def test_the_figures_a_replica_publishes_sum_its_runs() -> None:
    tally = EngineTally()
    tally.begin("a", 0.0, 2)
    tally.begin("b", 1.0, 1)
    assert tally.figures(2.0) == engine_tally.RunFigures(seconds=5.0, running=3.0, shown=3.0)
    tally.end("a", 2.0)
    tally.ran_until("a", 2.5)  # Envoy read its upstream on: two sequences 0.5 s more
    assert tally.figures(3.0) == engine_tally.RunFigures(seconds=7.0, running=1.0, shown=3.0)
    shown_until = 2.5 + engine_tally.SHOWN_AFTER_STOP_S
    assert tally.figures(shown_until + 0.1).shown == 1.0  # a's stop is past showing
    tally.begin("b", 4.0, 1)  # a key begun again replaces its run: b's first stint is not counted twice
    assert tally.figures(5.0).running == 1.0


def test_the_figures_at_a_reading_that_came_late_are_those_of_its_time() -> None:
    """A sample read at 2.5 reaches the tally at 4.6 (`kvfeed/subscriber/readtime.py`): its point is at 2.5,
    and the runs begun or ended since are taken back from the figures it is read with."""
    tally = EngineTally()
    tally.begin("a", 0.0, 2)
    tally.begin("b", 1.0, 1)
    tally.end("a", 2.0)
    then = tally.figures(2.5)
    assert then == engine_tally.RunFigures(seconds=5.5, running=1.0, shown=3.0)
    tally.begin("c", 3.0, 1)
    tally.end("b", 3.5)
    tally.begin("d", 4.0, 2)
    tally.end("d", 4.5)
    tally.begin("e", 4.6, 1)
    assert tally.figures(2.5) == then
    assert tally.figures(4.6) == engine_tally.RunFigures(seconds=9.1, running=2.0, shown=7.0)


def test_a_stop_told_late_takes_its_seconds_back_from_the_readings_since() -> None:
    """Another replica counted two runs as running past their stops, told later (the lean profile's end
    report): its counter goes back, and the readings since the stops no longer show seconds it never ran.
    Before, the drop was a new baseline and the interval after the stops kept their seconds: the run-ons
    took it for shared, and two gateways charged a flood 0.91-0.97 of what the engine generated."""
    peers = engine_tally.PeerRuns()
    peers.observe({"b": engine_tally.RunFigures(10.0, 2.0, 2.0)}, at=0.0)
    peers.observe({"b": engine_tally.RunFigures(10.4, 2.0, 2.0)}, at=0.2)  # they stopped at 0.1
    peers.observe({"b": engine_tally.RunFigures(10.2, 0.0, 2.0)}, at=0.3)  # told now
    peers.observe({"b": engine_tally.RunFigures(10.2, 0.0, 2.0)}, at=0.8)
    assert peers.seconds_at(0.8) - peers.seconds_at(0.3) == pytest.approx(0.0)
    assert peers.seconds_at(0.3) - peers.seconds_at(0.0) == pytest.approx(0.2)
    assert peers.seconds_at(0.2) <= peers.seconds_at(0.3)  # a counter: it never goes back


def test_the_other_replicas_figures_are_a_counter_each_and_carried_forward_a_while() -> None:
    peers = engine_tally.PeerRuns()
    peers.observe({"b": engine_tally.RunFigures(100.0, 2.0, 3.0)}, at=0.0)
    peers.observe(
        {"b": engine_tally.RunFigures(104.0, 2.0, 2.0), "c": engine_tally.RunFigures(50.0, 1.0, 1.0)}, 2.0
    )
    # c joined with 50 s of its own before: a baseline, not 50 s in this interval.
    assert peers.seconds_at(2.0) - peers.seconds_at(0.0) == pytest.approx(4.0)
    assert peers.seconds_at(1.0) - peers.seconds_at(0.0) == pytest.approx(2.0)  # along the line
    peers.observe(
        {"c": engine_tally.RunFigures(51.0, 0.0, 0.0), "b": engine_tally.RunFigures(1.0, 1.0, 1.0)}, 3.0
    )
    # b's tally began again (its counter went back by more than its runs told late could): a new baseline;
    # c ran 1 s more.
    assert peers.seconds_at(3.0) - peers.seconds_at(2.0) == pytest.approx(1.0)
    assert peers.shown_at(2.5) == 3.0 and peers.shown_at(-1.0) == 0.0
    # Past the last reading: grown at the sequences then running (one), for `PEER_STALE_S` at most.
    assert peers.seconds_at(4.0) - peers.seconds_at(3.0) == pytest.approx(1.0)
    stale = engine_tally.PEER_STALE_S
    assert peers.seconds_at(3.0 + stale + 10) - peers.seconds_at(3.0) == pytest.approx(stale)
    assert peers.shown_at(3.0 + stale + 0.1) == 0.0


def test_a_count_waits_for_the_other_replicas_answer_past_its_time() -> None:
    """The store's exchange stalls: carried from b's last answer, the sequences it showed then fill the
    running count while its seconds stay as they were, and a request counted on that took the steps of the
    runs b began meanwhile (in process, a stream that generated 35 tokens counted 165). The count waits for
    b's next answer past its time, as for the reading; with no other replica in the store, it does not."""
    tally = EngineTally()
    tally.observe_peers({"b": engine_tally.RunFigures(0.0, 0.0, 0.0)}, 0.0)
    tally.observe("a", 0.0, 0.0, 0.0)
    tally.begin("x", 0.5, 1)
    tally.end("x", 1.0)
    called: list[str] = []
    tally.after(2.5, lambda: called.append("x"))
    tally.observe("a", 60.0, 2.0, 3.0)
    assert called == [] and not tally.covers(2.5)
    tally.observe_peers({"b": engine_tally.RunFigures(3.0, 1.0, 1.0)}, 3.2)
    assert called == ["x"] and tally.covers(2.5)
    alone = EngineTally()
    alone.observe_peers({}, 0.0)
    alone.observe("a", 0.0, 0.0, 0.0)
    alone.observe("a", 10.0, 1.0, 3.0)
    assert alone.covers(2.5)


def test_a_replica_says_how_long_none_of_its_runs_has_run() -> None:
    """`RunFigures.idle`: 0 while a run runs (at the time asked, looked back), the time since its last stop
    after, at most `IDLE_SEEN_S`."""
    tally = EngineTally()
    longest = engine_tally.IDLE_SEEN_S
    assert tally.figures(1.0).idle == longest  # nothing ran: at least that
    tally.begin("a", 0.0, 1)
    assert tally.figures(0.5).idle == 0.0
    tally.end("a", 2.0)
    assert tally.figures(5.0).idle == pytest.approx(3.0)
    assert tally.figures(1.5).idle == 0.0  # it ran then
    assert tally.figures(2.0 + longest + 1.0).idle == longest


def test_a_replica_idle_since_a_gap_in_its_answers_ran_its_seconds_before_idling() -> None:
    """b's answers stop for 4 s (the store's exchange stalled); back, it ran 1 s more and has been idle
    3 s: that second is put before its idling (a reading bent there), not spread over the gap. Spread, the
    intervals after a flood's last stop looked shared, and their run-ons' steps went to no count."""
    peers = engine_tally.PeerRuns()
    peers.observe({"b": engine_tally.RunFigures(10.0, 1.0, 1.0)}, at=0.0)
    peers.observe({"b": engine_tally.RunFigures(11.0, 0.0, 1.0, idle=3.0)}, at=4.0)
    ran = [peers.seconds_at(at) - peers.seconds_at(0.0) for at in (0.5, 1.0, 3.5, 4.0)]
    assert ran == [pytest.approx(0.5), pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0)]


def test_a_replica_missing_from_an_answer_is_not_known_to_have_run_nothing() -> None:
    """b's figures expired from the store (it or the store stalled past `REPLICA_TTL_S`): an answer without
    it does not let a count past its last answer be had, until b is back or missing for `MISSING_S` (gone).
    Taken for b running nothing, a stream of 70 ms was counted 407 tokens on the real-engine tier."""
    peers = engine_tally.PeerRuns()
    peers.observe({"b": engine_tally.RunFigures(10.0, 2.0, 2.0)}, at=0.0)
    peers.observe({}, at=5.5)
    assert not peers.known_by(3.0)
    peers.observe({"b": engine_tally.RunFigures(21.0, 0.0, 2.0)}, at=5.6)
    assert peers.known_by(3.0)
    peers.observe({}, at=6.0)
    assert not peers.known_by(5.9)
    peers.observe({}, at=5.6 + engine_tally.MISSING_S + 0.1)  # gone for good: no longer waited for
    assert peers.known_by(10.0)
