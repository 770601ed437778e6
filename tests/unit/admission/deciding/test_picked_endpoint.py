"""A request whose endpoint picker named its engine is booked on that engine's KV budget, where the operator
trusts the header (`admission.inference_pool.trust_destination_endpoint`) and the feed knows the engine;
otherwise on the pool's, as without a picker."""

from __future__ import annotations

import pytest

from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.intake.endpoint import picked_endpoint
from extproc.admission.replies.verdicts import Forward
from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.core.kv.budget import KvBudget
from extproc.metrics import Metrics
from extproc.store.local import LocalStore
from tests.support.servicer import chat

HEADER = "x-gateway-destination-endpoint"
ENGINE = "10.0.0.2:8000"


@pytest.mark.parametrize(
    ("value", "primary"),
    [
        ("10.0.0.2:8000", "10.0.0.2:8000"),
        (" 10.0.0.2:8000 ,10.0.0.3:8000", "10.0.0.2:8000"),  # the primary, then the fallbacks
        ("[fd00::2]:8000", "[fd00::2]:8000"),
        ("vllm-0.vllm.ns.svc:8000", "vllm-0.vllm.ns.svc:8000"),
        ("10.0.0.2", None),  # no port
        ("", None),
        ("10.0.0.2:8000/v1", None),
        ("a" * 300 + ":80", None),
    ],
)
def test_the_primary_endpoint_is_read_and_anything_else_ignored(value: str, primary: str | None) -> None:
    assert picked_endpoint({HEADER: value}, trusted=True) == primary


def test_an_untrusted_header_is_never_read() -> None:
    assert picked_endpoint({HEADER: ENGINE}, trusted=False) is None


class Budgets:
    """The feed's side as admission asks it: one pool's budget, and one engine's for `ENGINE`."""

    def __init__(self) -> None:
        self.pool = KvBudget(capacity_tokens=10**6)
        self.engine = KvBudget(capacity_tokens=10**6)
        self.asked: list[tuple[str, str]] = []

    def endpoint_budget(self, pool: str, endpoint: str) -> tuple[str, KvBudget] | None:
        self.asked.append((pool, endpoint))
        return (f"{pool}@{endpoint}", self.engine) if endpoint == ENGINE else None


async def booked_on(trusted: bool, value: str | None) -> tuple[Budgets, list[str], float]:
    budgets, changed = Budgets(), list[str]()
    config = {"admission": {"inference_pool": {"trust_destination_endpoint": trusted}}}
    sidecar = Sidecar(config=parse_config(config), store=LocalStore(), metrics=Metrics())
    deps = sidecar.admission.deps
    deps.kv_budget = lambda _pool: budgets.pool
    deps.endpoint_budget = budgets.endpoint_budget
    deps.budget_changed = changed.append
    exchange = Exchange(sidecar.admission)
    exchange.request_headers(RequestHead("POST", "/v1/chat/completions", {HEADER: value} if value else {}))
    verdicts = [v async for v in exchange.request_body(chat(max_tokens=100))]
    assert len(verdicts) == 1 and isinstance(verdicts[0], Forward)
    await sidecar.admission.drain()
    unread = sum(
        s.value
        for m in sidecar.metrics.registry.collect()
        for s in m.samples
        if s.name == "extproc_picked_engine_unread_total"
    )
    return budgets, changed, unread


async def test_a_trusted_pick_books_the_engine_and_publishes_its_key() -> None:
    budgets, changed, unread = await booked_on(True, f"{ENGINE},10.0.0.3:8000")
    assert budgets.engine.leases == 1 and budgets.pool.leases == 0 and unread == 0
    assert budgets.asked == [("*", ENGINE)]  # the pool of a model the config does not name
    assert changed and set(changed) == {f"*@{ENGINE}"}


async def test_an_untrusted_or_unknown_pick_books_the_pool() -> None:
    for trusted, value, unknown in ((False, ENGINE, 0), (True, "10.9.9.9:8000", 1), (True, None, 0)):
        budgets, changed, unread = await booked_on(trusted, value)
        assert budgets.pool.leases == 1 and budgets.engine.leases == 0, (trusted, value)
        assert ENGINE not in "".join(changed)
        assert unread == unknown, (trusted, value)  # a picked engine the feed does not read is counted
