"""OpenAI's request schema as vLLM and SGLang serve it, shared by chat (`chat.py`), completions
(`completions.py`), embeddings (`embeddings.py`) and the APIs built on them, and OpenAI's response
dialect and Lua read spec.

Counting rule for chat: everything a message carries is rendered by the chat template, so everything is
counted. Content parts with text (`text`, `input_text`, `output_text`, `refusal`, `thinking`, or any type
this code does not know) count every string they hold; media parts (images, audio, video) are charged the
model's configured media cost; every other message field counts as text (strings) or compact JSON
(structures: `tool_calls`, `function_call`, ...), `reasoning_content` and `tool_call_id` included. Request
level `tools`, `functions` and `documents` are rendered too. Each message adds the template's per-message
overhead and the request its per-request overhead (`ModelPolicy.template`). Every value of
`chat_template_kwargs` is a variable the template may render (vLLM v0.32.0 renderers/hf.py:715-743
`resolve_chat_template_kwargs` passes each one the template names: `documents`, `custom_tools`,
`date_string`, `tools`, ...), so each is counted too: strings as they are, structures as compact JSON.

Output rules (vLLM v0.32.0, cited beside each): `truncate_prompt_tokens` cuts the prompt before the output
bound is computed; `min_tokens` and `ignore_eos` declare a least output; `stop`, `bad_words`, `logit_bias`
and the logprobs fields are per-step work, bounded by `admission.per_step`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import BodyEdits, ParsedRequest, StepWork
from extproc.admission.vocabulary.prompt import NO_MEDIA, Media, Prompt
from extproc.admission.vocabulary.readspec import ReadSpec, json_key, json_text
from extproc.admission.vocabulary.tokens import content_texts
from extproc.admission.vocabulary.usage import Observed, count_int

MEDIA_PARTS: dict[str, Media] = {
    "image_url": Media(images=1),
    "input_image": Media(images=1),
    "image_pil": Media(images=1),
    "image_embeds": Media(images=1),
    "input_audio": Media(audios=1),
    "audio_url": Media(audios=1),
    "video_url": Media(videos=1),
}
"""Content-part types that become media items on a multimodal model (never text)."""

TEMPLATED_REQUEST_FIELDS = ("tools", "functions", "documents")
"""Request-level fields the chat template renders into the prompt (besides `chat_template_kwargs`)."""

TEMPLATE_KWARGS = "chat_template_kwargs"


class ContentTexts:
    """Collects the texts and media of message contents, validating each part on the way."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.media = NO_MEDIA
        self.messages = 0

    def add_value(self, value: Any, param: str) -> None:
        """A field the template renders: a string as is, anything structured as compact JSON."""
        if value is None:
            return
        if isinstance(value, str):
            self.texts.append(value)
        elif isinstance(value, bool | int | float):
            self.texts.append(str(value))
        else:
            self.texts.append(f.compact_json(value, param))

    def add_content(self, content: Any, param: str) -> None:
        if content is None or isinstance(content, str):
            self.add_value(content, param)
            return
        if not isinstance(content, list):
            f.bad(
                f"'{param}' must be a string or an array of content parts, got {f.json_type(content)}.",
                code="invalid_type",
                param=param,
            )
        for j, part in enumerate(content):
            self.add_part(part, f"{param}[{j}]")

    def add_part(self, part: Any, param: str) -> None:
        if not isinstance(part, dict):
            f.bad(f"'{param}' must be an object, got {f.json_type(part)}.", code="invalid_type", param=param)
        kind = f.required_str(part, "type", f"{param}.type")
        media = MEDIA_PARTS.get(kind)
        if media is not None:
            self.media = self.media + media
            return
        if kind == "text":
            f.required_str(part, "text", f"{param}.text")
        for key, value in part.items():
            if key != "type":
                self.add_value(value, f"{param}.{key}")

    def add_message(self, message: Any, param: str) -> None:
        if not isinstance(message, dict):
            f.bad(
                f"'{param}' must be an object, got {f.json_type(message)}.", code="invalid_type", param=param
            )
        role = f.required_str(message, "role", f"{param}.role")
        f.opt_list(message, "tool_calls", f"{param}.tool_calls")
        content = message.get("content")
        if content is None and not (
            role == "assistant" and (message.get("tool_calls") or message.get("function_call"))
        ):
            # OpenAI: content is required unless the assistant message carries tool_calls or function_call.
            f.bad(
                f"Missing required parameter: '{param}.content'.",
                code="missing_field",
                param=f"{param}.content",
            )
        self.add_fields(message, param)

    def add_fields(self, message: dict[str, Any], param: str) -> None:
        """One checked message: its content, and every other field's value (the role too, as chat counts
        it)."""
        self.messages += 1
        for key, value in message.items():
            if key == "content":
                self.add_content(value, f"{param}.content")
            else:
                self.add_value(value, f"{param}.{key}")


