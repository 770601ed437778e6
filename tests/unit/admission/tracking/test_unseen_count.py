"""An answer not seen to its end at the engine's own pace (nothing of it seen, a stream left before the
proxy's buffers filled) is charged what the engines counted for it (`InFlight._charge_counted`): the feed's
generation counters over the request's time (`core.engine_tally`), read once the feed is past its end; the
rules without a count (the pace estimate, what passed) where the feed has no counters, does not reach back
to the admission, does not read the engines in time, or counts far less than passed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.replies.verdicts import Forward, Refusal
from extproc.admission.tracking import engine_run
from extproc.admission.tracking.reading import ReportedTiming, ResponseReading
from extproc.core.engine.tally import ENGINE_STOP_S, EngineTally, RunFigures
from tests.support.admission import AdmissionRig

CONFIG = {"models": {"*": {"context_window": 8000, "default_max_tokens": 100}}}
HEAD = RequestHead("POST", "/v1/completions", {})

LEARNED = 56.0
"""The pool's learned pace per sequence (single answers): 1.5 s of four sequences at it is 336 tokens, where
the engine, decoding four together, generated 281."""


def four_sequences() -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1000, "n": 4}).encode()


def stream_of_four() -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1000, "n": 4, "stream": True}).encode()


class Rig(AdmissionRig):
    """Admission over an in-process store and a fake clock, its pool's engines tallied by the test."""

    def __init__(self, tally: EngineTally | None, config: dict[str, Any] = CONFIG) -> None:
        super().__init__(config)
        self.admission.service.deps.engine_tally = lambda _pool: tally
        self.admission.service.paces.observe("*", LEARNED * 100, 100.0)

    async def decide(self, exchange: Exchange, body: bytes | None = None) -> Forward | Refusal:
        exchange.request_headers(HEAD)
        verdicts = [v async for v in exchange.request_body(body or four_sequences())]
        assert isinstance(verdicts[-1], Forward | Refusal)
        return verdicts[-1]

    async def settled(self) -> None:
        await self.admission.service.drain()

    async def settled_soon(self) -> None:
        """What the loop settles without the feed reading on."""
        for _ in range(5):
            await asyncio.sleep(0)


async def rig_with(tally: EngineTally | None) -> Rig:
    return await Rig(tally).start()


def completion(rig: Rig) -> float:
    return rig.metric("extproc_tokens_settled_total", model="other", kind="completion")


def basis(rig: Rig, name: str) -> float:
    return rig.metric("extproc_unfinished_answers_total", model="other", basis=name)


async def left_after(rig: Rig, seconds: float, reported: bool = False) -> Exchange:
    exchange = rig.admission.exchange(reported=reported)
    assert isinstance(await rig.decide(exchange), Forward)
    rig.clock.advance(seconds)
    exchange.stream_ended()  # the client left before the answer's headers
    return exchange


async def four_left_while_read(tally: EngineTally) -> tuple[Rig, float]:
    """`four_sequences` left after 1.5 s, the engines read idle 0.7 s before it came and running its four at
    1.3 s: its rig, and when it came."""
    rig = await rig_with(tally)
    start = rig.clock()
    tally.observe("node ep", 1000.0, 0.0, start - 0.7)
    await left_after(rig, 1.5)
    tally.observe("node ep", 1200.0, 4.0, start + 1.3)
    return rig, start


async def test_inline_a_body_left_is_charged_the_engines_count_once_the_feed_is_past_its_end() -> None:
    tally = EngineTally()
    rig, start = await four_left_while_read(tally)
    for _ in range(3):
        await asyncio.sleep(0)  # the store's release runs on the loop
    assert rig.active == 0  # its slot is back at once: the engine stops within a step
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 0  # its count is not in yet
    tally.observe("node ep", 1281.0, 0.0, start + 1.5 + ENGINE_STOP_S / 2)
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 0  # read too soon after the end
    tally.observe("node ep", 1281.0, 0.0, start + 1.5 + ENGINE_STOP_S)
    await rig.settled()
    assert completion(rig) == 281  # what the engine generated, not 336 at the pace of single answers
    assert basis(rig, "engine_count") == 1 and basis(rig, "estimate") == 0
    assert rig.metric("extproc_slots_released_early_total", model="other") == 0  # the client did not read on


