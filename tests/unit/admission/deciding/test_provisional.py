"""Bound admission (extproc/admission/deciding/provisional.py): the bound is a bound, it decides only where it
may, and the correction to the exact count happens exactly once, however and whenever the request ends.

Time is a `FakeClock`; nothing sleeps. Background work (the count, the refund) runs when the test yields to
the loop (`settle_loop`), so each test chooses what happens before the count lands.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from extproc.admission.capacity.lanes import LaneFull
from extproc.admission.deciding import provisional
from extproc.admission.deciding.provisional import Correction, Stage
from extproc.admission.exchange import Exchange, Phase, RequestHead
from extproc.admission.intake.request import Api, parse_request
from extproc.admission.replies.verdicts import Forward, Refusal
from extproc.admission.tracking.reading import ResponseReading
from extproc.admission.tracking.unseen import UnseenStreams
from extproc.admission.vocabulary import prompt as prompts
from extproc.admission.vocabulary.prompt import Media, Prompt
from extproc.admission.vocabulary.tokens import DEFAULT_ENCODING, count_text, get_encoding, utf8_len
from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.core.clock import FakeClock
from extproc.core.kv.budget import KvBudget
from extproc.core.limiter.limiter import Lease, LimitSpec
from extproc.metrics import Metrics
from extproc.store.local import LocalStore
from tests.support.rules import admission_rules

HEAD = RequestHead("POST", "/v1/chat/completions", {})
WORDS = "the quick brown fox jumps over a lazy dog while " * 40  # ~2 kB of prose, ~4.5 bytes a token


def body(max_tokens: int | None = 100, content: str = WORDS, stream: bool = False) -> bytes:
    req: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}]}
    if max_tokens is not None:
        req["max_tokens"] = max_tokens
    if stream:
        req["stream"] = True
    return json.dumps(req).encode()


class Rig:
    """A sidecar on a local store with a fake clock, its KV budget, and a count of store refunds."""

    def __init__(self, store: LocalStore, sidecar: Sidecar, budget: KvBudget, clock: FakeClock) -> None:
        self.store, self.sidecar, self.budget, self.clock = store, sidecar, budget, clock
        self.refunds: list[int] = []
        refund = store.refund

        async def counted(lease: Any, tokens: int) -> bool:
            self.refunds.append(tokens)
            return await refund(lease, tokens)

        store.refund = counted  # type: ignore[method-assign]

    @property
    def service(self) -> Any:
        return self.sidecar.admission

    def metric(self, name: str, **labels: str) -> float:
        value = self.sidecar.metrics.registry.get_sample_value(name, labels)
        return value or 0.0

    def ledger(self) -> tuple[float, float, float, float]:
        model = {"model": "other"}
        return (
            self.metric("extproc_tokens_reserved_total", **model),
            self.metric("extproc_tokens_refunded_total", **model),
            self.metric("extproc_tokens_overrun_total", **model),
            self.metric("extproc_tokens_settled_total", model="other", kind="prompt")
            + self.metric("extproc_tokens_settled_total", model="other", kind="completion"),
        )

    def assert_ledger_exact(self) -> None:
        reserved, refunded, overrun, settled = self.ledger()
        assert reserved - refunded + overrun == settled

    def tokens_left(self) -> float:
        bucket = self.store.limiter.snapshot(["global"])[0]
        return bucket.tokens_available if bucket.tokens_available is not None else -1.0

    async def decide(self, raw: bytes) -> tuple[Exchange, Forward | Refusal]:
        exchange = Exchange(self.service)
        exchange.request_headers(HEAD)
        verdicts = [v async for v in exchange.request_body(raw)]
        assert len(verdicts) == 1 and isinstance(verdicts[0], Forward | Refusal)
        return exchange, verdicts[0]


async def rig(
    tokens_per_minute: int | None = 1_000_000, kv_tokens: int = 10**6, config: dict[str, Any] | None = None
) -> Rig:
    clock = FakeClock()
    store = LocalStore(clock)
    await store.apply_limits({"global": LimitSpec(tokens_per_minute=tokens_per_minute)})
    sidecar = Sidecar(config=parse_config(config or {}), store=store, metrics=Metrics(), clock=clock)
    budget = KvBudget(capacity_tokens=kv_tokens, target_utilization=1.0)
    sidecar.admission.deps.kv_budget = lambda _pool: budget
    return Rig(store, sidecar, budget, clock)


async def settle_loop() -> None:
    """Let background work (count, refund, settlement) run; bounded, no wall-clock waiting."""
    for _ in range(50):
        await asyncio.sleep(0)


def exact_prompt(raw: bytes) -> int:
    """What the exact path reserves for this body's prompt."""
    policy = admission_rules().model_policy("m")
    assert policy is not None
    parsed = parse_request(Api("chat"), raw)
    return sum(prompts.count(p, policy).high for p in parsed.prompts)


