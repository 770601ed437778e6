"""Shared prompt prefixes in the KV budget: a chunk held by several leases is booked once per replica, the
last holders pay, and a payer's release makes the next holder pay again (core/kv/prefix.py)."""

from __future__ import annotations

import itertools

import pytest

from extproc.core.kv.budget import PREFIX_MARGIN_TOKENS, BookingMode, KvBudget
from extproc.core.kv.prefix import PrefixIndex, PromptChunks

SYSTEM = tuple(range(100, 112))  # twelve chunks of a shared system prompt
_OWN = itertools.count(10_000)


PROMPT = 1300  # tokens of a prompt of thirteen chunks: one chunk stands for 100 tokens
SHARED = 12 * 100 - 12 * 100 % PREFIX_MARGIN_TOKENS
"""What a prompt sharing the twelve chunks is credited: their tokens, cut to whole engine blocks."""


def chunks(own: int = 1, *, shared: tuple[int, ...] = SYSTEM) -> PromptChunks:
    """A prompt of the shared chunks followed by `own` chunks of its own (hashes unique to it), each chunk a
    text of its own of 100 tokens, counted."""
    tail = tuple(next(_OWN) for _ in range(own))
    n = len(shared) + own
    ends = tuple(range(1, n + 1))
    tokens = tuple(100 * (i + 1) for i in range(n))
    return PromptChunks(
        shared + tail, chunk_chars=400, text_chars=400 * n, text_ends=ends, text_tokens=tokens
    )


def budget(capacity: int = 100_000) -> KvBudget:
    return KvBudget(capacity, target_utilization=1.0)


def test_index_last_holders_pay_and_release_moves_payment() -> None:
    index = PrefixIndex()
    assert index.add("a", (1, 2, 3)) == {}
    assert index.add("b", (1, 2, 9)) == {"a": 2}
    assert index.credited("a", (1, 2, 3)) == 2 and index.credited("b", (1, 2, 9)) == 0
    assert index.shared_run((1, 2, 7)) == 2
    assert index.remove("b", (1, 2, 9)) == {"a": 2}
    assert index.credited("a", (1, 2, 3)) == 0
    assert index.remove("a", (1, 2, 3)) == {} and len(index) == 0


def test_index_books_a_chunk_once_per_replica() -> None:
    index = PrefixIndex(replicas=2)
    index.add("a", (1,))
    assert index.add("b", (1,)) == {}  # two replicas may each hold it
    assert index.add("c", (1,)) == {"a": 1}
    assert index.remove("c", (1,)) == {"a": 1}  # a pays again
    assert index.remove("a", (1,)) == {}  # b pays as it did


def test_shared_prompt_is_booked_once() -> None:
    kv = budget()
    prompt = PROMPT
    first, second = chunks(1), chunks(1)
    kv.admit("a", prompt, 300, chunks=first)
    assert kv.demand_tokens == prompt + 300
    kv.admit("b", prompt, 300, chunks=second)
    # 12 credited chunks of 13 stand for 1,200 tokens, 1,152 in whole blocks of 64 (the block size unknown).
    assert kv.shared_prompt_tokens == SHARED
    assert kv.demand_tokens == 2 * (prompt + 300) - SHARED


def test_payer_release_makes_the_holder_pay_again() -> None:
    kv = budget()
    prompt = PROMPT
    kv.admit("a", prompt, 300, chunks=chunks(1))
    kv.admit("b", prompt, 300, chunks=chunks(1))
    kv.release("b")
    assert kv.shared_prompt_tokens == 0
    assert kv.demand_tokens == prompt + 300
    kv.admit("c", prompt, 300, chunks=chunks(1))
    kv.release("a")  # the older holder leaves: c pays as it did
    assert kv.shared_prompt_tokens == 0 and kv.demand_tokens == prompt + 300


def test_fit_counts_only_the_new_part_and_changes_nothing() -> None:
    prompt = PROMPT
    kv = KvBudget(2 * prompt + 300, target_utilization=1.0)
    kv.admit("a", prompt, 300, chunks=chunks(1))
    before = kv.demand_tokens
    unshared, _ = kv.would_fit(prompt, 300, chunks=chunks(1, shared=tuple(range(900, 912))))
    assert not unshared
    shared, _ = kv.would_fit(prompt, 300, chunks=chunks(1))
    assert shared
    assert kv.demand_tokens == before and kv.shared_prompt_tokens == 0