async def test_a_body_the_engine_decoded_on_after_its_client_left_is_charged_the_run_on_too() -> None:
    """The engine missed the abort (vLLM #54947): its four sequences run on past the reading the count waits
    for; the lease settles once the engine stops, charged its count and the steps after it (the run-on,
    `extproc_tokens_run_on_total`), within its reservation."""
    tally = EngineTally()
    rig, start = await four_left_while_read(tally)
    tally.observe("node ep", 1400.0, 4.0, start + 1.5 + ENGINE_STOP_S)
    await rig.settled_soon()
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 0  # it waits for the run-on
    tally.observe("node ep", 1900.0, 4.0, start + 6.0)
    tally.observe("node ep", 2000.0, 0.0, start + 7.0)  # the engine stopped
    await rig.settled()
    # Its count up to the reading it waits for (400: the 200 before it stopped, and the interval it stopped
    # in, its four sequences taken for still running where nothing else could be: `SHOWN_AFTER_STOP_S`;
    # 238 when only its own time in it counted), then every token generated after that reading, when
    # nothing else ran (600): the 1,000 generated.
    assert completion(rig) == 1000
    assert rig.metric("extproc_tokens_run_on_total", model="other") == 600
    assert basis(rig, "engine_count") == 1


async def test_lean_an_expired_lease_is_charged_the_engines_count() -> None:
    """No end report within the wait (the access log lost): by then the feed has read past the end."""
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    tally.observe("node ep", 0.0, 0.0, start - 0.5)
    await left_after(rig, 2.0, reported=True)
    tally.observe("node ep", 150.0, 4.0, start + 1.0)
    tally.observe("node ep", 240.0, 0.0, start + 2.0 + ENGINE_STOP_S)
    [waiting] = rig.admission.unseen.awaiting_reports()
    waiting.expire()
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="expired") == 1
    assert completion(rig) == 240
    assert rig.admission.unseen.awaiting_reports() == []


async def test_lean_a_report_with_no_response_is_charged_the_engines_count() -> None:
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    tally.observe("node ep", 0.0, 0.0, start)
    exchange = rig.admission.exchange(reported=True)
    verdict = await rig.decide(exchange)
    assert isinstance(verdict, Forward) and verdict.report is not None
    rig.clock.advance(1.5)
    exchange.stream_ended()
    rig.admission.unseen.report(verdict.report.key, None, ResponseReading())
    assert rig.admission.unseen.awaiting_reports() == []  # settled here: a second report finds nothing
    tally.observe("node ep", 200.0, 0.0, start + 1.5 + ENGINE_STOP_S)
    await rig.settled()
    assert completion(rig) == 200


@pytest.mark.parametrize("fed", ["none", "too_late"])
async def test_without_counters_reaching_back_to_the_admission_the_pace_estimate_stands(fed: str) -> None:
    tally = EngineTally() if fed == "too_late" else None
    rig = await rig_with(tally)
    if tally is not None:
        tally.observe("node ep", 0.0, 0.0, rig.clock() + 0.1)  # the feed's first reading came after it
    await left_after(rig, 1.5)
    await rig.settled()
    assert completion(rig) == 336  # 1.5 s x 4 x 56
    assert basis(rig, "estimate") == 1 and basis(rig, "engine_count") == 0


async def test_a_feed_that_does_not_read_the_engines_in_time_leaves_the_pace_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_run, "ENGINE_COUNT_WAIT_S", 0.01)
    tally = EngineTally()
    rig = await rig_with(tally)
    tally.observe("node ep", 0.0, 0.0, rig.clock())
    await left_after(rig, 1.5)
    await rig.settled()  # no reading after the end comes
    assert completion(rig) == 336
    assert basis(rig, "estimate") == 1
    assert rig.active == 0


async def test_a_feed_stopped_while_a_lease_waits_leaves_it_the_pace_estimate_at_once() -> None:
    """Shutdown stops the feed before it drains the leases (or a reload restarts it): a lease waiting for
    its count is charged the pace estimate then, not after `ENGINE_COUNT_WAIT_S`."""
    tally = EngineTally()
    rig = await rig_with(tally)
    tally.observe("node ep", 0.0, 0.0, rig.clock())
    await left_after(rig, 1.5)
    tally.close()
    await asyncio.wait_for(rig.settled(), 1.0)
    assert completion(rig) == 336 and basis(rig, "estimate") == 1