def required_messages(body: Mapping[str, Any], key: str = "messages") -> list[Any]:
    """A conversation's `messages`: present, an array, not empty (as every chat-shaped API requires)."""
    messages = body.get(key)
    if messages is None:
        f.bad(f"Missing required parameter: '{key}'.", code="missing_field", param=key)
    if not isinstance(messages, list):
        f.bad(f"'{key}' must be an array, got {f.json_type(messages)}.", code="invalid_type", param=key)
    if not messages:
        f.bad(f"'{key}' must contain at least one message.", code="invalid_value", param=key)
    return messages


def chat_prompt(body: Mapping[str, Any], key: str = "messages") -> Prompt:
    """The prompt a chat template renders from `messages` and the request-level templated fields."""
    collected = ContentTexts()
    for i, message in enumerate(required_messages(body, key)):
        collected.add_message(message, f"{key}[{i}]")
    collected.texts.extend(template_inputs(body))
    return Prompt(
        texts=tuple(collected.texts),
        messages=collected.messages,
        templated=True,
        media=collected.media,
        # vLLM 0.32.0 chat_completion/protocol.py:337: BOS "on top of what is added by the chat template".
        special_tokens=body.get("add_special_tokens") is True,
    )


def template_inputs(body: Mapping[str, Any], fields: tuple[str, ...] = TEMPLATED_REQUEST_FIELDS) -> list[str]:
    """Texts the chat template renders besides the messages: the request-level `fields` and every value of
    `chat_template_kwargs` (a request-supplied `chat_template` there is refused, not counted: see
    `request.custom_template`)."""
    collected = ContentTexts()
    for name in fields:
        value = f.opt_list(body, name, name)
        if value:
            collected.add_value(value, name)
    kwargs = f.opt_object(body, TEMPLATE_KWARGS, TEMPLATE_KWARGS) or {}
    for name, value in kwargs.items():
        if name != "chat_template":
            collected.add_value(value, f"{TEMPLATE_KWARGS}.{name}")
    return collected.texts


def entries(value: Any) -> int:
    """How many entries a per-step list holds: a string is one (`stop: "x"`), an array or object its length;
    anything else is left for the backend to refuse."""
    if isinstance(value, str):
        return 1
    if isinstance(value, list | dict):
        return len(value)
    return 0


def int_value(value: Any) -> int | None:
    """A JSON integer, else None (the backend refuses other types itself)."""
    return value if type(value) is int else None


def chat_step_work(body: Mapping[str, Any]) -> StepWork:
    """Per-step work of a chat request: `top_logprobs` applies when `logprobs` is true, and `echo` without
    `prompt_logprobs` asks for `top_logprobs` prompt logprobs (vLLM v0.32.0
    chat_completion/protocol.py:742-765 `to_sampling_params`)."""
    top = int_value(body.get("top_logprobs")) or 0
    prompt = int_value(body.get("prompt_logprobs"))
    if prompt is None and body.get("echo") is True:
        prompt = top
    return StepWork(
        stop=entries(body.get("stop")),
        bad_words=entries(body.get("bad_words")),
        logit_bias=entries(body.get("logit_bias")),
        logprobs=top if body.get("logprobs") is True else None,
        prompt_logprobs=prompt,
        logprobs_param="top_logprobs",
    )


def completion_step_work(body: Mapping[str, Any]) -> StepWork:
    """Per-step work of a completions request (or vLLM's sampling params): `echo` without `prompt_logprobs`
    asks for `logprobs` prompt logprobs (vLLM v0.32.0 completion/protocol.py:372-374)."""
    logprobs = int_value(body.get("logprobs"))
    prompt = int_value(body.get("prompt_logprobs"))
    if prompt is None and body.get("echo") is True:
        prompt = logprobs
    return StepWork(
        stop=entries(body.get("stop")),
        bad_words=entries(body.get("bad_words")),
        logit_bias=entries(body.get("logit_bias")),
        logprobs=logprobs,
        prompt_logprobs=prompt,
    )


def ask_for_usage(body: dict[str, Any], req: ParsedRequest, edits: BodyEdits) -> bool:
    """A stream that would carry no usage asks for it (`stream_options.include_usage`); True if changed."""
    if not (edits.include_usage and req.stream and not req.include_usage):
        return False
    options = body.get("stream_options")
    body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return True


def edit_generation(body: dict[str, Any], req: ParsedRequest, edits: BodyEdits) -> bool:
    """Edits common to chat and completions: usage in the stream, an output bound, the priority."""
    changed = ask_for_usage(body, req, edits)
    return edit_bound(body, req, edits) or changed


def edit_bound(body: dict[str, Any], req: ParsedRequest, edits: BodyEdits, key: str = "max_tokens") -> bool:
    """An injected output bound goes in `key` of a request that named none; the priority is set or
    stripped. True if the body changed."""
    changed = False
    if edits.max_tokens is not None and req.requested_max_tokens is None:
        body[key] = edits.max_tokens
        changed = True
    return edit_priority(body, edits) or changed