def test_no_credit_for_a_prefix_nobody_in_flight_holds() -> None:
    kv = budget()
    prompt = PROMPT
    kv.admit("a", prompt, 300, chunks=chunks(1))
    kv.release("a", 300)
    kv.admit("b", prompt, 300, chunks=chunks(1))
    assert kv.demand_tokens == prompt + 300  # what the engine may still cache is free to it, not held


def test_replicas_bound_the_credit_and_a_change_rebooks() -> None:
    kv = budget()
    prompt = PROMPT
    for name in "abc":
        kv.admit(name, prompt, 300, chunks=chunks(1))
    assert kv.shared_prompt_tokens == 2 * SHARED
    kv.set_replicas(3)  # each of three replicas may hold its own copy
    assert kv.shared_prompt_tokens == 0 and kv.demand_tokens == 3 * (prompt + 300)
    kv.set_replicas(2)
    assert kv.shared_prompt_tokens == SHARED
    for name in "abc":
        kv.release(name)
    assert kv.demand_tokens == 0


@pytest.mark.parametrize("credited", [0, 1, 2, 50])
def test_credit_is_never_the_whole_prompt(credited: int) -> None:
    shared = PromptChunks(SYSTEM, 400, 400 * 12).credit(credited, 200)
    assert 0 <= shared <= 199
    if credited <= 1:
        assert shared == 0


def test_forecast_books_the_shared_prefix_once() -> None:
    kv = budget()
    kv.observe_engine(0.0, now=0.0, fresh_for=100.0)
    kv.pace.observe_stream(100.0, 1.0)
    prompt = PROMPT
    kv.admit("a", prompt, 300, now=0.0, chunks=chunks(1))
    kv.admit("b", prompt, 300, now=0.0, chunks=chunks(1))
    kv.observe_engine(0.0, now=0.0, fresh_for=100.0)
    assert kv.booked_tokens == 2 * (prompt + 300) - SHARED


def test_a_prompt_booked_on_its_bound_is_credited_once_counted_in_tokens() -> None:
    kv = budget()
    counted = chunks()
    uncounted = PromptChunks(counted.hashes, counted.chunk_chars, counted.text_chars)
    kv.admit("b", 4 * PROMPT, 300, chunks=uncounted)  # the byte bound, before the exact count
    kv.admit("a", PROMPT, 300, chunks=chunks())  # the last holder pays: b is credited, but not counted yet
    assert kv.shared_prompt_tokens == 0
    kv.correct_prompt("b", PROMPT, chunks=counted)
    assert kv.shared_prompt_tokens == SHARED and kv.demand_tokens == 2 * (PROMPT + 300) - SHARED
    other = PromptChunks((1, 2), 400, 800)
    assert kv.correct_prompt("a", PROMPT, chunks=other) and kv.shared_prompt_tokens == SHARED  # not its own


def test_a_shared_run_is_credited_the_tokens_of_the_whole_texts_it_covers() -> None:
    """An English system prompt (1,161 tokens in 5,000 characters) before 1,500 Chinese characters of the
    request's own (1,507 tokens): by the character share the own part was booked 665 tokens."""
    # The system prompt's 5,000 characters are 20 chunks of 256 (its last one short), the tail's 6 more.
    prompt = PromptChunks(tuple(range(26)), 256, 6_500, text_ends=(20, 26), text_tokens=(1_161, 2_668))
    assert prompt.credit(19, 2_668) == 0  # the system prompt not whole
    assert prompt.credit(20, 2_668, block=16) == 1_152  # 72 whole blocks of its 1,161 tokens
    assert 2_668 - prompt.credit(25, 2_668, block=16) >= 1_507  # the own text not whole
    assert prompt.credit(26, 2_668) == 2_667  # every text shared: never the whole prompt
    assert prompt.credit(26, 2_668, block=16) == 2_656  # nor the block of its last token