async def test_a_share_among_others_is_charged_to_the_nearest_token() -> None:
    """Six other sequences ran throughout its 1.5 s in an interval of 4.5 s and 414 tokens: its four ran 6
    of the 33 sequence-seconds, 75.27 tokens. Charged 75: rounding each share up would charge a flood of
    such requests half a token each more than the engines generated."""
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    tally.observe("node ep", 0.0, 6.0, start - 1.5)
    await left_after(rig, 1.5)
    assert ENGINE_STOP_S == 1.5  # the first reading it waits for is 3 s after its start
    tally.observe("node ep", 414.0, 6.0, start + 3.0)
    await rig.settled()
    assert completion(rig) == 75


# -- streams left mid-answer -------------------------------------------------------------------------------


def text_event(index: int) -> bytes:
    return b'data: {"choices":[{"index":%d,"text":"a"}]}\n\n' % index


async def stream_left(rig: Rig, steps: int, seconds: float) -> None:
    """A stream of four sequences whose client left `seconds` after its admission, `steps` tokens of each
    passed."""
    exchange = rig.admission.exchange()
    assert isinstance(await rig.decide(exchange, stream_of_four()), Forward)
    exchange.response_headers(200, "text/event-stream", end_of_stream=False)
    for _ in range(steps):
        for index in range(4):
            await exchange.response_body(text_event(index), False)
    rig.clock.advance(seconds)
    exchange.stream_ended()


def idle_before(tally: EngineTally, start: float) -> None:
    tally.observe("node ep", 0.0, 0.0, start - 0.5)


def fed_alone(tally: EngineTally, start: float, generated: float, seconds: float) -> None:
    """After the feed read the engine idle before `start` (`idle_before`): running the stream's four
    sequences in it, and idle again `ENGINE_STOP_S` past its end, `generated` tokens later."""
    tally.observe("node ep", generated / 2, 4.0, start + seconds / 2)
    tally.observe("node ep", generated, 0.0, start + seconds + ENGINE_STOP_S)


async def test_inline_a_stream_left_is_charged_the_engines_count() -> None:
    """The engine ran on until the abort reached it: 30 generated where 12 passed, not one step more (16)."""
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    idle_before(tally, start)
    await stream_left(rig, steps=3, seconds=1.0)
    for _ in range(3):
        await asyncio.sleep(0)  # the store's release runs on the loop
    assert rig.active == 0  # its slot is back at once: the engine stops within a step
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 0  # its count is not in yet
    fed_alone(tally, start, 30.0, 1.0)
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 1
    assert completion(rig) == 30
    assert basis(rig, "engine_count") == 1 and basis(rig, "estimate") == 0


async def test_a_share_below_what_passed_is_lifted_to_it_and_the_next_share_pays_it_back() -> None:
    """Counted 11 where 12 passed (a share errs either way): charged the 12 that certainly passed; the next
    stream's share of 30 is charged 29, so the two sum to the engines' 41."""
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    idle_before(tally, start)
    await stream_left(rig, steps=3, seconds=1.0)
    fed_alone(tally, start, 11.0, 1.0)
    await rig.settled()
    assert completion(rig) == 12
    rig.clock.advance(3.0)  # past the first's last reading
    start = rig.clock()
    tally.observe("node ep", 11.0, 0.0, start - 0.5)
    await stream_left(rig, steps=3, seconds=1.0)
    tally.observe("node ep", 26.0, 4.0, start + 0.5)
    tally.observe("node ep", 41.0, 0.0, start + 1.0 + ENGINE_STOP_S)
    await rig.settled()
    assert completion(rig) == 12 + 29
    assert basis(rig, "engine_count") == 2


async def test_a_count_far_below_what_passed_is_a_missed_reading_and_what_passed_is_charged() -> None:
    """Four tokens counted where twelve passed (an endpoint's counter restarted within the stream, say): not
    the split's noise; charged what passed in whole steps and the step the abort let finish."""
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    idle_before(tally, start)
    await stream_left(rig, steps=3, seconds=1.0)
    fed_alone(tally, start, 4.0, 1.0)
    await rig.settled()
    assert completion(rig) == 4 * (3 + 1)
    assert basis(rig, "estimate") == 1 and basis(rig, "engine_count") == 0


HELD_CONFIG: dict[str, Any] = {**CONFIG, "admission": {"proxy_buffer_bytes": 64}}
"""A proxy that buffers 64 bytes for a reader: two events fill it, and a reader may have held the stream's
bytes back from then on."""


