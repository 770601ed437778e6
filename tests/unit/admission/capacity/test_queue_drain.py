"""A queue whose line cannot reach a newcomer within its wait refuses it at once (`queue_full`, with when the
line is expected to have drained as its retry-after) instead of holding it the whole wait for a
`queue_timeout` (extproc/core/queue/drain.py). The pace is what the queue has lately drained at; from a cold
start, and for a newcomer with none of its own tenant ahead, everyone waits."""

from __future__ import annotations

import asyncio

from extproc.admission.replies.verdicts import BodyVerdict, Forward
from tests.unit.admission.queue_rig import QueueRig, config, refusal_of, turns

MAX_WAIT_S = 4.0


async def trained(grants: int = 10) -> tuple[QueueRig, object]:
    """A rig whose one slot was handed on through the queue `grants` times, one a second: a pace of one
    grant per backlogged second. Returns it and the exchange holding the slot."""
    rig = await QueueRig(config(MAX_WAIT_S)).start()
    holder = await rig.hold_the_slot(max_tokens=100)
    for _ in range(grants):
        waiter = rig.exchange()
        task = rig.waiting(waiter)
        await turns()
        rig.clock.advance(1.0)
        await rig.settle(holder)
        await turns()
        assert isinstance((await task)[-1], Forward)
        holder = waiter
    return rig, holder


def line(rig: QueueRig, n: int, tenant: str = "a") -> list[asyncio.Task[list[BodyVerdict]]]:
    return [rig.waiting(rig.exchange(), tenant=tenant) for _ in range(n)]


async def all_time_out(rig: QueueRig, tasks: list[asyncio.Task[list[BodyVerdict]]]) -> None:
    """The slot stays held past every wait: each waiter ends in `queue_timeout`."""
    await rig.run_out(MAX_WAIT_S + 1)
    for task in tasks:
        assert refusal_of(await task).reason == "queue_timeout"


async def waits_with(rig: QueueRig, waiting: list[asyncio.Task[list[BodyVerdict]]]) -> None:
    """A newcomer of tenant "a" behind `waiting` is let wait (not refused at once); it times out with them."""
    await turns()  # the line is queued first
    newcomer = rig.waiting(rig.exchange(), tenant="a")
    await turns()
    assert not newcomer.done()
    await all_time_out(rig, [*waiting, newcomer])


async def test_a_line_that_cannot_drain_within_the_wait_refuses_a_newcomer_at_once() -> None:
    rig, _ = await trained()
    # 8 ahead, all waiting as long as the newcomer: at twice the pace (two a second) all are served within the
    # 4 s, so the newcomer's turn would come at 4.5 s, past its wait (the eighth's came at 4.0 s: it waits).
    waiting = line(rig, 8)
    await turns()
    newcomer = rig.waiting(rig.exchange(), tenant="a")
    await turns()
    refusal = refusal_of(await newcomer)
    assert refusal.reason == "queue_full"
    headers = dict(refusal.headers)
    # At the pace measured (one a second) 4 are served, the other 4 time out: its turn in 5 s.
    assert 4.5 <= float(headers["retry-after-ms"]) / 1000 <= 5.5
    assert b"expected to take" in refusal.body
    other = rig.waiting(rig.exchange(), tenant="b")  # its tenant's turn comes next: it waits
    await turns()
    assert not other.done()
    await all_time_out(rig, [*waiting, other])


async def test_a_line_twice_the_pace_can_drain_in_time_waits() -> None:
    rig, _ = await trained()
    waiting = line(rig, 7)  # 8 with the newcomer's own: 4 s at twice the pace
    await waits_with(rig, waiting)


async def test_a_line_about_to_time_out_holds_no_newcomer_back() -> None:
    """The same eight, 3.5 s into their 4 s waits: they time out before a newcomer's turn would come."""
    rig, _ = await trained()
    waiting = line(rig, 8)
    await turns()
    rig.clock.advance(3.5)
    await waits_with(rig, waiting)


async def test_a_cold_queue_holds_everyone_its_wait() -> None:
    rig, _ = await trained(grants=2)  # too few grants to know a pace
    waiting = line(rig, 30)
    await turns()
    assert not any(task.done() for task in waiting)
    await all_time_out(rig, waiting)
