"""When a refused request will fit: the KV budget's forecast of releases and of the places promised to the
requests refused before it (`KvBudget.retry_after`), and the hint a refusal carries."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from extproc.admission.replies import refusals
from extproc.core.clock import FakeClock
from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.fairness import FairShare
from extproc.core.kv.prefix import PromptChunks


def budget_at_pace(tokens_per_second: float | None) -> KvBudget:
    budget = KvBudget(capacity_tokens=1000, target_utilization=1.0)
    if tokens_per_second is not None:
        budget.pace.observe_stream(tokens_per_second, 1.0)
    budget.admit("long", 100, 400, now=0.0)  # footprint 500, ends 4 s in at 100 tokens/s
    budget.admit("short", 100, 100, now=0.0)  # footprint 200, ends 1 s in
    return budget


def test_the_first_release_that_frees_enough_comes_first() -> None:
    budget = budget_at_pace(100.0)
    fits, _ = budget.would_fit(100, 300, now=0.0)  # 700 booked + 400 > 1000: 100 too many
    assert not fits
    assert budget.retry_after(0.0) == 1.0  # the short lease's 200 frees enough, for the 3 s it runs


def test_a_release_too_small_is_skipped() -> None:
    budget = budget_at_pace(100.0)
    fits, _ = budget.would_fit(100, 550, now=0.0)  # 250 too many: the short lease's 200 is not enough
    assert not fits
    assert budget.retry_after(0.0) == 4.0


def test_progress_brings_the_release_closer() -> None:
    budget = budget_at_pace(100.0)
    budget.would_fit(100, 300, now=0.5)
    assert budget.retry_after(0.5) == 0.5


def test_no_pace_no_forecast() -> None:
    budget = budget_at_pace(None)
    budget.would_fit(100, 300, now=0.0)
    assert budget.retry_after(0.0) is None


def test_refusal_hint_follows_the_forecast_and_spreads_a_flood() -> None:
    budget = budget_at_pace(100.0)
    waits = []
    for _ in range(3):  # three clients sending the same body
        assert not budget.would_fit(100, 300, now=0.0)[0]
        waits.append(refusals.kv_retry_after(budget, 0.0))
    # The first fits when the short lease ends; the second would not fit beside it, so it is sent to the
    # long lease's end, where the third fits beside it too.
    assert waits == [1.0, 4.0, 4.0]
    headers = dict(refusals.kv_budget("m", 400, 0, waits[1]).headers)
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("4", "4000")


def test_unknown_pace_falls_back_to_the_fixed_hint() -> None:
    budget = budget_at_pace(None)
    budget.would_fit(100, 300, now=0.0)
    assert refusals.kv_retry_after(budget, 0.0) == refusals.KV_RETRY_AFTER_S


def test_hints_are_bounded_by_what_sdks_honour() -> None:
    budget = KvBudget(capacity_tokens=1000, target_utilization=1.0)
    budget.pace.observe_stream(16, 1000.0)  # 0.016 tokens/s: a lease ends in hours
    budget.admit("slow", 100, 800, now=0.0)
    budget.would_fit(100, 300, now=0.0)
    assert refusals.kv_retry_after(budget, 0.0) == 60.0


def test_a_forecast_of_now_is_not_followed_below_a_second() -> None:
    """Leases taken for finished (a pace learned too fast) give an ETA of ~0 for a request just refused."""
    budget = budget_at_pace(100.0)
    budget.would_fit(100, 300, now=10.0)  # 10 s in, at 100 tokens/s both leases should have ended
    assert budget.retry_after(10.0) == 0.0
    assert refusals.kv_retry_after(budget, 10.0) == refusals.KV_RETRY_AFTER_S


def test_a_burst_is_sent_back_in_waves_the_cache_holds() -> None:
    """Forty at once where eight fit: the refused thirty-two are sent to the first release, then to the
    ends of the answers promised before them, eight at a time, not all to the first release."""
    budget = KvBudget(capacity_tokens=800, target_utilization=1.0)
    budget.pace.observe_stream(100, 1.0)  # 100 tokens/s: a 100-token answer runs 1 s
    for index in range(8):
        budget.admit(f"r{index}", 0, 100, now=0.0)
    waits = []
    for _ in range(32):
        assert not budget.would_fit(0, 100, now=0.0)[0]
        waits.append(budget.retry_after(0.0))
    assert waits == [1.0] * 8 + [2.0] * 8 + [3.0] * 8 + [4.0] * 8
    budget.admit("back", 0, 100, now=1.0)  # one of the first wave is admitted: its place is taken
    assert budget.schedule.promises == 31


# -- a cold start: no pace learned from streams yet ---------------------------------------------------------

CACHE = 16_384
PROMPT, ANSWER = 1_500, 300
ENGINE_PACE = 80.0
"""Tokens per second per sequence the modeled engine decodes at under the burst's batch, as the feed reads
it from the engines' counters; nothing has streamed through the gateway yet, so nothing is learned."""
SAMPLE_S = 0.05
ARRIVAL_S = 0.002
"""A burst sent at once reaches the budget over milliseconds: each refusal is planned a little later."""


