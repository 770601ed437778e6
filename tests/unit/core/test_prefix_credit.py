"""Shared prompt prefixes in the KV budget: a chunk held by several leases is booked once per replica, the
last holders pay, and a payer's release makes the next holder pay again (core/prefix_index.py)."""

from __future__ import annotations

import itertools

import pytest

from extproc.core.kv_budget import KvBudget
from extproc.core.prefix_index import PrefixIndex, PromptChunks

SYSTEM = tuple(range(100, 112))  # twelve chunks of a shared system prompt
_OWN = itertools.count(10_000)


PROMPT = 1300  # tokens of a prompt of thirteen chunks: one chunk stands for 100 tokens


def chunks(own: int = 1, *, shared: tuple[int, ...] = SYSTEM) -> PromptChunks:
    """A prompt of the shared chunks followed by `own` chunks of its own (hashes unique to it)."""
    tail = tuple(next(_OWN) for _ in range(own))
    return PromptChunks(shared + tail, chunk_chars=400, text_chars=400 * (len(shared) + own))


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
    # One chunk of margin: 12 credited chunks of 13 stand for 11 x 100 tokens.
    assert kv.shared_prompt_tokens == 1100
    assert kv.demand_tokens == 2 * (prompt + 300) - 1100


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
    assert kv.shared_prompt_tokens == 2 * 1100
    kv.set_replicas(3)  # each of three replicas may hold its own copy
    assert kv.shared_prompt_tokens == 0 and kv.demand_tokens == 3 * (prompt + 300)
    kv.set_replicas(2)
    assert kv.shared_prompt_tokens == 1100
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
    assert kv.booked_tokens == 2 * (prompt + 300) - 1100


def test_a_prompt_booked_on_its_bound_is_credited_in_proportion() -> None:
    kv = budget()
    kv.admit("b", 4 * PROMPT, 300, chunks=chunks())  # the byte bound, before the exact count
    kv.admit("a", PROMPT, 300, chunks=chunks())  # the last holder pays: b is credited
    assert kv.shared_prompt_tokens == 4 * 1100
    kv.correct_prompt("b", PROMPT)
    assert kv.shared_prompt_tokens == 1100 and kv.demand_tokens == 2 * (PROMPT + 300) - 1100


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
