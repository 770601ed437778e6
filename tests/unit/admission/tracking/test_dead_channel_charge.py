"""The lean profile with Envoy's access log dead from the start, ext_proc fine (issue 40, item 5): no end
report ever comes, no decode rate is learned, and every lease expires. Each is charged its share of what the
engine generated over its life from the feed's counts (`InFlight.expire` → `EngineRun.count`), not the
decode-rate estimate at the assumed rate; the channel's death is reported as such (`ReportChannel`), the
leases after it released at their end.

The run: 20 requests of 80 tokens each through 4 slots, five waves of four, on an engine that decodes 20
tokens a second per sequence and is read by the feed every second. The assumed rate (100 tokens/s) over each
request's four seconds would charge 400 each, 5x what the engine generated: the issue's 5.14x.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.replies.verdicts import Forward
from extproc.admission.tracking.inflight import InFlight
from extproc.core.engine.tally import ENGINE_STOP_S, EngineTally
from tests.support.admission import AdmissionRig

MODEL = "m"
ANSWER = 80
PACE = 20.0  # tokens a second per sequence
LIFE_S = ANSWER / PACE
SLOTS = 4
WAVES = 5
CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 8000, "default_max_tokens": 100}},
    "admission": {"assumed_decode_tokens_per_second": 100, "end_report_wait_seconds": 2},
}
HEAD = RequestHead("POST", "/v1/completions", {})
BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1000}).encode()


class Engine:
    """One engine endpoint in the feed: its generation counter and running requests, read every second."""

    def __init__(self, tally: EngineTally) -> None:
        self.tally = tally
        self.generated = 0.0

    def run(self, at: float, running: int, seconds: float) -> None:
        """`running` sequences decode for `seconds` from `at`, the feed reading the engine each second."""
        for step in range(1, int(seconds) + 1):
            self.generated += running * PACE
            self.tally.observe("node ep", self.generated, running, at + step)


async def admit(rig: AdmissionRig) -> Exchange:
    exchange = rig.admission.exchange(reported=True)
    exchange.request_headers(HEAD)
    verdicts = [v async for v in exchange.request_body(BODY)]
    assert isinstance(verdicts[-1], Forward)
    return exchange


def waiting(rig: AdmissionRig) -> list[InFlight]:
    return rig.admission.unseen.awaiting_reports()


async def wave(rig: AdmissionRig, engine: Engine, first: bool) -> None:
    """Four requests run their lives on the engine and end on the proxy; no report comes. The first wave
    waits out `end_report_wait_seconds` (the timer's work done here: the unit's loop clock is not the
    rig's), which tells the sidecar the channel is dead; later ones are released at their end."""
    start = rig.clock()
    exchanges = [await admit(rig) for _ in range(SLOTS)]
    engine.run(start, SLOTS, LIFE_S)
    rig.clock.advance(LIFE_S)
    for exchange in exchanges:
        exchange.stream_ended()
    engine.run(start + LIFE_S, 0, ENGINE_STOP_S + 1)  # idle, read past each end
    if first:
        wait = rig.admission.service.rules().end_report_wait_seconds
        rig.clock.advance(wait)
        for inflight in waiting(rig):
            rig.admission.unseen._expire(inflight, wait)  # what the bounded wait's timer calls
    await rig.admission.service.drain()
    for _ in range(3):
        await asyncio.sleep(0)  # the store's release runs on the loop
    assert rig.active == 0 and waiting(rig) == []
    rig.clock.advance(ENGINE_STOP_S + 1)


async def test_leases_whose_reports_never_come_are_charged_what_the_engine_generated() -> None:
    rig = await AdmissionRig(CONFIG, concurrency=SLOTS).start()
    tally = EngineTally()
    rig.admission.service.deps.engine_tally = lambda _pool: tally
    engine = Engine(tally)
    tally.observe("node ep", 0.0, 0, rig.clock() - 0.5)  # the feed read the engine idle before the run
    for index in range(WAVES):
        await wave(rig, engine, first=index == 0)
    charged = rig.metric("extproc_tokens_settled_total", model="other", kind="completion")
    assert engine.generated == WAVES * SLOTS * ANSWER
    assert rig.metric("extproc_settlements_total", outcome="expired") == WAVES * SLOTS
    counted = rig.metric("extproc_unfinished_answers_total", model="other", basis="engine_count")
    assert counted == WAVES * SLOTS
    assert abs(charged / engine.generated - 1) <= 0.10, charged
    channel = rig.admission.unseen.channel
    assert channel.lost
    assert rig.metric("extproc_end_report_channel_losses_total", cause="never_connected") == 1
    assert rig.metric("extproc_end_report_channel_up") == 0