def edit_priority(body: dict[str, Any], edits: BodyEdits) -> bool:
    """A client must not pick its own place in the backend's priority scheduling: strip it or set it."""
    if edits.priority is not None:
        if body.get("priority") != edits.priority:
            body["priority"] = edits.priority
            return True
        return False
    if edits.strip_priority and "priority" in body:
        del body["priority"]
        return True
    return False


def chat_output_bound(body: Mapping[str, Any]) -> tuple[int | None, str]:
    """A chat request's output bound and the field it came from: `max_completion_tokens` wins over the
    deprecated `max_tokens` when both are sent, as in vLLM's chat protocol."""
    requested = f.opt_int(body, "max_tokens", low=1, high=f.MAX_TOKENS_LIMIT)
    bound = f.opt_int(body, "max_completion_tokens", low=1, high=f.MAX_TOKENS_LIMIT)
    if bound is not None:
        return bound, "max_completion_tokens"
    return requested, "max_tokens"


def text_prompts(body: Mapping[str, Any], key: str) -> tuple[Prompt, ...]:
    """One prompt per entry of `prompt`/`input`: a string is tokenized, a token-id array counts its length."""
    out = []
    for item in f.prompt_list(body.get(key), key):
        out.append(Prompt(texts=(item,)) if isinstance(item, str) else Prompt(fixed_tokens=len(item)))
    return tuple(out)


# ----------------------------------------------------------------------------------------------------
# What the responses carry


class OpenAIDialect:
    """Chat completions and completions: `choices[].delta` / `choices[].message` / `choices[].text`, and
    `usage.{prompt_tokens,completion_tokens}` (the include_usage event has `"choices": []`)."""

    def event(self, name: bytes, obj: Mapping[str, Any]) -> Observed:
        return self._read(obj, "delta")

    def body(self, obj: Any) -> Observed:
        return self._read(obj, "message") if isinstance(obj, dict) else Observed()

    def _read(self, obj: Mapping[str, Any], key: str) -> Observed:
        seen = Observed.of_body(obj)
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    _choice_texts(choice, key, seen.texts)
        read_openai_usage(obj, seen)
        return seen


def read_openai_usage(obj: Mapping[str, Any], seen: Observed) -> None:
    """`usage.{prompt_tokens,completion_tokens}` and `usage.prompt_tokens_details.cached_tokens`; an event
    whose `choices` are empty is the usage-only one.

    vLLM 0.32.0 writes `prompt_tokens_details` only with `--enable-prompt-tokens-details`: in chat bodies and
    the streamed usage event (entrypoints/openai/chat_completion/serving.py `_make_prompt_tokens_details`,
    used at 853 and 1164), in completions (completion/serving.py 453-456 streamed, 608-615 whole; with
    several prompts it reports one prompt's hit, so a discount undercounts, never overcounts) and
    token-in/token-out (scale_out/token_in_token_out/serving.py 478-483, 675-677); `cached_tokens` may be
    null there (entrypoints/serve/engine/protocol.py `PromptTokenUsageInfo`), read as unknown."""
    usage = obj.get("usage")
    if isinstance(usage, dict):
        choices = obj.get("choices")
        seen.usage_seen = True
        seen.prompt = count_int(usage.get("prompt_tokens"))
        seen.completion = count_int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            seen.cached = count_int(details.get("cached_tokens"))
        seen.usage_only = choices is None or choices == []


OPENAI_DIALECT = OpenAIDialect()


def _choice_texts(choice: Mapping[str, Any], key: str, texts: list[str]) -> None:
    """The generated text in one choice (`delta` for chunks, `message` for bodies, `text` for completions)."""
    text = choice.get("text")  # completions
    if isinstance(text, str):
        texts.append(text)
    part = choice.get(key)
    if isinstance(part, dict):
        texts.extend(content_texts(part.get("content")))
        reasoning = part.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = part.get("reasoning")
        if isinstance(reasoning, str):
            texts.append(reasoning)
        tool_calls = part.get("tool_calls")
        if isinstance(tool_calls, list):
            for call in tool_calls:
                if isinstance(call, dict):
                    function_texts(call.get("function"), texts)
        function_texts(part.get("function_call"), texts)


def function_texts(function: Any, texts: list[str]) -> None:
    """The generated name and arguments of a tool or function call (both are decoded tokens)."""
    if not isinstance(function, dict):
        return
    for key in ("name", "arguments"):
        value = function.get(key)
        if isinstance(value, str):
            texts.append(value)


# OpenAI chunks (`OpenAIDialect`): generated text in `delta.content`, `delta.reasoning_content` or
# `delta.reasoning`, tool call names and arguments, completions' `text`.
OPENAI_SPEC = ReadSpec(
    content=tuple(
        json_text(k) for k in ("content", "reasoning_content", "reasoning", "arguments", "name", "text")
    ),
    usage_only=json_key("choices") + "%[%s*%]",
)
"""How the proxy reads OpenAI chunks; also the spec of every API that answers only with a JSON body (the
dialect reads the body whole, the patterns never match)."""
