"""The downward engine correction only with evidence (issue 40, item 3): a lease's KV is taken off only once
the engines' prompt-token counter (vLLM's `vllm:prompt_tokens_total`, grown by a prompt's whole length when
its prefill completes) has grown by its prompt since its admission. A prompt in chunked prefill runs with
only its first chunks in the cache: by "admitted long enough ago" alone, a 100,000-token prompt with 24,000
computed had 76,000 taken off, and a second one then fit a 180,000-token budget."""

from __future__ import annotations

from extproc.core.kv.budget import BookingMode, KvBudget

PROMPT = 100_000


def budget() -> KvBudget:
    kv = KvBudget(180_000, target_utilization=1.0, booking=BookingMode.FORECAST)
    kv.observe_engine(0.0, now=0.0, fresh_for=100.0, waiting=0, running=0, prompted=5_000.0)
    kv.admit("long", PROMPT, 100, now=0.0)
    return kv


def test_a_prompt_still_in_chunked_prefill_is_not_taken_off() -> None:
    kv = budget()
    # Ten seconds on, 24,000 of its tokens computed, its prefill not complete: the counter has not grown.
    kv.observe_engine(24_000.0, now=10.0, fresh_for=100.0, waiting=0, running=1, prompted=5_000.0)
    assert kv.unexplained_tokens == 0
    assert not kv.would_fit(PROMPT, 100, now=10.0)[0]


def test_without_the_counter_the_old_rule_took_it_off() -> None:
    """The same sample without a prompt counter (an engine that publishes none): what the rule did before,
    and still does there."""
    kv = budget()
    kv.observe_engine(24_000.0, now=10.0, fresh_for=100.0, waiting=0, running=1)
    assert kv.unexplained_tokens == -76_000
    assert kv.would_fit(PROMPT, 100, now=10.0)[0]


def test_a_prefilled_prompt_the_engine_holds_less_of_is_taken_off() -> None:
    """Prefilled (the counter grew by its prompt), the engine holds 60,000 for it (its tokenizer makes it
    shorter, or it shares a prefix the chunks missed): 40,000 come off, as before."""
    kv = budget()
    kv.observe_engine(60_000.0, now=10.0, fresh_for=100.0, waiting=0, running=1, prompted=5_000.0 + PROMPT)
    assert kv.unexplained_tokens == -40_000


def test_a_lease_counts_the_growth_from_the_sample_before_its_admission() -> None:
    """Admitted between two samples and prefilled before the second: the growth since the sample before it
    covers its own prefill."""
    kv = KvBudget(180_000, target_utilization=1.0, booking=BookingMode.FORECAST)
    kv.observe_engine(0.0, now=0.0, fresh_for=100.0, waiting=0, running=0, prompted=0.0)
    kv.admit("a", 1_000, 100, now=0.5)
    kv.observe_engine(800.0, now=1.0, fresh_for=100.0, waiting=0, running=1, prompted=1_000.0)
    kv.observe_engine(800.0, now=10.0, fresh_for=100.0, waiting=0, running=1, prompted=1_000.0)
    assert kv.unexplained_tokens == -200