def test_block_rounding_is_booked_per_sequence() -> None:
    kv = budget()
    kv.admit("a", 100, 300, sequences=2)
    kv.set_block_tokens(128)  # half a block, rounded down, per sequence: 63 x 2
    assert kv.demand_tokens == 100 + 300 + 126
    kv.admit("b", 100, 300)
    assert kv.demand_tokens == 2 * 400 + 3 * 63
    kv.set_block_tokens(None)
    assert kv.demand_tokens == 800
    kv.release("a")
    kv.release("b")
    assert kv.demand_tokens == 0


def engine_sampled(kv: KvBudget, used: float, now: float, waiting: float | None) -> int:
    kv.observe_engine(used, now=now, fresh_for=100.0, waiting=waiting)
    return kv.booked_tokens


def forecasting() -> KvBudget:
    """A forecasting budget without a learned pace: each lease holds its whole footprint, 1,300 + 300."""
    kv = KvBudget(100_000, target_utilization=1.0, booking=BookingMode.FORECAST)
    kv.observe_engine(0.0, now=0.0, fresh_for=100.0)
    return kv


def test_the_engine_takes_back_what_running_leases_do_not_hold() -> None:
    """Two leases admitted long ago, their prompts booked 2 x 1,300, while the engine holds 1,500 with
    nothing waiting: they hold at most 1,500, so the 1,100 their prompts are booked for beyond it comes off
    every forecast until the next sample (their answers' forecast stays whole)."""
    kv = forecasting()
    kv.admit("a", 1300, 300, now=0.0)
    kv.admit("b", 1300, 300, now=0.0)
    assert engine_sampled(kv, 3200.0, 10.0, 0) == 3200
    assert engine_sampled(kv, 1500.0, 10.0, 0) == 3200 - 1100
    assert kv.unexplained_tokens == -1100


def test_estimated_progress_is_never_taken_off() -> None:
    """With a learned pace the lease is estimated 300 tokens in; the engine shows only its prompt. The
    estimate may be high, but the final size does not depend on it: nothing comes off."""
    kv = forecasting()
    kv.pace.observe_stream(100.0, 1.0)
    kv.admit("a", 1300, 300, now=0.0)
    assert engine_sampled(kv, 1300.0, 10.0, 0) == 1600 and kv.unexplained_tokens == 0


@pytest.mark.parametrize("waiting", [1, None])
def test_nothing_is_taken_back_while_anything_waits_or_the_queue_is_unknown(waiting: float | None) -> None:
    kv = forecasting()
    kv.admit("a", 1300, 300, now=0.0)
    assert engine_sampled(kv, 100.0, 10.0, waiting) == 1600  # preempted, or queued: it needs its KV back


def test_young_leases_count_as_holding_nothing() -> None:
    """Admitted within `settle_after` (2 s here), a lease may not be in the gauge yet: the engine's low
    reading is no evidence against it, and it takes nothing off the old lease beside it either."""
    kv = forecasting()
    kv.admit("old", 1300, 300, now=0.0)
    kv.admit("young", 1300, 300, now=9.5)
    assert engine_sampled(kv, 1600.0, 10.0, 0) == 3200  # the old one may hold all it is booked for
    assert engine_sampled(kv, 1000.0, 10.0, 0) == 2900  # its prompt: at most 1,000 of its 1,300


def test_kv_beyond_every_lease_is_still_added() -> None:
    kv = forecasting()
    kv.admit("a", 1300, 300, now=0.0)
    assert engine_sampled(kv, 2000.0, 10.0, 0) == 2000


def test_a_release_does_not_take_back_the_same_kv_twice() -> None:
    """The engine took 1,300 off for a lease it had finished (its client still reading); when that lease
    is released, its booking goes, and so does the correction it explained."""
    kv = forecasting()
    kv.admit("slow reader", 1300, 300, now=0.0)
    kv.admit("b", 1300, 300, now=0.0)
    assert engine_sampled(kv, 1300.0, 10.0, 0) == 3200 - 1300
    kv.release("slow reader", 300)
    kv.would_fit(10, 10, now=10.0)
    assert kv.booked_tokens == 1600 and kv.unexplained_tokens == 0


