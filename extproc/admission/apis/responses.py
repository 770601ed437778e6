"""OpenAI Responses (`POST /v1/responses`), as vLLM and SGLang serve it.

Counting rule: the server turns the request into chat messages and renders them with the chat template
(vLLM v0.33.0 entrypoints/openai/responses/utils.py:263-305 `construct_input_messages`): `instructions`
becomes a leading system message, a string `input` one user message, and each input item a message (or a
part of one): messages with their content parts, `function_call` / `custom_tool_call` (name and arguments),
`function_call_output` / `custom_tool_call_output` (the output), `reasoning` (its text). Every string an
item carries is counted; media parts are charged the model's media cost; `tools` are rendered as compact
JSON. Each item is charged the template's per-message overhead (vLLM merges some items into one message,
so this errs high), and the request its per-request overhead plus the model's `template.bos`: vLLM
tokenizes the rendered Responses prompt with the tokenizer's special tokens (responses/protocol.py:460
keeps `add_special_tokens=True`, where chat completions default to False), so a Llama or Mistral tokenizer
prepends a second BOS.

Output bound: `max_output_tokens`, absent means the rest of the window (vLLM v0.33.0
entrypoints/openai/responses/serving.py:429-438 `get_max_tokens`). It applies per generation turn: with
built-in (server-side) tools the server loops, re-prefilling the whole conversation and each tool's output
every turn (serving.py:643-752), until the model stops calling tools or `max_tool_calls` calls were made
(serving.py:698). Tool output has no size bound, so each extra turn is bounded only by the window: the
request is charged one opaque prompt (a whole window) per allowed tool call, and refused without
`max_tool_calls`.

`previous_response_id` prepends a conversation stored on the server (serving.py:364-371, utils.py:280-296)
whose size the gateway cannot know: refused unless stored context is allowed, then charged as opaque.
`background: true` runs the generation after the HTTP exchange ends, where it can be neither held nor
settled: refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.admission.apis.openai import ContentTexts, edit_bound, entries, int_value, template_inputs
from extproc.admission.apis.spec import ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest, StepWork
from extproc.admission.vocabulary.prompt import Prompt
from extproc.admission.vocabulary.readspec import COMMON_ERRORS, ReadSpec, event_type, json_key
from extproc.admission.vocabulary.usage import Observed, count_int

CLIENT_TOOL_TYPES = frozenset({"function", "custom", "namespace"})
"""Tool types the client executes; any other type (web_search_preview, code_interpreter, container, mcp,
...) may be a built-in tool the server runs in a loop (vLLM v0.33.0 responses/serving.py:398-418,
responses/context.py:434-446)."""

MAX_TOOL_CALLS = 128
"""The most built-in tool calls one request may allow; each is charged a whole context window."""

CALL_ITEMS = frozenset({"function_call", "custom_tool_call"})
OUTPUT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output"})


class _Items:
    """Collects the texts, media and message count of the Responses `input`, validating each item."""

    def __init__(self) -> None:
        self.collected = ContentTexts()

    def add_turn(self, role: str, text: str) -> None:
        self.collected.messages += 1
        self.collected.texts.extend((role, text))

    def add_item(self, item: Any, param: str) -> None:
        if not isinstance(item, dict):
            f.bad(f"'{param}' must be an object, got {f.json_type(item)}.", code="invalid_type", param=param)
        kind = item.get("type")
        if kind is not None and not isinstance(kind, str):
            f.bad(f"'{param}.type' must be a string.", code="invalid_type", param=f"{param}.type")
        if kind in (None, "message"):
            self.collected.add_message(item, param)
        elif kind in CALL_ITEMS:
            self._call(item, kind, param)
        elif kind in OUTPUT_ITEMS:
            self._values(item, param, role="tool")
            self.collected.add_content(item.get("output"), f"{param}.output")
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:
                # vLLM v0.33.0 entrypoints/openai/responses/utils.py:387-392
                f.bad(
                    f"'{param}.encrypted_content' is not supported: encrypted reasoning cannot be rendered.",
                    code="unsupported_parameter",
                    param=f"{param}.encrypted_content",
                )
            self._values(item, param, role="assistant")
        else:
            # vLLM v0.33.0 entrypoints/openai/responses/utils.py:452-457
            f.bad(f"Unsupported input item type: {kind}.", code="invalid_value", param=f"{param}.type")

    def _call(self, item: dict[str, Any], kind: str, param: str) -> None:
        f.required_str(item, "name", f"{param}.name")
        f.required_str(item, "call_id", f"{param}.call_id")
        if kind == "function_call":
            f.required_str(item, "arguments", f"{param}.arguments")
        self._values(item, param, role="assistant")

    def _values(self, item: dict[str, Any], param: str, role: str) -> None:
        """One rendered message: its role and every field; part lists (a reasoning item's `content` and
        `summary`) count their parts' texts. `output` is left to the caller, as content."""
        self.collected.messages += 1
        self.collected.texts.append(role)
        for key, value in item.items():
            if key in ("type", "output"):
                continue
            if key in ("content", "summary") and isinstance(value, list):
                self.collected.add_content(value, f"{param}.{key}")
            else:
                self.collected.add_value(value, f"{param}.{key}")


