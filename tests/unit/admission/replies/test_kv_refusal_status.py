"""A KV-budget 429 through the decision carries the `x-ratelimit-*` headers of the request's keys, as a
slot 429 does (OpenAI sends them on every 429), and goes without them, still refused, where the store cannot
say."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from extproc.admission.replies.verdicts import Refusal
from extproc.core.kv.budget import KvBudget
from extproc.core.limiter.limiter import RateLimitStatus
from extproc.core.ports import StoreUnavailable
from tests.unit.admission.exchange_rig import Rig, chat


class KvRig(Rig):
    """Two slots on `global` and a KV budget of 900 tokens (1,000 at the 0.9 target): one chat of up to 500
    tokens fits (an empty pool admits anything), a second does not."""

    def __init__(self) -> None:
        super().__init__(concurrency=2)
        self.budget = KvBudget(1000)
        self.admission.service.deps.kv_budget = lambda _pool: self.budget


async def kv_refusal(rig: KvRig) -> Refusal:
    """The second of two chats: the first holds one slot and most of the budget."""
    assert not isinstance(await rig.decide(rig.admission.exchange(), chat(max_tokens=500)), Refusal)
    verdict = await rig.decide(rig.admission.exchange(), chat(max_tokens=500))
    assert isinstance(verdict, Refusal) and verdict.reason == "kv_budget", verdict
    return verdict


async def test_a_kv_budget_refusal_carries_the_rate_limit_headers_of_the_requests_keys() -> None:
    rig = await KvRig().start()
    headers = dict((await kv_refusal(rig)).headers)
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "1"  # the first chat holds the other
    assert "x-ratelimit-reset-requests" in headers
    assert "retry-after" in headers and headers["x-extproc-reject-reason"] == "kv_budget"
    assert rig.active == 1


async def test_a_kv_budget_refusal_goes_without_them_where_the_store_cannot_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = await KvRig().start()

    async def unavailable(_keys: Sequence[str], _holder: str | None = None) -> RateLimitStatus:
        raise StoreUnavailable("redis away")

    monkeypatch.setattr(rig.store, "status", unavailable)
    headers = dict((await kv_refusal(rig)).headers)
    assert not any(name.startswith("x-ratelimit-") for name in headers)
    assert "retry-after" in headers and headers["x-extproc-reject-reason"] == "kv_budget"