# -- the bound is a bound ------------------------------------------------------------------------------------


def test_every_token_of_the_sidecars_encoding_is_at_least_one_byte() -> None:
    """The proof of `count <= bytes`: a BPE over bytes whose every token spans >= 1 byte, special tokens
    encoded as ordinary text (`encode_ordinary`), so no token can stand for less than a byte."""
    ranks = get_encoding(DEFAULT_ENCODING)._mergeable_ranks
    assert ranks and min(len(token) for token in ranks) >= 1


@pytest.mark.parametrize(
    "text",
    [
        "<|endoftext|><|fim_prefix|><|im_start|>",  # special-token strings count as plain text
        "\ud800 lone \udfff surrogates",  # U+FFFD, 3 bytes each, as utf8_len counts them
        "".join(chr(0x1F600 + i) for i in range(64)),  # astral: the densest tokens per byte
        "中文文本的标记" * 30,
        " " * 5000,
        "a" * 3000,
    ],
)
def test_text_never_has_more_tokens_than_utf8_bytes(text: str) -> None:
    assert count_text(text) <= utf8_len(text)


def test_random_text_never_has_more_tokens_than_bytes() -> None:
    rng = random.Random(20)
    alphabet = [chr(c) for c in (*range(32, 127), *range(0x400, 0x430), *range(0x4E00, 0x4E40))]
    alphabet += [chr(0x1F300 + i) for i in range(40)] + ["\n", "\t", "<|endoftext|>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        assert count_text(text) <= utf8_len(text)


def test_the_upper_bound_covers_token_ids_template_and_media() -> None:
    """The non-text parts are the same fixed number in the bound and in the count."""
    policy = admission_rules().model_policy("m")
    assert policy is not None
    item = Prompt(
        texts=("user", "<|endoftext|> hi", "\ud83d"),
        fixed_tokens=17,
        messages=3,
        templated=True,
        media=Media(images=2, audios=1),
    )
    counted = prompts.count(item, policy)
    assert counted.high <= prompts.upper_bound(item, policy)
    assert prompts.lower_bound(item, policy) <= counted.low


# -- where the bound decides -------------------------------------------------------------------------------


def plan_for(raw: bytes, config: dict[str, Any] | None = None) -> Any:
    rules = admission_rules(config)
    policy = rules.model_policy("m")
    assert policy is not None
    return provisional.bound_plan(parse_request(Api("chat"), raw), policy, rules.per_step)


def test_the_bound_decides_far_from_the_window() -> None:
    plan = plan_for(body(max_tokens=100))
    assert plan is not None and plan.completion_tokens == 100
    assert plan.prompt_tokens >= exact_prompt(body(max_tokens=100))


def test_near_the_window_the_exact_count_decides() -> None:
    """Bound + max_tokens past the 8192 window, exact count + max_tokens inside it: no bound admission."""
    content = WORDS * 3  # ~6 kB of bytes, ~1.3k tokens
    raw = body(max_tokens=8192 - 2 * exact_prompt(body(content=content)), content=content)
    assert plan_for(raw) is None


def test_without_max_tokens_the_rest_of_the_window_depends_on_the_count() -> None:
    assert plan_for(body(max_tokens=None)) is None  # `reserve_window`: window - prompt
    inject = {"models": {"*": {"context_window": 8192, "missing_max_tokens": "inject"}}}
    injected = plan_for(body(max_tokens=None), inject)
    assert injected is not None and injected.injected_max_tokens == 1024


# -- the correction ----------------------------------------------------------------------------------------


def stage_now(correction: Correction) -> Stage:
    """The stage read afresh: it moves on while the loop runs, after an assert that mypy keeps as narrowing
    `correction.stage` to the stage it had then."""
    return correction.stage


async def test_admitted_on_the_bound_then_corrected_once_while_it_runs() -> None:
    r = await rig()
    raw = body()
    exchange, verdict = await r.decide(raw)
    assert isinstance(verdict, Forward) and exchange.phase is Phase.ADMITTED
    correction = exchange.correction
    assert correction is not None and correction.stage is Stage.COUNTING
    bound_total = exchange.admitted.plan.total  # type: ignore[union-attr]
    assert r.tokens_left() == 1_000_000 - bound_total
    await settle_loop()
    exact = exact_prompt(raw)
    assert stage_now(correction) is Stage.CORRECTED
    assert exchange.admitted is not None and exchange.admitted.plan.prompt_tokens == exact
    assert exchange.admitted.lease.reserved_tokens == exact + 100
    assert r.refunds == [bound_total - exact - 100]
    assert r.tokens_left() == 1_000_000 - exact - 100  # the bucket has the difference back already
    assert r.budget.demand_tokens <= exact + 100
    exchange.response_headers(200, "application/json", False)
    usage = {"prompt_tokens": exact, "completion_tokens": 7, "total_tokens": exact + 7}
    await exchange.response_body(json.dumps({"usage": usage}).encode(), True)
    exchange.close()
    await r.service.drain()
    assert r.refunds == [bound_total - exact - 100]  # exactly once
    assert r.metric("extproc_tokens_refunded_total", model="other") == bound_total - exact - 7
    r.assert_ledger_exact()
    assert r.tokens_left() == 1_000_000 - exact - 7
    assert r.budget.leases == 0


def end_inline(exchange: Exchange, how: str) -> None:
    if how == "disconnect":
        exchange.close()
    elif how == "error":
        exchange.response_headers(500, "application/json", False)
        exchange.close()
    elif how == "cut":
        exchange.response_headers(200, "text/event-stream", False)
        assert exchange.response is not None and exchange.inflight is not None
        exchange.inflight.was_cut = True  # what `InFlight.cut` decides under KV pressure
        exchange.inflight.settle()
    elif how == "expired":
        assert exchange.inflight is not None
        exchange.inflight.expire()
    elif how == "reported":
        assert exchange.inflight is not None
        unseen = UnseenStreams(exchange.service)
        key = unseen.expect_report(exchange.inflight)
        unseen.report(key, None, ResponseReading())  # no response started
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["disconnect", "error", "cut", "expired", "reported"])
async def test_a_request_that_ends_before_its_count_settles_once_on_the_exact_count(how: str) -> None:
    r = await rig()
    raw = body()
    exchange, verdict = await r.decide(raw)
    assert isinstance(verdict, Forward)
    correction = exchange.correction
    assert correction is not None and correction.stage is Stage.COUNTING
    end_inline(exchange, how)  # before the count ran
    assert exchange.phase is Phase.SETTLED
    assert r.metric("extproc_settlements_total", outcome="aborted") == 0  # held, not settled on the bound
    exchange.close()  # a second end signal changes nothing
    await settle_loop()
    await r.service.drain()
    assert stage_now(correction) is Stage.CORRECTED
    assert r.refunds == []  # folded into the settlement: no separate refund
    exact = exact_prompt(raw)
    settled = r.metric("extproc_tokens_settled_total", model="other", kind="prompt")
    assert settled == exact
    assert sum(r.metric("extproc_settlements_total", outcome=o) for o in _OUTCOMES) == 1
    r.assert_ledger_exact()
    assert r.store.limiter.snapshot(["global"])[0].active == 0 and r.budget.leases == 0


