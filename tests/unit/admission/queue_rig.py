"""Admission with a wait queue on a fake clock, for the tests that drive requests through a class that queues:
one request holds the slot, others wait behind it or are refused, and the test moves the clock."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.replies.verdicts import BodyVerdict, Forward, Refusal
from extproc.core.queue.slip import ForecastSlip
from tests.support.admission import AdmissionRig


def config(max_wait_s: float, max_queued: int = 100) -> dict[str, Any]:
    """One class, `standard`, that waits up to `max_wait_s` with room for `max_queued` waiters."""
    queue = {"max_wait_seconds": max_wait_s, "max_queued": max_queued}
    return {
        "admission": {"tenant": {"header": "x-tenant"}},
        "classes": [{"name": "standard", "queue": queue}],
        "default_class": "standard",
        "models": {"*": {"context_window": 4000, "default_max_tokens": 100}},
    }


class QueueRig(AdmissionRig):
    """Admission with a wait queue over an in-process store of `slots` slots on `global`, on a fake clock.
    The forecast's slip is trusted as measured from the start (prior 0): a test about the prior sets it."""

    def __init__(self, cfg: dict[str, Any], slots: int = 1) -> None:
        super().__init__(cfg, slots, queues=True)
        self.waits.slip = ForecastSlip(prior=0.0)

    @property
    def waits(self) -> AdmissionQueue:
        assert self.queue is not None
        return self.queue

    def exchange(self) -> Exchange:
        exchange = self.admission.exchange()
        self.admission.streams.add(exchange)
        return exchange

    async def hold_the_slot(self, max_tokens: int) -> Exchange:
        """A request holding a slot, expected to run max_tokens at the assumed 100 tokens/s."""
        holder = self.exchange()
        verdicts = await self.send(holder, max_tokens)
        assert isinstance(verdicts[-1], Forward), verdicts
        return holder

    async def send(
        self,
        exchange: Exchange,
        max_tokens: int = 10,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        tenant: str | None = None,
    ) -> list[BodyVerdict]:
        """A chat of `max_tokens` (or `body`) through admission, from `tenant` (None: the default one): every
        verdict, the last its outcome."""
        head = RequestHead("POST", "/v1/chat/completions", headers or {}, tenant=tenant)
        first = exchange.request_headers(head)
        if isinstance(first, Refusal):
            return [first]
        return [v async for v in exchange.request_body(chat(max_tokens) if body is None else body)]

    def waiting(
        self,
        exchange: Exchange,
        max_tokens: int = 10,
        headers: dict[str, str] | None = None,
        tenant: str | None = None,
    ) -> asyncio.Task[list[BodyVerdict]]:
        return asyncio.ensure_future(self.send(exchange, max_tokens, headers, tenant=tenant))

    async def settle(self, exchange: Exchange) -> None:
        exchange.close()
        await self.admission.service.drain()

    async def run_out(self, seconds: float) -> None:
        """Move the clock `seconds` on and let the queue's pump end the waits that ran out."""
        self.clock.advance(seconds)
        self.waits.kick()
        await turns()


def chat(max_tokens: int, content: str = "hi") -> bytes:
    body = {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    return json.dumps(body).encode()


async def turns(n: int = 20) -> None:
    """Let the event loop run queued callbacks (the queue's pump), without any time passing."""
    for _ in range(n):
        await asyncio.sleep(0)


def refusal_of(verdicts: list[BodyVerdict]) -> Refusal:
    last = verdicts[-1]
    assert isinstance(last, Refusal), last
    return last