async def test_a_stream_a_reader_held_back_is_charged_the_engines_count_too() -> None:
    """Over the proxy's buffer the engine ran ahead of the client (an engine never waits for a reader), so
    what passed, or a pace over the stream's time, is not what it generated: its count is (30 where 12
    passed)."""
    tally = EngineTally()
    rig = await Rig(tally, HELD_CONFIG).start()
    start = rig.clock()
    idle_before(tally, start)
    await stream_left(rig, steps=3, seconds=1.0)
    fed_alone(tally, start, 30.0, 1.0)
    await rig.settled()
    assert basis(rig, "engine_count") == 1 and basis(rig, "estimate") == 0
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 1
    assert completion(rig) == 30


def test_a_run_is_counted_to_where_the_engine_stopped_it() -> None:
    """The first end told is the engine's (the feed found it done while the client still read), moved later
    only by a later read of its upstream; without one, the request's own end."""
    run = engine_run.EngineRun(EngineTally(), "lease", 0.0, 1)
    assert run.stopped_at(9.0) == 9.0
    run.end(2.0)
    run.end(5.0)  # the client's close, after the engine was done
    assert run.stopped_at(5.0) == 2.0
    run.ran_until(1.0)
    assert run.stopped_at(5.0) == 2.0
    run.ran_until(4.0)
    assert run.stopped_at(5.0) == 4.0


def test_a_run_on_a_picked_engine_is_known_to_the_pools_tally_too() -> None:
    """A request booked on its engine is counted from that engine's tally, and told to the pool's as well:
    there it is a run the pool's tally knows (its sequence-seconds beside the pool's own requests), not room
    the pool's running count leaves, which a pool's request stopped lately could be charged for."""
    engine, pool = EngineTally(), EngineTally()
    run = engine_run.EngineRun(engine, "lease", 0.0, 2, beside=pool)
    run.end(3.0)
    run.ran_until(4.0)
    assert engine.stop_of("lease") == pool.stop_of("lease") == 4.0
    assert engine_run.EngineRun(engine, "other", 0.0, 1).tally is engine
    assert pool.stop_of("other") is None


async def test_a_count_cancelled_while_it_waits_for_a_run_on_waits_no_more() -> None:
    """Shutdown cancels a count waiting for the engine to stop running on: the pool's run-ons forget it (it
    is no longer published as waiting, nor told later)."""
    tally = EngineTally()
    tally.observe("node ep", 0.0, 0.0, 0.0)
    run = engine_run.EngineRun(tally, "lease", 0.5, 1)
    run.end(1.0)
    tally.observe("node ep", 40.0, 1.0, 3.0)  # past its count, one sequence lingers: it waits
    counting = asyncio.ensure_future(run.count(1.0, 1000))
    for _ in range(3):
        await asyncio.sleep(0)
    assert tally.run_ons.stopped_by(3.0) == 1
    counting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await counting
    assert tally.run_ons.stopped_by(3.0) == 0


async def lean_stream_left(rig: Rig, tally: EngineTally, seconds: float) -> str:
    """Lean: after the feed read the engine idle (`idle_before`), a stream of four sequences whose client left
    `seconds` after its admission; the key its end report will name."""
    idle_before(tally, rig.clock())
    exchange = rig.admission.exchange(reported=True)
    verdict = await rig.decide(exchange, stream_of_four())
    assert isinstance(verdict, Forward) and verdict.report is not None
    rig.clock.advance(seconds)
    exchange.stream_ended()
    return verdict.report.key


async def test_lean_a_stream_left_under_the_buffer_is_charged_the_engines_count() -> None:
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    key = await lean_stream_left(rig, tally, seconds=1.0)
    fed_alone(tally, start, 30.0, 1.0)
    reading = ResponseReading(events=12)  # twelve tokens passed
    timing = ReportedTiming(first_token_after_s=0.2, decode_s=0.8)
    rig.admission.unseen.report(key, 200, reading, timing, passed_bytes=600)
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 1
    assert completion(rig) == 30 and basis(rig, "engine_count") == 1


async def test_a_stream_that_ended_in_an_error_keeps_its_rule_and_waits_for_no_count() -> None:
    """An error event mid-stream: the engine stopped the answer itself; charged the prompt and what passed
    (`upstream_error`), at once."""
    tally = EngineTally()
    rig = await rig_with(tally)
    idle_before(tally, rig.clock())
    exchange = rig.admission.exchange()
    assert isinstance(await rig.decide(exchange, stream_of_four()), Forward)
    exchange.response_headers(200, "text/event-stream", end_of_stream=False)
    for index in range(4):
        await exchange.response_body(text_event(index), False)
    await exchange.response_body(b'data: {"error": {"message": "boom", "code": 500}}\n\n', False)
    exchange.stream_ended()
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="upstream_error") == 1
    assert basis(rig, "engine_count") == 0 and basis(rig, "estimate") == 0