def cold_pool() -> tuple[KvBudget, FakeClock]:
    clock = FakeClock()
    budget = KvBudget(CACHE, target_utilization=0.9, booking=BookingMode.FORECAST, fairness=FairShare())
    budget.observe_fed_pace(ENGINE_PACE)
    budget.observe_engine(0.0, clock(), fresh_for=2.0, waiting=0, running=0)
    return budget, clock


def engine_sample(
    budget: KvBudget, clock: FakeClock, ends: dict[str, float], foreign: Callable[[], float] = lambda: 0.0
) -> None:
    """`SAMPLE_S` later: the answers due by then end (`ends`: each lease's end), and the feed reads the KV the
    engine holds, the running answers' and `foreign()`, that of requests that did not pass the gateway."""
    clock.advance(SAMPLE_S)
    for lease_id in [lid for lid, end in ends.items() if end <= clock()]:
        budget.release(lease_id, ANSWER)
        del ends[lease_id]
    held = sum(PROMPT + ENGINE_PACE * (clock() - (end - ANSWER / ENGINE_PACE)) for end in ends.values())
    budget.observe_engine(held + foreign(), clock(), fresh_for=2.0, waiting=0, running=len(ends))


def burst_until_admitted(
    budget: KvBudget, clock: FakeClock, requests: int
) -> tuple[list[float], list[float]]:
    """`requests` chats sent at once to a modeled engine behind `budget` (the lean profile: no progress seen,
    each answer runs `ANSWER` tokens at `ENGINE_PACE` and ends; the feed samples the KV it holds every
    `SAMPLE_S`). Returns, for each refused request in order of arrival, the `retry-after` it got, and how
    long after its refusal it was in fact admitted when tried again at every sample."""
    ends: dict[str, float] = {}
    hints: list[float] = []
    waiting: list[int] = []
    refused_at: dict[int, float] = {}
    admitted_at: dict[int, float] = {}

    def try_admit(index: int) -> bool:
        prompt = PROMPT + index  # distinct prompts: each request known apart on its retries
        if not budget.would_fit(prompt, ANSWER, "tenant", now=clock())[0]:
            return False
        budget.admit(f"r{index}", prompt, ANSWER, "tenant", now=clock())
        ends[f"r{index}"] = clock() + ANSWER / ENGINE_PACE
        admitted_at[index] = clock()
        return True

    for index in range(requests):
        if not try_admit(index):
            hints.append(refusals.kv_retry_after(budget, clock()))
            waiting.append(index)
            refused_at[index] = clock()
        clock.advance(ARRIVAL_S)
    while waiting:
        engine_sample(budget, clock, ends)
        while waiting and try_admit(waiting[0]):
            waiting.pop(0)
    return hints, [admitted_at[i] - refused_at[i] for i in sorted(refused_at)]


def requests_s(requests: int) -> float:
    return requests * ARRIVAL_S


def within_twice(hint: float, actual: float) -> bool:
    return actual / 2 <= hint <= actual * 2


