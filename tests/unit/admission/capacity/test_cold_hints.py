"""Refusals' `retry-after` before the pool's pace under load is known. A slot refusal: the open requests'
expected lengths at the engines' own pace from the feed, not at a pace learned from a warm-up at low load.
A KV refusal before any pace is learned or fed: at the pace admission assumes, which the composition tells
every budget (`KvBudget.assume_pace`)."""

from __future__ import annotations

import json
from typing import Any

from extproc.admission.compose import build_admission
from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.replies.verdicts import Forward, Hold, Refusal
from extproc.core.clock import FakeClock
from extproc.core.engine.tally import EngineTally
from extproc.core.kv.budget import KvBudget
from extproc.metrics import Metrics
from extproc.store.local import LocalStore
from tests.support.admission import AdmissionRig
from tests.support.rules import admission_rules

SLOTS = 32
ANSWER = 400
WARM_PACE = 160.0
"""Tokens per second per sequence one warm-up answer streamed at, alone in the engine: what was learned."""
ENGINE_PACE = 40.0
"""The engines' pace with all 32 slots' answers in one batch, as the feed reads it from their counters."""
HEAD = RequestHead("POST", "/v1/chat/completions", {})
CONFIG: dict[str, Any] = {"models": {"*": {"context_window": 8192}}}


def chat(max_tokens: int) -> bytes:
    return json.dumps(
        {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()


async def decide(rig: AdmissionRig, exchange: Exchange, body: bytes) -> Forward | Refusal:
    exchange.request_headers(HEAD)
    verdicts = [v async for v in exchange.request_body(body)]
    assert len(verdicts) == 1 and not isinstance(verdicts[0], Hold)
    return verdicts[0]


def within_twice(hint: float, actual: float) -> bool:
    return actual / 2 <= hint <= actual * 2


async def test_a_cold_slot_refusal_is_told_when_the_full_batch_ends() -> None:
    """32 slots held by 400-token answers the engine decodes at its full-batch pace (40 tokens/s: they end
    10 s in, when the refused request could in fact be admitted). The pool learned 160 tokens/s from one
    warm-up answer decoded alone; at that pace the hint said 2.5 s, and an SDK following it spent its
    retries before any slot freed. The hint takes the slower of the learned and the fed pace."""
    rig = await AdmissionRig(CONFIG, concurrency=SLOTS).start()
    rates = rig.admission.service.paces
    rates.fed = lambda _pool: ENGINE_PACE
    rates.observe("*", WARM_PACE, 1.0)
    assert rates.rate("*") == WARM_PACE
    holders = []
    for _ in range(SLOTS):
        holder = rig.admission.exchange()
        rig.admission.streams.add(holder)
        assert isinstance(await decide(rig, holder, chat(ANSWER)), Forward)
        holders.append(holder)
    rig.clock.advance(0.5)
    refused = await decide(rig, rig.admission.exchange(), chat(ANSWER))
    assert isinstance(refused, Refusal) and refused.reason == "concurrency"
    hint = int(dict(refused.headers)["retry-after-ms"]) / 1000
    frees_at = ANSWER / ENGINE_PACE - 0.5
    assert within_twice(hint, frees_at), (hint, frees_at)
    assert not within_twice(1.0, frees_at)  # a flat second would fail the same check
    for holder in holders:
        holder.close()
    await rig.admission.service.drain()
    assert rig.active == 0


class Signals:
    """The KV feed's signals with one pool's budget, one engine's, and no pace from the engines yet."""

    def __init__(self) -> None:
        self.pool = KvBudget(capacity_tokens=1000)
        self.engine = KvBudget(capacity_tokens=500)

    def budget(self, pool: str) -> KvBudget | None:
        return self.pool

    def endpoint_budget(self, pool: str, endpoint: str) -> tuple[str, KvBudget] | None:
        return f"{pool}@{endpoint}", self.engine

    def budget_changed(self, pool: str) -> None:
        pass

    def kv_usage(self, pool: str) -> float | None:
        return None

    def decode_rate(self, pool: str) -> float | None:
        return None

    def engine_tally(self, pool: str) -> EngineTally | None:
        return None

    def feeds_pool(self, pool: str) -> bool:
        return True

    def engine_refused(self, pool: str) -> None:
        pass

    def engine_down_for(self, pool: str) -> float | None:
        return None


def test_every_budget_admission_reads_knows_the_assumed_pace() -> None:
    """With no pace learned or fed, a KV refusal's hint is forecast at the configured assumption (here 25
    tokens/s), as a slot refusal's is, rather than a flat second."""
    clock = FakeClock()
    signals = Signals()
    admission = build_admission(
        lambda: admission_rules(CONFIG), LocalStore(clock=clock), clock, Metrics(), signals=signals
    )
    admission.service.paces.default_tokens_per_second = 25.0
    assert signals.pool.hint_rate() is None and signals.engine.hint_rate() is None
    assert admission.service.deps.kv_budget("m") is signals.pool
    assert signals.pool.hint_rate() == 25.0
    assert admission.service.deps.endpoint_budget("m", "10.0.0.2:8000") == ("m@10.0.0.2:8000", signals.engine)
    assert signals.engine.hint_rate() == 25.0
