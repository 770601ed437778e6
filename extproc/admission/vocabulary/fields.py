"""Field validation shared by every API adapter: each error names the field, as OpenAI's API does.

A malformed request is refused with the 400 the backend would have returned, before it holds a slot or a
token. JSON null counts as absent for optional fields (OpenAI clients send `"max_tokens": null`). Beside the
checks of one value's type and range are the readers of fields several APIs share (`stream_options`,
`least_output`, `truncation`), next to the checks they are made of, so that an adapter reading them makes
one call here, not one back and forth with another module per field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NoReturn

from extproc.admission.vocabulary.errors import AdmissionError

# Far above any real model's context, far below anything that could overflow arithmetic downstream.
MAX_TOKENS_LIMIT = 10_000_000
# Served model names are short (Hugging Face repo ids are at most 96 characters); longer is not a model.
MAX_MODEL_NAME = 256
# OpenAI caps n at 128; each choice is a separate sequence holding its own KV cache.
MAX_N = 128
# Token ids are non-negative; anything beyond int32 is not a vocabulary index of any served model.
MAX_TOKEN_ID = 2**31 - 1


def bad(message: str, *, code: str, param: str | None) -> NoReturn:
    raise AdmissionError(400, message, code=code, param=param)


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are not JSON; Python accepts them by default, the backend's validator may not.
    raise ValueError(f"{name} is not valid JSON")


def load_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body; invalid UTF-8, invalid JSON, NaN, deep nesting and non-objects are 400s."""
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        bad(f"Request body is not valid UTF-8 (at byte {exc.start}).", code="invalid_json", param=None)
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        bad("Request body nests too deeply to be parsed.", code="invalid_json", param=None)
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers longer than Python's digit limit
        bad(f"Request body is not valid JSON: {exc}", code="invalid_json", param=None)
    if not isinstance(body, dict):
        bad(f"Request body must be a JSON object, got {json_type(body)}.", code="invalid_type", param=None)
    return body


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def required_str(obj: Mapping[str, Any], key: str, param: str) -> str:
    """A field that must be present (null counts as absent) and a string; the error names `param`."""
    value = obj.get(key)
    if value is None:
        bad(f"Missing required parameter: '{param}'.", code="missing_field", param=param)
    if not isinstance(value, str):
        bad(f"'{param}' must be a string, got {json_type(value)}.", code="invalid_type", param=param)
    return value


def model_name(body: Mapping[str, Any]) -> str:
    """The `model` field: required, non-empty, and short (it becomes a limiter key and a metric label)."""
    model = required_str(body, "model", "model")
    if len(model) > MAX_MODEL_NAME:
        bad(f"'model' must be at most {MAX_MODEL_NAME} characters.", code="invalid_value", param="model")
    if not model:
        bad("'model' must not be empty.", code="invalid_value", param="model")
    return model


def opt_int(
    body: Mapping[str, Any], key: str, *, low: int, high: int, param: str | None = None
) -> int | None:
    value = body.get(key)
    name = param or key
    if value is None:
        return None
    # bool is an int subclass and 3.0 / "3" are refused by the API; only a JSON integer literal is accepted.
    if type(value) is not int:
        bad(f"'{name}' must be an integer, got {json_type(value)}.", code="invalid_type", param=name)
    if value < low:
        bad(f"'{name}' must be at least {low}, got {value}.", code="invalid_value", param=name)
    if value > high:
        bad(f"'{name}' must be at most {high}, got {value}.", code="invalid_value", param=name)
    return value


