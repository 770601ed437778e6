"""Every 429 a class's queue or the tokenizer lanes send carries the `x-ratelimit-*` headers of the request's
keys, as the limiter's own and the KV budget's do (OpenAI sends them on every 429, and SDK users read them off
whichever they get): `queue_full`, `queue_timeout`, `deadline_unmet` and `tokenizer_busy`. Where the store
cannot say, the refusal goes without them instead of failing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from extproc.admission.capacity.lanes import LaneFull
from extproc.admission.deciding.resolving import OFF_LOOP_PARSE_BYTES
from extproc.admission.replies.verdicts import Hold, Refusal
from extproc.core.limiter.limiter import LimitSpec, RateLimitStatus
from extproc.core.ports import StoreUnavailable
from tests.unit.admission.queue_rig import QueueRig, chat, config, refusal_of, turns

DEADLINE = "x-extproc-ttft-deadline-ms"


def limits_of(refusal: Refusal) -> dict[str, str]:
    headers = dict(refusal.all_headers)
    assert "retry-after" in headers and headers["x-extproc-reject-reason"] == refusal.reason
    return {name: value for name, value in headers.items() if name.startswith("x-ratelimit-")}


def one_slot_taken(refusal: Refusal) -> None:
    """The headers say the one slot on `global` is held (by the request holding the slot)."""
    limits = limits_of(refusal)
    assert limits["x-ratelimit-limit-requests"] == "1", limits
    assert limits["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in limits


async def cold(cfg: dict[str, Any]) -> QueueRig:
    """A rig whose requests wait for the slot."""
    return await QueueRig(cfg).start()


async def test_a_full_queue_refusal_carries_them() -> None:
    rig = await cold(config(max_wait_s=10, max_queued=1))
    holder = await rig.hold_the_slot(max_tokens=100)
    waiter = rig.exchange()
    task = rig.waiting(waiter)
    await turns()
    refusal = refusal_of(await rig.send(rig.exchange()))
    assert refusal.reason == "queue_full"
    one_slot_taken(refusal)
    await rig.settle(holder)
    await turns()
    await task
    await rig.settle(waiter)
    assert rig.active == 0


async def test_a_wait_that_runs_out_ends_with_them() -> None:
    rig = await cold(config(max_wait_s=2))
    holder = await rig.hold_the_slot(max_tokens=1000)
    task = rig.waiting(rig.exchange())
    await turns()
    await rig.run_out(2.0)
    verdicts = await task
    assert isinstance(verdicts[0], Hold) and refusal_of(verdicts).reason == "queue_timeout"
    one_slot_taken(refusal_of(verdicts))
    await rig.settle(holder)


async def test_a_deadline_out_of_reach_is_refused_with_them_at_once_and_after_a_wait() -> None:
    rig = await cold(config(max_wait_s=10))
    holder = await rig.hold_the_slot(max_tokens=100)  # frees in about 1 s
    at_once = refusal_of(await rig.send(rig.exchange(), headers={DEADLINE: "500"}))
    assert at_once.reason == "deadline_unmet"
    one_slot_taken(at_once)
    task = rig.waiting(rig.exchange(), headers={DEADLINE: "2000"})  # in time by the forecast: it waits
    await turns()
    await rig.run_out(2.0)  # the holder ran long: the deadline passed while it waited
    after = refusal_of(await task)
    assert after.reason == "deadline_unmet"
    one_slot_taken(after)
    await rig.settle(holder)


async def test_the_store_that_cannot_say_leaves_them_out_and_still_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = await cold(config(max_wait_s=2))
    holder = await rig.hold_the_slot(max_tokens=1000)

    async def unavailable(_keys: Sequence[str], _holder: str | None = None) -> RateLimitStatus:
        raise StoreUnavailable("redis away")

    monkeypatch.setattr(rig.store, "status", unavailable)
    task = rig.waiting(rig.exchange())
    await turns()
    await rig.run_out(2.0)
    refusal = refusal_of(await task)
    assert refusal.reason == "queue_timeout" and limits_of(refusal) == {}
    await rig.settle(holder)


@pytest.mark.parametrize(("resolved", "limit"), [(False, "4"), (True, "1")])
async def test_a_busy_tokenizer_refusal_carries_them_its_models_once_its_body_was_read(
    monkeypatch: pytest.MonkeyPatch, resolved: bool, limit: str
) -> None:
    rig = QueueRig({**config(max_wait_s=2), "admission": {"bound_admission": False}})
    # Four slots on the gateway, one on the model: which of them the headers report says which keys.
    slots = {"global": LimitSpec(max_concurrency=4), "model:*": LimitSpec(max_concurrency=1)}
    await rig.store.apply_limits(slots)
    service = rig.admission.service

    async def full(*_args: Any) -> Any:
        raise LaneFull("tenant:default", 0.25)

    if resolved:
        monkeypatch.setattr(service, "count_prompts", full)  # its prompt waits to be counted
        verdicts = await rig.send(rig.exchange())
    else:
        monkeypatch.setattr(service.lanes, "run", full)  # its body waits to be parsed: no model yet
        verdicts = await rig.send(rig.exchange(), body=chat(10, "x" * (OFF_LOOP_PARSE_BYTES + 1)))
    refusal = refusal_of(verdicts)
    assert refusal.reason == "tokenizer_busy"
    assert limits_of(refusal)["x-ratelimit-limit-requests"] == limit
    assert rig.active == 0