_OUTCOMES = ("completed", "aborted", "upstream_error", "cut", "expired")


async def test_a_settlement_during_the_refund_waits_for_it() -> None:
    """The store must never see the release of a lease race its refund (a release sends the reservation)."""
    r = await rig()
    gate = asyncio.Event()
    order: list[str] = []
    refund, release = r.store.refund, r.store.release

    async def slow_refund(lease: Lease, tokens: int) -> bool:
        await gate.wait()
        order.append("refund")
        return await refund(lease, tokens)

    async def noted_release(lease: Lease, actual_tokens: int, actual_output: int = 0) -> bool:
        order.append("release")
        return await release(lease, actual_tokens, actual_output)

    r.store.refund = slow_refund  # type: ignore[method-assign]
    r.store.release = noted_release  # type: ignore[method-assign]
    exchange, _ = await r.decide(body())
    await settle_loop()
    correction = exchange.correction
    assert correction is not None and correction.stage is Stage.REFUNDING
    exchange.close()
    await settle_loop()
    assert order == []
    gate.set()
    await settle_loop()
    await r.service.drain()
    assert order == ["refund", "release"]
    r.assert_ledger_exact()
    assert r.tokens_left() == 1_000_000 - exact_prompt(body())  # nothing streamed: the prompt is charged