def opt_bool(body: Mapping[str, Any], key: str, param: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        bad(f"'{param}' must be a boolean, got {json_type(value)}.", code="invalid_type", param=param)
    return value


def opt_list(body: Mapping[str, Any], key: str, param: str) -> list[Any] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        bad(f"'{param}' must be an array, got {json_type(value)}.", code="invalid_type", param=param)
    return value


def opt_object(body: Mapping[str, Any], key: str, param: str) -> dict[str, Any] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        bad(f"'{param}' must be an object, got {json_type(value)}.", code="invalid_type", param=param)
    return value


def token_ids(ids: list[Any], param: str) -> None:
    """Every element a JSON integer that can be a vocabulary index."""
    for j, token in enumerate(ids):
        if type(token) is not int:
            bad(
                f"'{param}[{j}]' must be an integer token id, got {json_type(token)}.",
                code="invalid_type",
                param=f"{param}[{j}]",
            )
        if not 0 <= token <= MAX_TOKEN_ID:
            bad(
                f"'{param}[{j}]' is not a valid token id: {token}.",
                code="invalid_value",
                param=f"{param}[{j}]",
            )


def prompt_list(value: Any, key: str) -> list[str | list[int]]:
    """Normalise `prompt`/`input` to one entry per prompt, validating the four shapes the API accepts:
    a string, an array of strings, an array of token ids, an array of token-id arrays."""
    if value is None:
        bad(f"Missing required parameter: '{key}'.", code="missing_field", param=key)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        bad(
            f"'{key}' must be a string, an array of strings, an array of token ids or an array of token-id "
            f"arrays, got {json_type(value)}.",
            code="invalid_type",
            param=key,
        )
    if not value:
        bad(f"'{key}' must not be an empty array.", code="invalid_value", param=key)
    first = value[0]
    if isinstance(first, str):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                bad(
                    f"'{key}[{i}]' must be a string like the other elements, got {json_type(item)}.",
                    code="invalid_type",
                    param=f"{key}[{i}]",
                )
        return list(value)
    if isinstance(first, list):
        out: list[str | list[int]] = []
        for i, item in enumerate(value):
            if not isinstance(item, list):
                bad(
                    f"'{key}[{i}]' must be an array of token ids like the other elements, "
                    f"got {json_type(item)}.",
                    code="invalid_type",
                    param=f"{key}[{i}]",
                )
            if not item:
                bad(f"'{key}[{i}]' must not be an empty array.", code="invalid_value", param=f"{key}[{i}]")
            token_ids(item, f"{key}[{i}]")
            out.append(item)
        return out
    token_ids(value, key)
    return [value]


def compact_json(value: Any, param: str) -> str:
    """The compact JSON a structured field is counted as (tools, tool calls, unknown message fields)."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    except RecursionError:
        bad(f"'{param}' nests too deeply.", code="invalid_value", param=param)
    except (
        TypeError,
        ValueError,
    ):  # unreachable for parsed JSON; a caller-built body must not crash counting
        bad(f"'{param}' is not serialisable.", code="invalid_value", param=param)


def truncation(body: Mapping[str, Any], param: str = "truncate_prompt_tokens") -> int | None:
    """`truncate_prompt_tokens`: -1 or more (vLLM v0.32.0 entrypoints/openai/chat_completion/protocol.py:285,
    completion/protocol.py:88, pooling/base/protocol.py:42)."""
    return opt_int(body, "truncate_prompt_tokens", low=-1, high=MAX_TOKENS_LIMIT, param=param)


def least_output(body: Mapping[str, Any], prefix: str = "") -> tuple[int, bool]:
    """(`min_tokens`, `ignore_eos`): what a request declares it will generate at least per sequence
    (vLLM v0.32.0 chat_completion/protocol.py:281-282, completion/protocol.py:84-85)."""
    least = opt_int(body, "min_tokens", low=0, high=MAX_TOKENS_LIMIT, param=f"{prefix}min_tokens") or 0
    return least, bool(opt_bool(body, "ignore_eos", f"{prefix}ignore_eos"))


def stream_options(body: Mapping[str, Any], *, only_when_streamed: bool = False) -> tuple[bool, bool]:
    """(stream, include_usage) of a generation request. `only_when_streamed`: stream options without
    `stream: true` are refused, as vLLM 0.32.0 refuses them for chat and completions (chat_completion/
    protocol.py:822-831, completion/protocol.py:579-588: a truthy `stream_options` and a falsy `stream`),
    instead of admitting, metering and refunding what the engine will refuse."""
    stream = bool(opt_bool(body, "stream", "stream"))
    if only_when_streamed and body.get("stream_options") and not stream:
        bad(
            "Stream options (`stream_options`) can only be defined when `stream=True`.",
            code="invalid_value",
            param="stream_options",
        )
    options = opt_object(body, "stream_options", "stream_options")
    include_usage = (
        bool(opt_bool(options, "include_usage", "stream_options.include_usage")) if options else False
    )
    return stream, include_usage
