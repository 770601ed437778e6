"""An answer nobody saw is charged what the engines counted for it (`InFlight._charge_unseen`): the feed's
generation counters over the request's time (`core.engine_tally`), read once the feed is past its end; the
pace estimate where the feed has no counters, does not reach back to the admission, or does not read the
engines in time."""

from __future__ import annotations

import asyncio
import json

import pytest

from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.replies.verdicts import Forward, Refusal
from extproc.admission.tracking import engine_count
from extproc.admission.tracking.reading import ResponseReading
from extproc.core.engine_tally import EngineTally
from tests.support.admission import AdmissionRig

CONFIG = {"models": {"*": {"context_window": 8000, "default_max_tokens": 100}}}
HEAD = RequestHead("POST", "/v1/completions", {})

LEARNED = 56.0
"""The pool's learned pace per sequence (single answers): 1.5 s of four sequences at it is 336 tokens, where
the engine, decoding four together, generated 281."""


def four_sequences() -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1000, "n": 4}).encode()


class Rig(AdmissionRig):
    """Admission over an in-process store and a fake clock, its pool's engines tallied by the test."""

    def __init__(self, tally: EngineTally | None) -> None:
        super().__init__(CONFIG)
        self.admission.service.deps.engine_tally = lambda _pool: tally
        self.admission.service.decode_rates.observe("*", LEARNED * 100, 100.0)

    async def decide(self, exchange: Exchange) -> Forward | Refusal:
        exchange.request_headers(HEAD)
        verdicts = [v async for v in exchange.request_body(four_sequences())]
        assert isinstance(verdicts[-1], Forward | Refusal)
        return verdicts[-1]

    async def settled(self) -> None:
        await self.admission.service.drain()


async def rig_with(tally: EngineTally | None) -> Rig:
    return await Rig(tally).start()


def completion(rig: Rig) -> float:
    return rig.metric("extproc_tokens_settled_total", model="other", kind="completion")


def basis(rig: Rig, name: str) -> float:
    return rig.metric("extproc_unseen_answers_total", model="other", basis=name)


async def left_after(rig: Rig, seconds: float, reported: bool = False) -> Exchange:
    exchange = rig.admission.exchange(reported=reported)
    assert isinstance(await rig.decide(exchange), Forward)
    rig.clock.advance(seconds)
    exchange.stream_ended()  # the client left before the answer's headers
    return exchange


async def test_inline_a_body_left_is_charged_the_engines_count_once_the_feed_is_past_its_end() -> None:
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    tally.observe("node ep", 1000.0, 0.0, start - 0.7)  # idle before it came
    await left_after(rig, 1.5)
    tally.observe("node ep", 1200.0, 4.0, start + 1.3)  # read while it ran
    for _ in range(3):
        await asyncio.sleep(0)  # the store's release runs on the loop
    assert rig.active == 0  # its slot is back at once: the engine stops within a step
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 0  # its count is not in yet
    tally.observe("node ep", 1281.0, 0.0, start + 1.5 + engine_count.ENGINE_STOP_S / 2)
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 0  # read too soon after the end
    tally.observe("node ep", 1281.0, 0.0, start + 1.5 + engine_count.ENGINE_STOP_S)
    await rig.settled()
    assert completion(rig) == 281  # what the engine generated, not 336 at the pace of single answers
    assert basis(rig, "engine_count") == 1 and basis(rig, "pace") == 0
    assert rig.metric("extproc_slots_released_early_total", model="other") == 0  # the client did not read on


async def test_lean_an_expired_lease_is_charged_the_engines_count() -> None:
    """No end report within the wait (the access log lost): by then the feed has read past the end."""
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    tally.observe("node ep", 0.0, 0.0, start - 0.5)
    await left_after(rig, 2.0, reported=True)
    tally.observe("node ep", 150.0, 4.0, start + 1.0)
    tally.observe("node ep", 240.0, 0.0, start + 3.0)
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
    tally.observe("node ep", 200.0, 0.0, start + 2.5)
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
    assert basis(rig, "pace") == 1 and basis(rig, "engine_count") == 0


async def test_a_feed_that_does_not_read_the_engines_in_time_leaves_the_pace_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_count, "ENGINE_COUNT_WAIT_S", 0.01)
    tally = EngineTally()
    rig = await rig_with(tally)
    tally.observe("node ep", 0.0, 0.0, rig.clock())
    await left_after(rig, 1.5)
    await rig.settled()  # no reading after the end comes
    assert completion(rig) == 336
    assert basis(rig, "pace") == 1
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
    assert completion(rig) == 336 and basis(rig, "pace") == 1


async def test_a_share_among_others_is_charged_to_the_nearest_token() -> None:
    """Six other sequences ran throughout its 1.5 s in a 3 s interval of 301 tokens: its four ran 6 of the
    24 sequence-seconds, 75.25 tokens. Charged 75: rounding each share up would charge a flood of such
    requests half a token each more than the engines generated."""
    tally = EngineTally()
    rig = await rig_with(tally)
    start = rig.clock()
    tally.observe("node ep", 0.0, 6.0, start - 0.5)
    await left_after(rig, 1.5)
    tally.observe("node ep", 301.0, 6.0, start + 2.5)
    await rig.settled()
    assert completion(rig) == 75