def responses_prompt(body: Mapping[str, Any]) -> Prompt:
    """The prompt the server renders from `instructions`, `input`, `tools` and `previous_input_messages`."""
    items = _Items()
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            f.bad("'instructions' must be a string.", code="invalid_type", param="instructions")
        items.add_turn("system", instructions)
    previous = f.opt_list(body, "previous_input_messages", "previous_input_messages") or []
    for i, message in enumerate(previous):
        items.collected.messages += 1
        items.collected.add_value(message, f"previous_input_messages[{i}]")
    value = body.get("input")
    if value is None:
        f.bad("Missing required parameter: 'input'.", code="missing_field", param="input")
    if isinstance(value, str):
        items.add_turn("user", value)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            items.add_item(item, f"input[{i}]")
    else:
        f.bad(
            f"'input' must be a string or an array of input items, got {f.json_type(value)}.",
            code="invalid_type",
            param="input",
        )
    items.collected.texts.extend(template_inputs(body, ("tools",)))
    c = items.collected
    # The rendered template is tokenized with special tokens (vLLM 0.32.0 responses/protocol.py:460): the
    # tokenizer's BOS comes on top of the template's.
    return Prompt(
        texts=tuple(c.texts), messages=c.messages, templated=True, media=c.media, special_tokens=True
    )


def builtin_tools(body: Mapping[str, Any]) -> list[str]:
    """Types of the tools the server may run itself, validating each tool's `type`."""
    found = []
    for i, tool in enumerate(f.opt_list(body, "tools", "tools") or []):
        if not isinstance(tool, dict):
            f.bad(f"'tools[{i}]' must be an object.", code="invalid_type", param=f"tools[{i}]")
        kind = f.required_str(tool, "type", f"tools[{i}].type")
        if kind not in CLIENT_TOOL_TYPES:
            found.append(kind)
    return found


TRUNCATION_VALUES = ("auto", "disabled")


def _truncation(body: Mapping[str, Any]) -> int | None:
    """`truncation: "auto"` truncates the prompt to what the window allows, like `truncate_prompt_tokens:
    -1`; `"disabled"` (the default) does not (vLLM v0.32.0 entrypoints/openai/responses/protocol.py:267,
    :464, serving.py:426-435)."""
    value = body.get("truncation")
    if value is not None and value not in TRUNCATION_VALUES:
        f.bad(
            f"'truncation' must be one of {', '.join(TRUNCATION_VALUES)}, got {value!r}.",
            code="invalid_value",
            param="truncation",
        )
    return -1 if value == "auto" else None


class ResponsesAdapter:
    api = Api("responses")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = f.model_name(body)
        stream = bool(f.opt_bool(body, "stream", "stream"))
        if f.opt_bool(body, "background", "background"):
            f.bad(
                "'background' responses run after the request ends and cannot be metered by this gateway.",
                code="unsupported_parameter",
                param="background",
            )
        requested = f.opt_int(body, "max_output_tokens", low=1, high=f.MAX_TOKENS_LIMIT)
        prompt = responses_prompt(body)
        stored: str | None = None
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                f.bad(
                    "'previous_response_id' must be a string.",
                    code="invalid_type",
                    param="previous_response_id",
                )
            stored, prompt = "previous_response_id", Prompt(opaque=True)
        turns = self._extra_turns(body)
        return ParsedRequest(
            api=self.api,
            model=model,
            prompts=(prompt,) + (Prompt(opaque=True),) * turns,
            stream=stream,
            requested_max_tokens=requested,
            max_tokens_param="max_output_tokens",
            prompt_param="input",
            stored_context=stored,
            truncate_prompt_tokens=_truncation(body),
            ignore_eos=bool(f.opt_bool(body, "ignore_eos", "ignore_eos")),
            work=StepWork(
                stop=entries(body.get("stop")),
                logit_bias=entries(body.get("logit_bias")),
                logprobs=int_value(body.get("top_logprobs")) or None,
                logprobs_param="top_logprobs",
            ),
            body=body,
        )

    @staticmethod
    def _extra_turns(body: Mapping[str, Any]) -> int:
        """Generation turns after the first: one per built-in tool call the request allows."""
        builtin = builtin_tools(body)
        calls = f.opt_int(body, "max_tool_calls", low=0, high=MAX_TOOL_CALLS)
        if not builtin:
            return 0
        if calls is None:
            f.bad(
                f"'max_tool_calls' is required with built-in tools ({', '.join(sorted(set(builtin)))}): each "
                "call re-runs the model on the whole conversation, so the gateway must bound their number.",
                code="missing_field",
                param="max_tool_calls",
            )
        return calls

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return edit_bound(body, req, edits, "max_output_tokens")


