"""Generated text whose token count is exactly what the simulator reports.

The sidecar counts streamed completion tokens itself (a cut stream has no usage chunk), so the simulator's
text must tokenize to the count it claims, delta by delta. Every vocabulary entry is a space followed by
ASCII letters and is a single cl100k token. cl100k's pre-tokenizer splits text before any optional
non-letter character followed by letters (`[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`), so " the" + " model" is always
two pre-tokens and BPE never merges across a word boundary: n words are n tokens, in any order.
"""

from __future__ import annotations

import functools
import math
import random

from extproc.admission.vocabulary.tokens import DEFAULT_ENCODING, get_encoding

# Common English words; entries that are not one token in the encoding are dropped at load time.
_CANDIDATE_WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which but have an
they you were her she there been one all we their has would when if more will no out so said what up its
about into than them can only other new some could time these two may then do first any my now such like
our over man me even most made after also did many before must through back years where much your way
well down should because each just those people how too little state good very make world still own see
men work long get here between both life being under never day same another know while last might us
great old year off come since against go came right used take three small model cache memory token engine
server request queue batch block large simple short clear quiet green blue river stone light water
"""


@functools.lru_cache(maxsize=8)
def vocabulary(encoding: str = DEFAULT_ENCODING) -> tuple[str, ...]:
    """The words (with leading space) that are a single token of `encoding`."""
    enc = get_encoding(encoding)
    words = []
    for word in dict.fromkeys(_CANDIDATE_WORDS.split()):
        text = " " + word
        if word.isascii() and word.isalpha() and len(enc.encode_ordinary(text)) == 1:
            words.append(text)
    if len(words) < 32:
        raise RuntimeError(f"encoding {encoding!r} leaves too few single-token words")
    return tuple(words)


def generate_tokens(count: int, seed: str | int, encoding: str = DEFAULT_ENCODING) -> list[str]:
    """`count` token texts drawn from the vocabulary with a deterministic per-sequence seed."""
    if count <= 0:
        return []
    words = vocabulary(encoding)
    rng = random.Random(str(seed))
    return rng.choices(words, k=count)


def draw_output_length(rng: random.Random, median: float, sigma: float) -> int:
    """Completion length when the request names none: log-normal, at least 1 token.

    Real chat traces are right-skewed (Azure 2023 conversation trace: median 129 generated tokens, long
    tail to 1000+), which a log-normal reproduces with two intuitive parameters.
    """
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))
