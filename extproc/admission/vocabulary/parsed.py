"""What an API's adapter makes of a request body: the API it came from, its validated facts
(`ParsedRequest`), and the edits its body may take (`BodyEdits`).

These types are shared by every adapter (`extproc/admission/apis/`) and by the admission functions in
`extproc/admission/intake/request.py`; they import nothing that knows an API, so the adapters and the registry
of APIs can depend on them without depending on each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NewType, Protocol

from extproc.admission.vocabulary.prompt import Prompt

Api = NewType("Api", str)
"""An API's name ("chat", "messages", "cohere_chat", ...), declared once by its adapter in its module under
`extproc/admission/apis/` (the adapter's `api`, which is its `ApiSpec.api`) and the key of every per-API
lookup there. A name rather than an enum of every API, so that adding an API touches only its own module;
the registry refuses two modules that declare the same name. Lookups by it are one dict access."""


@dataclass(frozen=True, slots=True)
class StepWork:
    """Work a request asks of the engine at every step beyond its KV cache (vLLM v0.32.0
    sampling_params.py `SamplingParams`): strings matched against each new token, token ids biased or banned
    in every step's logits, and logprobs over the vocabulary. `logprobs` and `prompt_logprobs` are the
    values the engine will use (-1: the whole vocabulary), None when none are asked for; `prompt_logprobs`
    includes what `echo` implies."""

    stop: int = 0
    bad_words: int = 0
    logit_bias: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_param: str = "logprobs"  # the field that asked for `logprobs` (chat: `top_logprobs`)
    stop_param: str = "stop"  # the field holding the stop strings (Anthropic: `stop_sequences`)


NO_STEP_WORK = StepWork()


@dataclass(frozen=True)
class ParsedRequest:
    """The admission-relevant facts of a validated request, plus the parsed body for re-serialisation."""

    api: Api
    model: str
    prompts: tuple[Prompt, ...]
    stream: bool = False
    include_usage: bool = False  # the client asked for usage in the stream (chat, completions)
    # Sequences the backend decodes per prompt, each holding KV cache for its completion (n, best_of).
    sequences: int = 1
    requested_max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # named in context-length errors
    prompt_param: str = "prompt"  # named in context-length errors ("messages", "prompt", "input")
    generates: bool = True  # False for pooling APIs: no completion is reserved
    # The field that prepends a conversation stored on the backend, when the request uses one.
    stored_context: str | None = None
    # vLLM's `truncate_prompt_tokens` (Responses `truncation: "auto"` is -1): the prompt is cut to this many
    # tokens before generation, -1 meaning the most the window allows (see `truncation_limit`).
    truncate_prompt_tokens: int | None = None
    # What the request declares it will generate per sequence at least: `min_tokens`, or with `ignore_eos`
    # the whole bound (the engine ignores the end-of-sequence token, so nothing but the bound stops it).
    min_tokens: int = 0
    ignore_eos: bool = False
    min_tokens_param: str = "min_tokens"  # named when `min_tokens` exceeds the output bound
    # The field carrying a request-supplied chat template (`chat_template`, or `chat_template_kwargs.
    # chat_template`), None when the server's own template is used.
    custom_template: str | None = None
    work: StepWork = NO_STEP_WORK
    body: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def prompt_count(self) -> int:
        return len(self.prompts)

    @property
    def text_bytes(self) -> int:
        return sum(p.text_bytes for p in self.prompts)


@dataclass(frozen=True, slots=True)
class BodyEdits:
    """Changes to a request body before it goes upstream (see `edit_body`)."""

    include_usage: bool = False
    max_tokens: int | None = None
    strip_priority: bool = False
    priority: int | None = None

    def __bool__(self) -> bool:
        return self.include_usage or self.max_tokens is not None or self.strip_priority


class Adapter(Protocol):
    """One API: validation into `ParsedRequest`, and the body edits it supports."""

    api: Api

    def parse(self, body: dict[str, Any]) -> ParsedRequest: ...

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        """Apply `edits` to `body` (a shallow copy the caller owns); True when anything changed."""
        ...
