"""A request the engine is done with while its client still reads gives its slot back early
(`InFlight.engine_done`, told by its KV booking once the feed confirms it): the next request is admitted into
a one-slot limit at once, the tokens still settle when the answer ends, and a stream that resumes between
samples keeps its slot. The feed's samples are `KvBudget.observe_engine` calls on a fake clock."""

from __future__ import annotations

import json
from typing import Any

from extproc.admission.exchange import Exchange, Phase, RequestHead
from extproc.admission.replies.verdicts import Forward, Refusal
from extproc.admission.tracking.reading import ReportedTiming, ResponseReading
from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.completion import CompletionLearner
from extproc.core.limiter.limiter import Lease, LimitSpec
from tests.support.admission import AdmissionRig

CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 4000, "default_max_tokens": 200}},
    # A proxy that buffers 32 bytes for a reader: the one chunk a slow reader here has read fills it, and
    # from then on the reader, not the engine, paces what passes (`InFlight._unheld`).
    "admission": {"proxy_buffer_bytes": 32},
}
HEAD = RequestHead("POST", "/v1/chat/completions", {})
TPM = 60_000
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":150,"total_tokens":161}}\n\n'
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'


def chat() -> bytes:
    body = {"model": "m", "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps(body).encode()


class Rig(AdmissionRig):
    """One slot and a TPM bucket on `global`, and a forecasting KV budget fed by the test."""

    def __init__(self) -> None:
        super().__init__(CONFIG, concurrency=1)
        learner = CompletionLearner(min_samples=10**6)
        self.budget = KvBudget(100_000, target_utilization=1.0, booking=BookingMode.FORECAST, learner=learner)
        self.budget.pace.observe_stream(100, 1.0)
        self.t0 = self.clock()  # sample times are seconds after this
        self.budget.observe_engine(0, now=self.t0, fresh_for=1000.0, waiting=0, running=0)
        self.admission.service.deps.kv_budget = lambda _pool: self.budget

    async def begin(self) -> Rig:
        await self.store.apply_limits({"global": LimitSpec(max_concurrency=1, tokens_per_minute=TPM)})
        return self

    async def decide(self, exchange: Exchange) -> Forward | Refusal:
        exchange.request_headers(HEAD)
        verdicts = [v async for v in exchange.request_body(chat())]
        assert isinstance(verdicts[-1], Forward | Refusal)
        return verdicts[-1]

    async def sample(self, at: float, running: int) -> None:
        """A feed sample `at` s after the start: the engine runs `running` requests, none waits."""
        self.clock.advance(self.t0 + at - self.clock())
        self.budget.observe_engine(0, now=self.clock(), fresh_for=1000.0, waiting=0, running=running)
        await self.admission.service.drain()

    def lease(self, exchange: Exchange) -> Lease:
        assert exchange.admitted is not None
        return exchange.admitted.lease

    @property
    def released_early(self) -> float:
        return self.metric("extproc_slots_released_early_total", model="other")


async def test_inline_a_slow_readers_slot_goes_back_and_its_tokens_settle_at_the_end() -> None:
    rig = await Rig().begin()
    slow = rig.admission.exchange()
    assert isinstance(await rig.decide(slow), Forward)
    slow.response_headers(200, "text/event-stream", end_of_stream=False)
    rig.clock.advance(0.5)
    await slow.response_body(CHUNK, False)  # then stalled: the proxy's buffers are full
    assert isinstance(await rig.decide(rig.admission.exchange()), Refusal)  # one slot, held
    for at in (10.0, 11.0):
        await rig.sample(at, running=0)
    assert rig.active == 1 and rig.released_early == 0  # found twice, over 1 s: not yet
    await rig.sample(12.0, running=0)
    assert rig.active == 0 and rig.released_early == 1
    lease = rig.lease(slow)
    assert lease.slot_released and not lease.settled  # its tokens wait for the answer's end
    second = rig.admission.exchange()
    assert isinstance(await rig.decide(second), Forward)  # admitted into the slot given back
    assert rig.active == 1
    await slow.response_body(USAGE + b"data: [DONE]\n\n", True)  # the client read it all
    await rig.admission.service.drain()
    assert phase(slow) is Phase.SETTLED and lease.settled
    assert lease.actual_tokens == 11 + 150  # charged the engine's count, as ever
    assert rig.active == 1  # the second request's slot: none freed twice
    assert rig.metric("extproc_settlements_total", outcome="completed") == 1
    await rig.sample(20.0, running=0)
    assert rig.released_early == 1  # each request once


async def test_a_stream_that_resumes_between_samples_keeps_its_slot() -> None:
    rig = await Rig().begin()
    stream = rig.admission.exchange()
    assert isinstance(await rig.decide(stream), Forward)
    stream.response_headers(200, "text/event-stream", end_of_stream=False)
    rig.clock.advance(0.5)
    await stream.response_body(CHUNK, False)
    await rig.sample(10.0, running=0)  # stalled: found finished once
    rig.clock.advance(0.5)
    await stream.response_body(CHUNK, False)  # it moves again
    await rig.sample(11.0, running=1)
    await rig.sample(14.0, running=0)  # stalled only since 10.5: not found, then found again from here
    await rig.sample(15.0, running=0)
    assert rig.active == 1 and rig.released_early == 0
    await stream.response_body(USAGE + b"data: [DONE]\n\n", True)
    await rig.admission.service.drain()
    assert rig.active == 0 and rig.released_early == 0


async def test_lean_a_slow_readers_slot_goes_back_before_its_end_report() -> None:
    rig = await Rig().begin()
    slow = rig.admission.exchange(reported=True)
    verdict = await rig.decide(slow)
    assert isinstance(verdict, Forward) and verdict.report is not None
    await rig.sample(5.0, running=1)  # the engine runs it
    for at in (10.0, 11.0, 12.0):
        await rig.sample(at, running=0)
    assert rig.active == 0 and rig.released_early == 1
    assert isinstance(await rig.decide(rig.admission.exchange(reported=True)), Forward)
    usage = json.dumps({"prompt_tokens": 11, "completion_tokens": 150})
    reading = ResponseReading(events=150, events_at_usage=150, usage_last=usage, final=True, body_end=True)
    assert rig.admission.unseen.report(verdict.report.key, 200, reading, ReportedTiming(1.0, 2.0))
    await rig.admission.service.drain()
    lease = rig.lease(slow)
    assert lease.settled and lease.actual_tokens == 161
    assert rig.active == 1  # the second request's slot


# -- the close of an answer the engine finished: charged the engine's pace over its time ------------------

FED_PACE = 10.0
"""The engines' pace from the feed while the slow reader's answer ran (tokens a second per sequence)."""


async def slow_reader_closed(rig: Rig, learned: float | None) -> float:
    """Inline: a stream whose first content came 0.5 s after admission, stalled, found finished by the feed
    from 10 s, confirmed at 12 s, when the feed's pace is the one it ran at; the feed then has none (other
    traffic, or none); the client leaves at 20 s having read one token. What its close charged as
    completion, with the pool's pace `learned` from its streams (None: none learned)."""
    rates = rig.admission.service.paces
    paces: dict[str, float | None] = {"now": FED_PACE}
    rates.fed = lambda _pool: paces["now"]
    slow = rig.admission.exchange()
    assert isinstance(await rig.decide(slow), Forward)
    if learned is not None:
        assert slow.admitted is not None
        rates.observe(slow.admitted.pool, learned * 100, 100.0)
    slow.response_headers(200, "text/event-stream", end_of_stream=False)
    rig.clock.advance(0.5)
    await slow.response_body(CHUNK, False)
    for at in (10.0, 11.0, 12.0):
        await rig.sample(at, running=0)
    assert rig.released_early == 1
    paces["now"] = None
    rig.clock.advance(8.0)
    slow.stream_ended()  # the client left mid-answer
    await rig.admission.service.drain()
    assert rig.lease(slow).settled
    return rig.metric("extproc_tokens_settled_total", model="other", kind="completion")


async def test_a_closed_slow_reader_is_charged_the_pace_the_feed_saw_when_the_engine_finished_it() -> None:
    """No pace learned, none fed at the close: the one token seen would be the whole charge. The pace the
    feed had when it found the engine done, over the 19.5 s from the first token: 1 + 195 tokens."""
    assert await slow_reader_closed(await Rig().begin(), learned=None) == 1 + 195


async def test_a_pace_learned_below_the_engine_does_not_lower_a_slow_readers_charge() -> None:
    """A delivery pace learned at 2 tokens a second gives 40; the engine's own pace gives 196, and the
    charge takes the larger."""
    assert await slow_reader_closed(await Rig().begin(), learned=2.0) == 1 + 195


async def test_a_pace_learned_above_the_engine_charges_capped_by_the_reservation() -> None:
    """Learned at 40 a second over 19.5 s: past the 200-token reservation, which caps it."""
    assert await slow_reader_closed(await Rig().begin(), learned=40.0) == 200


async def test_lean_a_request_the_engine_never_counted_running_keeps_its_slot() -> None:
    """Admitted, and the engine runs nothing sample after sample: it may still be in the engine's API server
    or on its way there, not finished. Its slot stays until a sample counts it running and a later one
    finds it gone."""
    rig = await Rig().begin()
    slow = rig.admission.exchange(reported=True)
    assert isinstance(await rig.decide(slow), Forward)
    for at in (10.0, 11.0, 12.0, 13.0):
        await rig.sample(at, running=0)
    assert rig.active == 1 and rig.released_early == 0
    await rig.sample(14.0, running=1)
    for at in (15.0, 16.0, 17.0):
        await rig.sample(at, running=0)
    assert rig.active == 0 and rig.released_early == 1


def phase(exchange: Exchange) -> Phase:
    return exchange.phase