async def test_a_count_that_fails_keeps_the_bound_and_settles_on_it() -> None:
    r = await rig()

    async def busy(*_args: Any, **_kwargs: Any) -> Any:
        raise LaneFull("tenant:default", 0.25)

    exchange, _ = await r.decide(body())
    r.service.count_prompts = busy
    await settle_loop()
    correction = exchange.correction
    assert correction is not None and correction.stage is Stage.ABANDONED
    bound = exchange.admitted.plan.prompt_tokens  # type: ignore[union-attr]
    exchange.close()
    await r.service.drain()
    assert r.refunds == []
    assert r.metric("extproc_tokens_settled_total", model="other", kind="prompt") == bound
    r.assert_ledger_exact()


# -- near a limit: counted first, never refused for the over-estimate ---------------------------------------


async def test_a_bucket_the_bound_overflows_admits_on_the_exact_count() -> None:
    raw = body()
    exact_total = exact_prompt(raw) + 100
    r = await rig(tokens_per_minute=exact_total + 10)
    exchange, verdict = await r.decide(raw)
    assert isinstance(verdict, Forward)
    assert exchange.correction is None
    assert exchange.admitted is not None and exchange.admitted.lease.reserved_tokens == exact_total
    exchange.close()
    await r.service.drain()
    r.assert_ledger_exact()


async def test_a_kv_budget_the_bound_overflows_admits_on_the_exact_count() -> None:
    raw = body()
    exact_total = exact_prompt(raw) + 100
    r = await rig(kv_tokens=exact_total + 10)
    r.budget.admit("other", 0, 0)  # not empty, so nothing is admitted for being first
    exchange, verdict = await r.decide(raw)
    assert isinstance(verdict, Forward)
    assert exchange.correction is None
    exchange.close()
    await r.service.drain()


async def test_switched_off_every_request_is_counted_first() -> None:
    r = await rig(config={"admission": {"bound_admission": False}})
    exchange, verdict = await r.decide(body())
    assert isinstance(verdict, Forward) and exchange.correction is None
    exchange.close()
    await r.service.drain()
    assert r.refunds == []
    r.assert_ledger_exact()


async def test_the_count_starts_only_once_the_proxy_has_the_verdict() -> None:
    """Off the critical path: nothing is counted until the handler comes back for the next verdict (it has
    written this one); a request that ends before then starts its count from the settlement."""
    r = await rig()
    exchange = Exchange(r.service)
    exchange.request_headers(HEAD)
    verdicts = exchange.request_body(body())
    verdict = await verdicts.__anext__()
    assert isinstance(verdict, Forward)
    correction = exchange.correction
    assert correction is not None and correction.task is None
    await settle_loop()
    assert correction.task is None  # still waiting for the handler
    exchange.close()  # the request ended first
    assert correction.task is not None
    await settle_loop()
    await r.service.drain()
    assert correction.stage is Stage.CORRECTED
    assert r.metric("extproc_tokens_settled_total", model="other", kind="prompt") == exact_prompt(body())
    r.assert_ledger_exact()
    with pytest.raises(StopAsyncIteration):
        await verdicts.__anext__()
    assert correction.task is not None  # started once


@pytest.mark.parametrize("lane_free", [True, False])
async def test_a_large_prompt_takes_the_bound_only_while_its_tokenizer_lane_is_free(lane_free: bool) -> None:
    """The count after must not queue in the client's lane: it could delay or refuse the next request."""
    r = await rig(config={"models": {"*": {"context_window": 32768}}})
    raw = body(content=WORDS * 5)  # ~10 kB: counted on the tokenizer threads
    r.service.lanes.free = lambda _lane: lane_free
    exchange, verdict = await r.decide(raw)
    assert isinstance(verdict, Forward)
    assert (exchange.correction is not None) is lane_free
    await settle_loop()
    exchange.close()
    await r.service.drain()
    r.assert_ledger_exact()