async def test_lean_a_stream_envoy_read_on_after_its_client_left_is_counted_to_its_last_byte() -> None:
    """The client left after 1 s; Envoy read the upstream on (the engine saw no abort) until 6 s, its
    reader counting all 300 events: the engine ran the request until then. Counted over those 6 s it is the
    engines' 300 (over the 1 s to the proxy's end, 54: a missed reading); and its run in the tally stops at
    6 s, so the requests beside it then are not charged its tokens."""
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    key = await lean_stream_left(rig, tally, seconds=1.0)
    tally.observe("node ep", 150.0, 4.0, start + 3.0)
    rig.clock.advance(5.2)
    timing = ReportedTiming(first_token_after_s=0.2, decode_s=5.8, upstream_s=6.0)
    reading = ResponseReading(events=300)
    rig.admission.unseen.report(key, 200, reading, timing, passed_bytes=600)
    tally.observe("node ep", 300.0, 0.0, start + 6.0 + ENGINE_STOP_S)
    await rig.settled()
    assert completion(rig) == 300 and basis(rig, "engine_count") == 1
    tally.begin("beside", start + 4.0, 1)  # another request of this sidecar's, at 4 s: ours still ran
    tally.end("beside", start + 5.0)
    # From 3 s to 7.5 s, 150 tokens: ours ran 4 sequences for 3 s of it, the other one for 1 s (150 / 13);
    # with ours stopped at 1 s, all 150 would be the other's.
    assert tally.count(start + 4.0, start + 5.0, 1, key="beside") == pytest.approx(150.0 / 13.0)


async def test_a_count_whose_reading_came_waits_longer_for_the_other_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store's exchange stalls past `ENGINE_COUNT_WAIT_S` (7-10 s at a time on the real-engine tier's
    saturated host): the reading past the end came, the other replica's answer did not. The count waits for
    it (`PEERS_COUNT_WAIT_S`) and is charged the engines' count, not the pace estimate (a fleet flood charged
    1.17 times what vLLM generated so, 54 answers by estimate)."""
    monkeypatch.setattr(engine_run, "ENGINE_COUNT_WAIT_S", 0.01)
    monkeypatch.setattr(engine_run, "PEERS_COUNT_WAIT_S", 5.0)
    tally = EngineTally()
    rig, start = await four_left_while_read(tally)
    tally.observe_peers({"b": RunFigures(0.0, 0.0, 0.0)}, start - 1.0)
    tally.observe("node ep", 1281.0, 0.0, start + 3.1)  # read past its end; b last heard before it
    await asyncio.sleep(0.05)
    assert completion(rig) == 0 and basis(rig, "estimate") == 0  # waits past `ENGINE_COUNT_WAIT_S`
    tally.observe_peers({"b": RunFigures(0.0, 0.0, 0.0)}, start + 3.2)  # b ran nothing
    await asyncio.sleep(0)
    tally.observe_peers({"b": RunFigures(0.0, 0.0, 0.0)}, start + 3.3)
    tally.observe("node ep", 1281.0, 0.0, start + 4.0)  # nothing ran on
    await asyncio.wait_for(rig.settled(), 2.0)
    assert completion(rig) == 281 and basis(rig, "engine_count") == 1


async def test_a_reading_queued_behind_a_held_up_loop_is_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar's event loop was held up past `ENGINE_COUNT_WAIT_S` (7.5 s on the real-engine tier's
    saturated host): its timer fires first, the sample read in time comes just after. The count takes it
    (`QUEUED_READING_S`); before, 44 answers of a flood were charged the pace estimate so."""
    monkeypatch.setattr(engine_run, "ENGINE_COUNT_WAIT_S", 0.01)
    tally = EngineTally()
    rig, start = await four_left_while_read(tally)
    await asyncio.sleep(0.05)  # past the wait: the reading comes now
    tally.observe("node ep", 1281.0, 0.0, start + 3.1)
    await asyncio.wait_for(rig.settled(), 2.0)
    assert completion(rig) == 281 and basis(rig, "engine_count") == 1
