"""The counted prefix index against the list it replaced (issue 40): over random admissions, releases,
candidates' checks and changes of replicas, the same holders are credited and debited the same chunks, and a
budget on either books the same tokens. The reference (tests/support/prefix_reference.py) is the algorithm
as it was: a list of holders per chunk, scanned; a candidate inserted and removed; a rebuild per change."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.prefix import PrefixIndex, PromptChunks
from tests.support.prefix_reference import ListBudget, ListPrefixIndex


def chain(tokens: Sequence[int]) -> tuple[int, ...]:
    """Chained hashes, as `admission/vocabulary/prefix.py` makes them: each covers every piece before it."""
    return tuple(hash(("chunk", *tokens[: i + 1])) for i in range(len(tokens)))


# Few pieces and short prompts, so prompts share leading runs often and chunks gather several holders.
chained = st.lists(st.integers(0, 2), max_size=7).map(chain)
# Any chunks, a lease holding each once: the index's arithmetic without the chain's nesting.
loose = st.lists(st.integers(0, 9), unique=True, max_size=7).map(tuple)


def operations(prompts: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[list[tuple[str, object]]]:
    return st.lists(
        st.one_of(
            st.tuples(st.just("add"), prompts),
            st.tuples(st.just("add"), prompts),
            st.tuples(st.just("remove"), st.integers(0, 40)),
            st.tuples(st.just("replicas"), st.integers(1, 4)),
            st.tuples(st.just("check"), prompts),
        ),
        max_size=60,
    )


def rebuilt(reference: ListPrefixIndex, replicas: int, live: dict[str, tuple[int, ...]]) -> ListPrefixIndex:
    """The reference's change of replicas: every lease in flight added again, in admission order."""
    fresh = ListPrefixIndex(replicas)
    for lease, chunks in live.items():
        fresh.add(lease, chunks)
    return fresh


def run_against_reference(ops: list[tuple[str, object]], *, chained_only: bool) -> None:
    index, reference = PrefixIndex(), ListPrefixIndex()
    live: dict[str, tuple[int, ...]] = {}  # in admission order
    gone: dict[str, tuple[int, ...]] = {}
    for step, (op, arg) in enumerate(ops):
        if op == "add":
            assert isinstance(arg, tuple)
            lease = f"l{step}"
            assert index.would_credit(arg) == reference.add("", arg)
            assert reference.remove("", arg) == index.would_credit(arg)  # the candidate leaves as it came
            assert index.add(lease, arg) == reference.add(lease, arg)
            live[lease] = arg
        elif op == "check":
            assert isinstance(arg, tuple)
            assert index.shared_run(arg) == reference.shared_run(arg)
            assert index.would_credit(arg) == reference.add("", arg)
            reference.remove("", arg)
        elif op == "remove":
            assert isinstance(arg, int)
            pool = live if live and arg % 3 else gone  # now and then a lease already released: a no-op
            if not pool:
                continue
            lease = list(pool)[arg % len(pool)]
            chunks = pool.pop(lease)
            assert index.remove(lease, chunks) == reference.remove(lease, chunks)
            gone[lease] = chunks
        else:
            assert isinstance(arg, int)
            before = {lease: reference.credited_chunks(lease, chunks) for lease, chunks in live.items()}
            reference = rebuilt(reference, arg, live)
            after = {lease: reference.credited_chunks(lease, chunks) for lease, chunks in live.items()}
            changes = {lease: after[lease] - before[lease] for lease in live if after[lease] != before[lease]}
            assert index.set_replicas(arg) == changes
            assert index.replicas == reference.replicas == arg
        assert len(index) == len(reference)
        for lease, chunks in live.items():
            credited = reference.credited(lease, chunks)
            assert index.credited(lease, chunks) == credited
            if chained_only:  # credited chunks are a leading run: counting them all is the same
                assert reference.credited_chunks(lease, chunks) == credited


@settings(max_examples=300, deadline=None)
@given(operations(chained))
def test_index_matches_the_reference_on_chained_prompts(ops: list[tuple[str, object]]) -> None:
    run_against_reference(ops, chained_only=True)


@settings(max_examples=300, deadline=None)
@given(operations(loose))
def test_index_matches_the_reference_on_any_chunks(ops: list[tuple[str, object]]) -> None:
    run_against_reference(ops, chained_only=False)


def budget_ops() -> st.SearchStrategy[list[tuple[str, tuple[int, ...], int, int]]]:
    return st.lists(
        st.tuples(
            st.sampled_from(["admit", "admit", "fit", "release", "replicas"]),
            chained,
            st.integers(0, 40),
            st.integers(1, 3_000),
        ),
        max_size=40,
    )


@pytest.mark.parametrize("forecast", [False, True], ids=["lifetime", "forecast"])
@settings(max_examples=150, deadline=None)
@given(ops=budget_ops())
def test_budget_books_what_it_booked_on_the_reference(
    forecast: bool, ops: list[tuple[str, tuple[int, ...], int, int]]
) -> None:
    """The same decisions, headrooms, demand and per-lease credit, the admission right after a decision
    included (it reuses the decision's sum)."""
    budgets: list[KvBudget] = []
    for kind in (KvBudget, ListBudget):
        kv = kind(12_000, target_utilization=1.0, booking=BookingMode.FORECAST)
        if forecast:
            kv.observe_engine(0.0, now=0.0, fresh_for=1e9)
            kv.pace.observe_stream(50.0, 1.0)
        budgets.append(kv)
    live: list[str] = []
    for step, (op, hashes, pick, tokens) in enumerate(ops):
        now = float(step) if forecast else None
        ends = tuple(range(1, len(hashes) + 1))  # a text per chunk, 25 tokens each, counted
        chunks = PromptChunks(hashes, 100, 100 * len(hashes) + 40, ends, tuple(25 * n for n in ends))
        prompt = 25 * len(hashes) + 10
        if op in ("admit", "fit"):
            fits = [kv.would_fit(prompt, tokens, now=now, chunks=chunks) for kv in budgets]
            assert fits[0] == fits[1]
            if op == "admit":
                lease = f"l{step}"
                assert len({kv.admit(lease, prompt, tokens, now=now, chunks=chunks) for kv in budgets}) == 1
                live.append(lease)
        elif op == "release" and live:
            lease = live.pop(pick % len(live))
            for kv in budgets:
                kv.release(lease, tokens)
        elif op == "replicas":
            for kv in budgets:
                kv.set_replicas(1 + pick % 4)
        new, old = budgets
        assert new.demand_tokens == old.demand_tokens
        assert new.booked_tokens == old.booked_tokens
        assert new.shared_prompt_tokens == old.shared_prompt_tokens
        assert new.replicas == old.replicas
        credits = [{k: v.credited for k, v in kv._ledger.leases.items()} for kv in budgets]
        assert credits[0] == credits[1]


def test_set_replicas_moves_only_the_holders_whose_payment_changes() -> None:
    index = PrefixIndex()
    index.add("a", (1, 2))
    index.add("b", (1, 2, 3))
    index.add("c", (1,))
    # chunk 1: a, b credited, c pays; chunk 2: a credited, b pays; chunk 3: b alone.
    assert index.set_replicas(2) == {"b": -1, "a": -1}  # chunk 1's next holder pays again, and chunk 2's
    assert index.set_replicas(3) == {"a": -1}
    assert index.set_replicas(3) == {}
    assert index.set_replicas(1) == {"a": 2, "b": 1}
    assert index.remove("c", (1,)) == {"b": 1}  # the newest credited holder pays when the payer leaves
    assert index.credited("a", (1, 2)) == 2 and index.credited("b", (1, 2, 3)) == 0