def test_the_engines_slower_pace_bounds_the_learned_one() -> None:
    """A pace learned from a stream decoded at low load (100 tokens/s) runs fast under a full batch (the
    engine's counters say 20). At the learned pace the running answer is taken for 500 tokens along and a
    second one fits beside it (peak 1,700 of 1,800); at the engine's pace it is 100 along, ends later, and
    the two together would peak at 2,100: refused."""
    kv = KvBudget(2000, target_utilization=0.9, booking=BookingMode.FORECAST)
    kv.observe_engine(0.0, now=0.0, fresh_for=100.0)
    kv.pace.observe_stream(100.0, 1.0)
    kv.admit("a", 100, 1000, now=0.0)
    assert kv.would_fit(100, 1000, now=5.0) == (True, 1800 - 1100)
    kv.observe_fed_pace(20.0)
    assert kv.decode_rate() == 20.0
    assert kv.would_fit(100, 1000, now=5.0)[0] is False
    kv.observe_fed_pace(float("nan"))  # an impossible reading is no reading
    assert kv.decode_rate() == 100.0
    unlearned = KvBudget(2000, booking=BookingMode.FORECAST)
    unlearned.observe_fed_pace(20.0)
    assert unlearned.decode_rate() is None  # nothing learned: such leases book whole footprints, as before


def test_the_engines_pace_is_read_at_the_batch_the_leases_run_in() -> None:
    """The engine showed 100 tokens/s with one sequence running; a burst of four admitted since runs at a
    quarter of that at the least (a step takes at most in proportion to its batch) until the feed reads
    the new batch's pace. At the pace read alone the first of the four was taken for 300 tokens along 3 s
    in, ending before the last one peaks, and a fifth answer fitted beside them (peak 1,600 of 2,000); at the
    batch's it is 75 along, and the five would peak at 2,275: refused."""
    kv = KvBudget(2000, target_utilization=1.0, booking=BookingMode.FORECAST)
    kv.observe_engine(0.0, now=0.0, fresh_for=100.0)
    kv.pace.observe_stream(100.0, 1.0)
    kv.observe_fed_pace(100.0, running=1.0)
    for i in range(4):
        kv.admit(f"burst {i}", 100, 400, now=float(i))
    assert kv.decode_rate() == 25.0  # 100 read at one sequence, four booked
    assert kv.would_fit(100, 400, now=3.0)[0] is False
    kv.observe_fed_pace(100.0, running=4.0)  # the same figure again: no new reading, still read alone
    assert kv.decode_rate() == 25.0
    # What they hold now is estimated at the pace read (400, 300, 200 and 100 tokens): an engine holding
    # that much holds nothing unexplained; estimated at the batch's pace, their progress was booked twice.
    kv.observe_engine(1000.0, now=3.0, fresh_for=100.0)
    assert kv.unexplained_tokens == 0
    kv.observe_fed_pace(40.0, running=4.0)  # the feed read the four's pace
    assert kv.decode_rate() == 40.0
    alone = KvBudget(2000, target_utilization=1.0, booking=BookingMode.FORECAST)
    alone.observe_engine(0.0, now=0.0, fresh_for=100.0)
    alone.pace.observe_stream(100.0, 1.0)
    alone.observe_fed_pace(100.0)  # no running count with it: taken as it is, as before
    for i in range(4):
        alone.admit(f"burst {i}", 100, 400, now=float(i))
    assert alone.decode_rate() == 100.0 and alone.would_fit(100, 400, now=3.0)[0] is True


def test_an_engine_that_does_not_share_prefixes_credits_none() -> None:
    """vLLM with --no-enable-prefix-caching holds every prompt whole: the credit of the leases in flight is
    booked again at once, and no new request is credited."""
    b = KvBudget(100_000, target_utilization=1.0)
    chunks = PromptChunks(tuple(range(10)), 100, 1_000, tuple(range(1, 11)), tuple(range(100, 1_001, 100)))
    b.admit("a", 1_000, 0, chunks=chunks)
    b.admit("b", 1_000, 0, chunks=chunks)
    assert b.demand_tokens < 2_000
    b.set_engine_shares_prefixes(False)
    assert b.demand_tokens == 2_000 and b.shared_prompt_tokens == 0
    b.admit("c", 1_000, 0, chunks=chunks)
    assert b.demand_tokens == 3_000
    b.set_engine_shares_prefixes(True)  # new leases share again; those in flight stay whole
    b.admit("d", 1_000, 0, chunks=chunks)
    b.admit("e", 1_000, 0, chunks=chunks)
    assert 4_000 < b.demand_tokens < 5_000