def test_the_first_refusal_after_a_cold_start_is_told_when_it_fits() -> None:
    """Forty at once where eight fit, before any stream has taught the budget a pace: the first refused
    request is told about when the first answers end (at the engines' fed pace), within 2x of the moment
    it could in fact be admitted; those refused after it, milliseconds later, are told successive, later
    moments. The flat second this hint was before fails the same check (3.75 s away); and with the plan
    reading the tenant's service as it stood when each earlier promise was made, every refusal after the
    first was sent to the first release."""
    budget, clock = cold_pool()
    assert budget.decode_rate() is None  # nothing learned: the forecast itself books whole footprints
    hints, admitted = burst_until_admitted(budget, clock, 40)
    assert len(hints) == 32 and len(admitted) == 32
    first = admitted[0]
    assert first == pytest.approx(ANSWER / ENGINE_PACE, abs=SAMPLE_S + requests_s(40))
    assert within_twice(hints[0], first), (hints[0], first)
    assert not within_twice(refusals.KV_RETRY_AFTER_S, first)
    # Successive refused clients are sent to successive waves, each hint within 2x of its own admission.
    assert hints == sorted(hints) and hints[-1] > 3 * hints[0]
    assert all(within_twice(hint, at) for hint, at in zip(hints, admitted, strict=True)), (hints, admitted)


def test_without_a_fed_pace_the_assumed_one_forecasts() -> None:
    """No stream yet and no feed pace (an engine idle since its exporter started): the pace admission
    assumes (`admission.assumed_decode_tokens_per_second`) forecasts, never a flat second."""
    budget = budget_at_pace(None)
    budget.would_fit(100, 550, now=0.0)
    assert budget.retry_after(0.0) is None
    budget.assume_pace(100.0)
    assert budget.would_fit(100, 550, now=0.0)[0] is False
    assert refusals.kv_retry_after(budget, 0.0) == 4.0  # the long lease's end at 100 tokens/s
    fed = budget_at_pace(None)
    fed.assume_pace(100.0)
    fed.observe_fed_pace(50.0)  # the engines' own pace comes first
    assert fed.would_fit(100, 550, now=0.0)[0] is False
    assert refusals.kv_retry_after(fed, 0.0) == 8.0
    budget.observe_fed_pace(50.0)
    budget.pace.observe_stream(100, 1.0)  # a learned pace faster than the engines' now: the slower one
    assert budget.hint_rate() == 50.0


def step_pace(batch: float) -> float:
    """The modeled engine's pace per sequence at `batch`: a step of 4.5 ms plus 1 ms a sequence (80 tokens/s
    at the burst's eight, `ENGINE_PACE`; 19 at forty-eight)."""
    return 1.0 / (0.0045 + 0.001 * batch)


def drained_pool(*batches: int) -> tuple[KvBudget, FakeClock]:
    """A pool whose feed read the engines' pace at `batches` (the last a load of that many), then saw them
    drain: the feed holds the last pace read, with nothing running."""
    clock = FakeClock()
    budget = KvBudget(CACHE, target_utilization=0.9, booking=BookingMode.FORECAST, fairness=FairShare())
    for batch in batches:
        budget.observe_fed_pace(step_pace(batch), running=batch)
    budget.observe_fed_pace(step_pace(batches[-1]), running=0)
    budget.observe_engine(0.0, clock(), fresh_for=2.0, waiting=0, running=0)
    return budget, clock


def test_a_pace_held_from_a_larger_batch_is_taken_at_the_batch_that_runs() -> None:
    """After a load of forty-eight the feed holds their pace (19 tokens/s); a burst of forty then runs eight
    at 80. Read at two batch sizes (a warm-up's one and the load's forty-eight), the engine's step time is
    fitted against its batch and the hints take the pace of the eight: each within 2x of its admission.
    Held as read, the first refused client was told 16 s for an admission 3.75 s away."""
    budget, clock = drained_pool(1, 48)
    hints, admitted = burst_until_admitted(budget, clock, 40)
    assert step_pace(8) == pytest.approx(ENGINE_PACE)
    assert all(within_twice(hint, at) for hint, at in zip(hints, admitted, strict=True)), (hints, admitted)
    held, clock = drained_pool(48)
    hints, admitted = burst_until_admitted(held, clock, 40)
    assert held.hint_rate() == pytest.approx(step_pace(48))
    assert not within_twice(hints[0], admitted[0]), (hints[0], admitted[0])


SYSTEM_TOKENS, OWN_TOKENS = 1_600, 30


