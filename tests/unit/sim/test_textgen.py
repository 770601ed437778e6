"""Generated text tokenizes to exactly the count the simulator reports, whole and per delta."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.admission.vocabulary.tokens import DEFAULT_ENCODING, count_text, get_encoding
from extproc.sim.textgen import draw_output_length, generate_tokens, vocabulary


def test_vocabulary_words_are_single_tokens_with_leading_space() -> None:
    enc = get_encoding(DEFAULT_ENCODING)
    words = vocabulary()
    assert len(words) >= 100
    for w in words:
        assert w.startswith(" ") and w[1:].isalpha()
        assert len(enc.encode_ordinary(w)) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(vocabulary()), min_size=1, max_size=400))
def test_any_word_sequence_never_merges_across_boundaries(words: list[str]) -> None:
    assert count_text("".join(words)) == len(words)


@settings(max_examples=150, deadline=None)
@given(count=st.integers(min_value=0, max_value=2000), seed=st.text(max_size=12))
def test_generated_text_count_matches_and_each_delta_is_one_token(count: int, seed: str) -> None:
    tokens = generate_tokens(count, seed)
    assert len(tokens) == count
    assert count_text("".join(tokens)) == count
    assert all(count_text(t) == 1 for t in tokens)


def test_generation_is_deterministic_per_seed() -> None:
    assert generate_tokens(50, "1:2:0") == generate_tokens(50, "1:2:0")
    assert generate_tokens(50, "1:2:0") != generate_tokens(50, "1:2:1")


def test_drawn_output_lengths_are_positive_and_centred_on_the_median() -> None:
    rng = random.Random(7)
    draws = sorted(draw_output_length(rng, 128, 1.0) for _ in range(4001))
    assert draws[0] >= 1
    assert 110 <= draws[2000] <= 150