# ----------------------------------------------------------------------------------------------------
# Responses: events and bodies

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
"""Events that end a stream and carry the whole response with its usage (vLLM v0.33.0
entrypoints/openai/responses/serving.py:1440-1457; `response.failed` is SGLang's)."""

NOT_TEXT_DELTAS = frozenset({"response.audio.delta"})
"""Delta events whose payload is not generated text (base64 audio)."""


def _usage(seen: Observed, usage: Any) -> None:
    """`input_tokens`, `output_tokens` and `input_tokens_details.cached_tokens` (the prefix-cache hit,
    included in `input_tokens`), which vLLM 0.32.0 writes whatever its flags
    (entrypoints/openai/responses/serving.py 867-886)."""
    if isinstance(usage, dict):
        seen.usage_seen = True
        seen.prompt = count_int(usage.get("input_tokens"))
        seen.completion = count_int(usage.get("output_tokens"))
        details = usage.get("input_tokens_details")
        if isinstance(details, dict):
            seen.cached = count_int(details.get("cached_tokens"))


def _item_texts(item: Any, texts: list[str]) -> None:
    """Generated text of one output item: message text, refusals, reasoning, tool call names and inputs."""
    if not isinstance(item, dict):
        return
    for key in ("name", "arguments", "input"):
        value = item.get(key)
        if isinstance(value, str) and item.get("type") != "message":
            texts.append(value)
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            for part in parts:
                if isinstance(part, dict):
                    for field in ("text", "refusal"):
                        value = part.get(field)
                        if isinstance(value, str):
                            texts.append(value)


class ResponsesDialect:
    """Responses SSE (`event: <type>` + `data: <json>`, no `[DONE]`; vLLM v0.33.0
    entrypoints/openai/responses/api_router.py:33-44) and bodies (top-level `usage.input_tokens` /
    `output_tokens`).

    Generated text is read from `*.delta` events only (output text, reasoning, function-call arguments, ...):
    the `*.done` and `output_item.done` events repeat it. A function call's name is read when its item is
    added.
    """

    def event(self, name: bytes, obj: Mapping[str, Any]) -> Observed:
        kind = obj.get("type")
        if not isinstance(kind, str):
            kind = name.decode("utf-8", "replace")
        seen = Observed(error=kind in ("error", "response.failed") or obj.get("error") is not None)
        if kind.endswith(".delta") and kind not in NOT_TEXT_DELTAS:
            delta = obj.get("delta")
            if isinstance(delta, str):
                seen.texts.append(delta)
        elif kind == "response.output_item.added":
            item = obj.get("item")
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                seen.texts.append(item["name"])
        elif kind in TERMINAL_EVENTS:
            seen.final = True
            response = obj.get("response")
            if isinstance(response, dict):
                _usage(seen, response.get("usage"))
        return seen

    def body(self, obj: Any) -> Observed:
        if not isinstance(obj, dict):
            return Observed()
        seen = Observed.of_body(obj)
        output = obj.get("output")
        if isinstance(output, list):
            for item in output:
                _item_texts(item, seen.texts)
        _usage(seen, obj.get("usage"))
        return seen


RESPONSES_DIALECT = ResponsesDialect()


# `*.delta` events except audio; the terminal events carry the usage; no `[DONE]`.
RESPONSES_SPEC = ReadSpec(
    content=(json_key("type") + '"response%.[%w_%.]*%.delta"',),
    not_content=(event_type("response%.audio%.delta"),),
    final=tuple(event_type(t) for t in ("response%.completed", "response%.incomplete", "response%.failed")),
    error=(*COMMON_ERRORS, event_type("error"), event_type("response%.failed")),
)

SPEC = ApiSpec(
    adapter=ResponsesAdapter(),
    dialect=shared(RESPONSES_DIALECT),
    read=RESPONSES_SPEC,
    paths=(path("/v1/responses", "generates; built-in tools re-run it per tool call"),),
)
