"""A request's prompt as the meter sees it, whatever API it came from, and how it is counted.

Every API adapter turns its body into `Prompt`s: the texts the backend will tokenize, the tokens known
without a tokenizer (token-id arrays), the number of templated messages, and the media items. Counting is
then one piece of code for every API:

    tokens = tokenized texts + fixed tokens + template overhead + media costs

Three views of the same prompt, cheapest first:

* `lower_bound`: no token stands for more than `max_token_bytes` bytes (128 for cl100k), so text of B bytes
  is at least ceil(B / 128) tokens. Refuses an oversized prompt without tokenizing it.
* `upper_bound`: byte-level BPE never emits more tokens than bytes, so text of B bytes is at most B tokens.
* `count`: exact (in the sidecar's encoding). It stops early once the prompt is proven larger than a limit
  (the context window), so an adversarial megabyte costs a bounded amount of tokenizing: long texts are
  counted in slices, and counting stops when the slices' total, less a margin per cut, passes the limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from extproc.admission.vocabulary.policy import ModelPolicy
from extproc.admission.vocabulary.tokens import count_text, max_token_bytes, utf8_len

SLICE_CHARS = 16 * 1024
"""Texts longer than this are counted slice by slice, so counting can stop once the limit is passed."""

CUT_MARGIN = 16
"""Tokens a cut can add to a slice's count (the pre-token it splits is counted twice, at worst as parts);
subtracted per cut before concluding that a prompt exceeds a limit."""


@dataclass(frozen=True, slots=True)
class Media:
    images: int = 0
    audios: int = 0
    videos: int = 0

    def __add__(self, other: Media) -> Media:
        return Media(self.images + other.images, self.audios + other.audios, self.videos + other.videos)

    def __bool__(self) -> bool:
        return bool(self.images or self.audios or self.videos)


NO_MEDIA = Media()


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt (one sequence family): what the backend will put in front of the generation.

    `messages` counts templated chat messages; `templated` says the chat template wraps the prompt (its
    per-request overhead applies). `special_tokens` says the server tokenizes the rendered template with the
    tokenizer's special tokens as well, so the model's `template.bos` comes on top of the template's own
    (vLLM 0.32.0's Responses path: ResponsesRequest.build_tok_params keeps TokenizeParams'
    `add_special_tokens=True` default, entrypoints/openai/responses/protocol.py:460, renderers/params.py:183;
    a chat request that sets `add_special_tokens`). `opaque` marks input whose size cannot be known without
    the model (for example prompt embeddings): it is charged the whole context window, the most the backend
    accepts.
    """

    texts: tuple[str, ...] = ()
    fixed_tokens: int = 0
    messages: int = 0
    templated: bool = False
    media: Media = NO_MEDIA
    opaque: bool = False
    special_tokens: bool = False
    text_bytes: int = field(default=-1, compare=False)

    def __post_init__(self) -> None:
        if self.text_bytes < 0:
            text_bytes = 0
            for text in self.texts:
                text_bytes += utf8_len(text)
            object.__setattr__(self, "text_bytes", text_bytes)


def known_tokens(prompt: Prompt, policy: ModelPolicy) -> int:
    """Everything but the tokenized text: token ids, template overhead, media, or the window if opaque."""
    if prompt.opaque:
        return policy.context_window
    media = prompt.media
    costs = policy.media
    template = prompt.messages * policy.template.per_message
    if prompt.templated:
        template += policy.template.per_request
    if prompt.special_tokens or (prompt.texts and not prompt.templated):
        template += policy.template.bos
    return (
        prompt.fixed_tokens
        + template
        + media.images * costs.image_tokens
        + media.audios * costs.audio_tokens
        + media.videos * costs.video_tokens
    )


def lower_bound(prompt: Prompt, policy: ModelPolicy) -> int:
    known = known_tokens(prompt, policy)
    return known + math.ceil(prompt.text_bytes / max_token_bytes(policy.encoding))


def upper_bound(prompt: Prompt, policy: ModelPolicy) -> int:
    return prompt.text_bytes + known_tokens(prompt, policy)


def _slices(text: str) -> Iterator[str]:
    """Cut a long text into slices, preferring a cut just before whitespace (a pre-token boundary)."""
    start = 0
    size = len(text)
    while size - start > SLICE_CHARS:
        end = start + SLICE_CHARS
        window = text.rfind(" ", start + SLICE_CHARS // 2, end)
        if window < 0:
            window = text.rfind("\n", start + SLICE_CHARS // 2, end)
        cut = window if window > start else end
        yield text[start:cut]
        start = cut
    yield text[start:]


@dataclass(frozen=True, slots=True)
class Count:
    """A prompt's token count as an interval: exact (`low == high`) unless a long text was sliced.

    `complete` is False when counting stopped early because `low` passed the caller's limit: `high` then
    means nothing, and the prompt is certainly larger than the limit.

    `texts`: each text's tokens, in order (the low side of a sliced one), when complete: what the KV budget
    credits a prompt for the leading texts it shares with requests in flight, in tokens, not characters
    (`admission/vocabulary/prefix.py`).
    """

    low: int
    high: int
    complete: bool = True
    texts: tuple[int, ...] = field(default=(), compare=False)


def count(prompt: Prompt, policy: ModelPolicy, stop_above: int | None = None) -> Count:
    """Tokens of the prompt; with `stop_above`, may return early once `low` exceeds it.

    Texts up to `SLICE_CHARS` are tokenized whole (exact). A longer text is tokenized slice by slice, cut
    before whitespace where possible; each cut can change the count by at most `CUT_MARGIN` tokens, so the
    result is the interval [sum - margin x cuts, sum + margin x cuts] (under 0.5 % wide). Counting stops as
    soon as `low` passes `stop_above`: an adversarial megabyte costs about `stop_above` tokens of work.
    """
    base = known_tokens(prompt, policy)
    total = base
    cuts = 0
    per_text: list[int] = []
    for text in prompt.texts:
        before, cuts_before = total, cuts
        if len(text) <= SLICE_CHARS:
            total += count_text(text, policy.encoding)
        else:
            for i, piece in enumerate(_slices(text)):
                cuts += 1 if i else 0
                total += count_text(piece, policy.encoding)
                if stop_above is not None and total - cuts * CUT_MARGIN > stop_above:
                    return Count(total - cuts * CUT_MARGIN, total + cuts * CUT_MARGIN, complete=False)
        per_text.append(max(0, total - before - (cuts - cuts_before) * CUT_MARGIN))
        if stop_above is not None and total - cuts * CUT_MARGIN > stop_above:
            return Count(total - cuts * CUT_MARGIN, total + cuts * CUT_MARGIN, complete=False)
    return Count(max(base, total - cuts * CUT_MARGIN), total + cuts * CUT_MARGIN, texts=tuple(per_text))
