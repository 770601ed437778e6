"""A queue that cannot drain within its class's wait refuses a newcomer at once, and a wait that runs out is
told when its capacity is expected, both from the deadlines' layout of the line, on an injected clock.

A request without a deadline of its own is laid out where it would queue (the back of its tenant's line)
and refused `queue_full` at once, its retry-after the forecast start, only where that start is past its wait
even if capacity came as much earlier than forecast as it lately has (the early side of `ForecastSlip`):
before enough grants were compared with their forecast, never, so a burst the engine could serve within the
wait still waits for it. A wait that runs out (`queue_timeout`) is told when the same request queued again
is expected to have its capacity, not half the wait.
"""

from __future__ import annotations

import json

import pytest

from extproc.admission.replies.verdicts import Forward, Hold
from extproc.core.queue.slip import ForecastSlip
from tests.unit.admission.queue_rig import QueueRig, config, refusal_of, turns


async def test_a_newcomer_the_line_cannot_drain_to_within_its_wait_is_refused_at_once() -> None:
    rig = await QueueRig(config(max_wait_s=2)).start()
    holder = await rig.hold_the_slot(max_tokens=1000)  # frees in about 10 s at the assumed 100 tokens/s
    verdicts = await rig.send(rig.exchange())
    assert not any(isinstance(v, Hold) for v in verdicts), "it must not wait 2 s for a slot 10 s away"
    refusal = refusal_of(verdicts)
    assert refusal.status == 429 and refusal.reason == "queue_full"
    headers = dict(refusal.all_headers)
    assert headers["retry-after"] == "10"  # the forecast start, not half the wait (1 s)
    assert headers["x-extproc-reject-reason"] == "queue_full"
    assert "cannot drain" in json.loads(refusal.body)["error"]["message"]
    assert rig.active == 1 and rig.metric("extproc_queue_depth", **{"class": "standard"}) == 0
    await rig.settle(holder)
    assert rig.active == 0


async def test_a_line_that_drains_within_the_wait_is_waited_in_and_answered() -> None:
    rig = await QueueRig(config(max_wait_s=10), slots=2).start()
    holders = [await rig.hold_the_slot(max_tokens=100) for _ in range(2)]  # both free in about 1 s
    # Six more, 1 s each on two slots: the last is expected at 3 s, within the 10 s wait.
    exchanges = [rig.exchange() for _ in range(6)]
    tasks = [rig.waiting(exchange, max_tokens=100) for exchange in exchanges]
    await turns()
    assert not any(task.done() for task in tasks), "a burst the slots serve within the wait waits"
    for exchange in [*holders, *exchanges]:
        rig.clock.advance(0.5)
        await rig.settle(exchange)
        await turns()
    outcomes = [(await task)[-1] for task in tasks]
    assert all(isinstance(outcome, Forward) for outcome in outcomes), outcomes
    assert rig.active == 0


@pytest.mark.parametrize(("max_tokens", "refused"), [(300, False), (500, True)])
async def test_a_newcomer_is_refused_only_past_the_wait_by_how_early_capacity_has_come(
    max_tokens: int, refused: bool
) -> None:
    rig = await QueueRig(config(max_wait_s=2)).start()
    rig.waits.early = ForecastSlip(prior=0.5, early=True)  # capacity came up to half its horizon early
    holder = await rig.hold_the_slot(max_tokens=max_tokens)  # expected in 3 s (1.5 s at the earliest), 5 s
    task = rig.waiting(rig.exchange())
    await turns()
    assert task.done() is refused
    if refused:
        assert refusal_of(await task).reason == "queue_full"
    rig.clock.advance(1.5)
    await rig.settle(holder)  # it ended early: the waiter the margin let wait is admitted
    await turns()
    if not refused:
        assert isinstance((await task)[-1], Forward)


async def test_before_capacity_was_compared_with_its_forecast_nothing_is_refused_on_the_line() -> None:
    rig = await QueueRig(config(max_wait_s=2)).start()
    rig.waits.early = ForecastSlip(early=True)  # as shipped: the prior trusts the forecast least
    holder = await rig.hold_the_slot(max_tokens=1000)
    task = rig.waiting(rig.exchange())
    await turns()
    assert not task.done(), "a cold forecast sends nobody away"
    await rig.run_out(2.0)
    verdicts = await task
    assert isinstance(verdicts[0], Hold)
    refusal = refusal_of(verdicts)
    assert refusal.reason == "queue_timeout"
    # The slot is expected 8 s after the wait ran out: that, not half the wait (1 s), is the hint.
    assert dict(refusal.all_headers)["retry-after"] == "8"
    await rig.settle(holder)
    assert rig.active == 0


async def test_a_wait_that_runs_out_with_no_forecast_is_told_half_the_wait() -> None:
    rig = await QueueRig(config(max_wait_s=4)).start()
    rig.waits.early = ForecastSlip(early=True)
    rig.waits.starts = lambda _rejection, _runs, _held: None  # leases held elsewhere: nothing tells
    holder = await rig.hold_the_slot(max_tokens=1000)
    task = rig.waiting(rig.exchange())
    await turns()
    await rig.run_out(4.0)
    refusal = refusal_of(await task)
    assert refusal.reason == "queue_timeout" and dict(refusal.all_headers)["retry-after"] == "2"
    await rig.settle(holder)


def test_the_early_side_of_the_slip_measures_how_much_sooner_capacity_came() -> None:
    early = ForecastSlip(min_samples=1, quantile=1.0, floor_s=0.5, early=True)
    early.observe(10.0, 12.0, 12.5)  # late: counts as none on this side
    assert early.rate() == 0.0
    early.observe(10.0, 12.0, 11.0)  # 1 s early over 2 s
    assert early.rate() == pytest.approx(0.5) and early.margin(4.0) == pytest.approx(2.0)
    assert ForecastSlip(early=True).margin(3.0) == 3.0  # the prior: it might come at once