def shared_prompt() -> PromptChunks:
    """A chat's prompt chunks: one system text of `SYSTEM_TOKENS` every chat shares, cut in sixteen chunks."""
    hashes = tuple(hash(("system", i)) for i in range(16))
    return PromptChunks(hashes, 100, 1_700, (16,), (SYSTEM_TOKENS,))


def test_a_burst_that_shares_a_prefix_is_planned_at_what_each_adds() -> None:
    """Chats sharing a 1,600-token system prompt: the cache holds the prompt once and thirty-nine answers.
    The twenty refused after them all fit once the first wave ends, as each adds its own 330 tokens, and
    are all told that moment. Planned at their whole footprints (the system prompt again in every place),
    eight were told the first wave's end and the others one or two waves later."""
    budget = KvBudget(capacity_tokens=16_384, target_utilization=0.9)
    budget.pace.observe_stream(100, 1.0)  # 100 tokens/s: a 300-token answer runs 3 s
    prompt, chunks = SYSTEM_TOKENS + OWN_TOKENS, shared_prompt()
    admitted = 0
    while budget.would_fit(prompt, 300, now=0.0, chunks=chunks)[0]:
        budget.admit(f"r{admitted}", prompt, 300, now=0.0, chunks=chunks)
        admitted += 1
    assert admitted == 39
    hints = []
    for index in range(20):
        assert not budget.would_fit(prompt + index, 300, f"t{index}", now=0.0, chunks=chunks)[0]
        hints.append(budget.retry_after(0.0))
    assert hints == [3.0] * 20


# -- KV in use that no lease explains ------------------------------------------------------------------------

SDK_ATTEMPTS = 3
"""The `openai` SDK's default: the first attempt and two retries, each after the `retry-after` it was told."""


def sdk_burst(foreign: Callable[[float], float], requests: int = 40) -> tuple[int, float]:
    """`requests` chats sent at once beside `foreign(t)` KV tokens of requests that did not pass this gateway
    (`t` s after the burst; the engine model of `burst_until_admitted`), each client coming back when its
    refusal says. Returns how
    many needed more attempts than the SDK makes, and when the last was admitted."""
    budget, clock = cold_pool()
    start = clock()
    budget.observe_engine(foreign(0.0), start, fresh_for=2.0, waiting=0, running=6)
    ends: dict[str, float] = {}
    attempts: dict[int, int] = {}
    back_at: dict[int, float] = {}
    admitted: list[float] = []

    def attempt(index: int) -> None:
        attempts[index] = attempts.get(index, 0) + 1
        if budget.would_fit(PROMPT + index, ANSWER, "tenant", now=clock())[0]:
            budget.admit(f"r{index}", PROMPT + index, ANSWER, "tenant", now=clock())
            ends[f"r{index}"] = clock() + ANSWER / ENGINE_PACE
            admitted.append(clock() - start)
        else:
            back_at[index] = clock() + refusals.kv_retry_after(budget, clock())

    for index in range(requests):
        attempt(index)
        clock.advance(ARRIVAL_S)
    while back_at:
        engine_sample(budget, clock, ends, lambda: foreign(clock() - start))
        for index in sorted((i for i, at in back_at.items() if at <= clock()), key=back_at.__getitem__):
            del back_at[index]
            attempt(index)
    return sum(1 for count in attempts.values() if count > SDK_ATTEMPTS), max(admitted)


def test_kv_no_lease_explains_is_planned_held_so_hint_following_clients_are_not_sent_back_early() -> None:
    """The engine holds 10,800 tokens of requests that did not pass this gateway (six chats); a cold burst of
    forty arrives and two fit beside them. A refusal's hint plans that KV as held until the next sample
    says otherwise. Planned to free evenly over one answer (tried), the hints came sooner, but clients that
    follow them with the SDK's two retries were sent back before their KV freed: 30 of 40 needed more
    attempts where the load went on (9 planned held), and 3 where it ended within one answer (0)."""
    lasting_lost, _ = sdk_burst(lambda _t: 10_800.0)
    assert lasting_lost <= 10
    ends = [ANSWER / ENGINE_PACE * (i + 1) / 6 for i in range(6)]
    ended_lost, last = sdk_burst(lambda t: sum(PROMPT + ANSWER for end in ends if end > t))
    assert ended_lost == 0
    assert last <= 60 + ANSWER / ENGINE_PACE  # told at most the 60 s cap, then admitted
