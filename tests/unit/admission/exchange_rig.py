"""The admission rig of test_exchange.py and the tests that drive one request through admission as it does:
admission built as the sidecar builds it, over an in-process store and a fake clock."""

from __future__ import annotations

import json
from typing import Any

from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.replies.verdicts import Forward, Hold, Refusal
from tests.support.admission import AdmissionRig

CONFIG: dict[str, Any] = {
    "admission": {"tenant": {"header": "x-tenant"}},
    "classes": [{"name": "standard"}, {"name": "batch", "backend_priority": 7}],
    "default_class": "standard",
    "tenants": {"nightly": {"class": "batch"}},
    "models": {"*": {"context_window": 1000, "default_max_tokens": 100}},
}
HEAD = RequestHead("POST", "/v1/chat/completions", {})


class Rig(AdmissionRig):
    """Admission over an in-process store, a fake clock and a KV usage the test sets."""

    def __init__(self, config: dict[str, Any] = CONFIG, concurrency: int | None = None) -> None:
        super().__init__(config, concurrency)

    def total(self, name: str) -> float:
        """`name` summed over every label set."""
        return sum(
            sample.value
            for family in self.metrics.registry.collect()
            for sample in family.samples
            if sample.name == name
        )

    def total_prompt(self) -> float:
        return sum(
            sample.value
            for family in self.metrics.registry.collect()
            for sample in family.samples
            if sample.name == "extproc_tokens_settled_total" and sample.labels.get("kind") == "prompt"
        )

    async def decide(self, exchange: Exchange, body: bytes, head: RequestHead = HEAD) -> Forward | Refusal:
        exchange.request_headers(head)
        verdicts = [v async for v in exchange.request_body(body)]
        assert len(verdicts) == 1 and not isinstance(verdicts[0], Hold)
        return verdicts[0]

    async def settled(self) -> None:
        await self.admission.service.drain()


def chat(max_tokens: int = 100, stream: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()
