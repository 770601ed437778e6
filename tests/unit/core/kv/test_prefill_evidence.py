"""The downward engine correction only with evidence (issue 40, item 3): a lease's KV is taken off only once
the engines' prompt-token counter (vLLM's `vllm:prompt_tokens_total`, grown by a prompt's whole length when
its prefill completes) has grown by its prompt since its admission. A prompt in chunked prefill runs with
only its first chunks in the cache: by "admitted long enough ago" alone, a 100,000-token prompt with 24,000
computed had 76,000 taken off, and a second one then fit a 180,000-token budget."""

from __future__ import annotations

from extproc.core.kv.budget import BookingMode, KvBudget

PROMPT = 100_000


def budget(prompted: float | None = 5_000.0) -> KvBudget:
    kv = KvBudget(180_000, target_utilization=1.0, booking=BookingMode.FORECAST)
    kv.observe_engine(0.0, now=0.0, fresh_for=100.0, waiting=0, running=0, prompted=prompted)
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
    kv = budget(prompted=None)
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


def test_one_prefill_completing_does_not_vouch_for_another_beside_it() -> None:
    """Two long prompts admitted in one interval, both in chunked prefill; the first completes and the counter
    grows by its 100,000: against the 200,000 both need, neither is evidenced, and nothing comes off the
    second's uncomputed part (found in review: checked one by one, both passed)."""
    kv = budget()
    kv.admit("second", PROMPT, 100, now=0.0)
    kv.observe_engine(130_000.0, now=10.0, fresh_for=100.0, waiting=0, running=2, prompted=5_000.0 + PROMPT)
    assert kv.unexplained_tokens == 0


def test_a_prompt_the_engine_counts_a_little_shorter_is_still_evidenced() -> None:
    """The engine's tokenizer makes the prompt 90,000 of the 100,000 booked: its prefill completing is still
    evidence (`EVIDENCE_SHARE` of it), and what it does not hold comes off."""
    kv = budget()
    kv.observe_engine(90_000.0, now=10.0, fresh_for=100.0, waiting=0, running=1, prompted=5_000.0 + 90_000)
    assert kv.unexplained_tokens == -10_000


def test_a_sample_without_the_counter_keeps_the_evidence_it_had() -> None:
    """One sample whose counter is missing (dropped as impossible, or a scrape without it) does not bring back
    the older rule for the lease still in prefill."""
    kv = budget()
    kv.observe_engine(24_000.0, now=10.0, fresh_for=100.0, waiting=0, running=1, prompted=5_000.0)
    kv.observe_engine(24_000.0, now=12.0, fresh_for=100.0, waiting=0, running=1, prompted=None)
    assert kv.unexplained_tokens == 0
