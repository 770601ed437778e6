"""OpenAI request parsing, vLLM-shaped errors and the completion-length policy.

Kept apart from the aiohttp handlers so the rules (what is a bad request, how many tokens a choice gets,
which finish_reason it ends with) are plain functions that unit tests call directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from extproc.admission.vocabulary.tokens import chat_prompt_ids, get_encoding
from extproc.sim.kvcache import hash_blocks
from extproc.sim.textgen import draw_output_length

OUTPUT_TOKENS_HEADER = "x-sim-output-tokens"
OUTPUT_TOKENS_FIELD = "sim_output_tokens"


class ApiError(Exception):
    """An error answered as vLLM's ErrorResponse: {"error": {message, type, param, code}}."""

    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def queue_overflow() -> ApiError:
    """vLLM's answer past `--max-num-queued-reqs`: `QueueOverflowError` (vllm 0.32.0 vllm/exceptions.py, a
    `GracefulHTTPError` whose type is the status's phrase in create_error_response,
    vllm/entrypoints/serve/exception_handling/error_response.py)."""
    return ApiError(
        503,
        "The engine is currently busy and cannot accept new requests. "
        "Please try again later or on a different instance.",
        "Service Unavailable",
    )


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


@dataclass(frozen=True)
class ParsedRequest:
    """What the simulator needs from a chat or completions body."""

    chat: bool
    body: dict[str, Any]
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None
    output_override: int | None


def optional_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer", key)
    if value < minimum:
        raise bad_request(f"'{key}' must be at least {minimum}, got {value}.", key)
    return value


def check_model(body: dict[str, Any], served_model: str) -> None:
    """An absent `model` means the served one (vLLM); another name is a 404."""
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def output_override(body: dict[str, Any], header_override: str | None) -> int | None:
    """The completion length a test asked for, by header (wins) or body field."""
    override = optional_int(body, OUTPUT_TOKENS_FIELD, 0)
    if header_override is not None:
        try:
            override = int(header_override)
        except ValueError:
            raise bad_request(f"header {OUTPUT_TOKENS_HEADER} must be an integer") from None
    return override


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) as vLLM reads them; `stream_options` without `stream` is refused, as vLLM's
    request validator does rather than ignoring it."""
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    return stream, stream and isinstance(options, dict) and bool(options.get("include_usage", False))


def parse_request(body: Any, chat: bool, header_override: str | None, served_model: str) -> ParsedRequest:
    """Validate the fields the simulator uses; anything else in the body is accepted and ignored."""
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    check_model(body, served_model)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("'messages' must be a non-empty list of message objects", "messages")
        max_tokens = optional_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = optional_int(body, "max_tokens", 1)
    else:
        if "prompt" not in body:
            raise bad_request("'prompt' is required", "prompt")
        max_tokens = optional_int(body, "max_tokens", 1)
    n = optional_int(body, "n", 1) or 1
    stream, include_usage = stream_flags(body)
    return ParsedRequest(
        chat, body, n, stream, include_usage, max_tokens, output_override(body, header_override)
    )


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine gets it: its token count and the chained hashes of its full blocks (empty
    with prefix caching off)."""

    tokens: int
    block_hashes: tuple[int, ...] = ()


def prompt_token_ids(req: ParsedRequest, encoding: str) -> list[list[int]]:
    """Token ids of each prompt (chat: one, rendered by `chat_prompt_ids`; completions: one per prompt of a
    batch, strings encoded as `count_text` counts them, token ids as given)."""
    body = req.body
    if req.chat:
        return [chat_prompt_ids(body["messages"], body.get("tools"), encoding)]
    prompt = body["prompt"]
    if isinstance(prompt, str):
        ids = [get_encoding(encoding).encode_ordinary(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        enc = get_encoding(encoding)
        ids = [enc.encode_ordinary(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(p) for p in prompt):
        ids = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        ids = list(prompt)
    else:
        raise bad_request(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
            "prompt",
        )
    if any(not p for p in ids):
        raise bad_request("Prompt cannot be empty", "prompt")
    return ids


def count_prompts(req: ParsedRequest, encoding: str) -> list[int]:
    """Prompt tokens of each prompt (chat: one; completions: one per prompt of a batch)."""
    return [len(ids) for ids in prompt_token_ids(req, encoding)]


def read_prompts(req: ParsedRequest, encoding: str, block_size: int, seed: int | None) -> list[Prompt]:
    """Each prompt's count and, when `seed` is given (prefix caching on), its block hashes chained from it.

    Tokenizing and hashing both run here, in one worker thread, so neither holds up the event loop.
    """
    return [
        Prompt(len(ids), hash_blocks(ids, block_size, seed) if seed is not None else ())
        for ids in prompt_token_ids(req, encoding)
    ]


def reads_prefix_cache(req: ParsedRequest) -> bool:
    """False when the request asks for prompt logprobs: vLLM then computes every prompt token and skips the
    lookup (`skip_reading_prefix_cache`)."""
    return req.body.get("prompt_logprobs") is None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Reject as vLLM's serving layer does, before the request reaches the engine queue."""
    if prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            "input_tokens",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens}).",
            "max_tokens",
        )


def plan_output(
    prompt_tokens: int,
    max_tokens: int | None,
    override: int | None,
    max_model_len: int,
    rng: random.Random,
    median: float,
    sigma: float,
) -> tuple[int, str]:
    """Completion tokens a choice will generate and its finish_reason.

    Wanted length: the override (header/body), else max_tokens, else a seeded log-normal draw. It is
    capped by max_tokens and by the context left (vLLM's default max_tokens); hitting a cap is "length",
    stopping earlier is "stop".
    """
    cap = max_model_len - prompt_tokens
    if max_tokens is not None:
        cap = min(cap, max_tokens)
    if override is not None:
        wanted = override
    elif max_tokens is not None:
        wanted = max_tokens
    else:
        wanted = draw_output_length(rng, median, sigma)
    wanted = max(1, wanted)
    if wanted >= cap:
        return cap, "length"
    return wanted, "stop"
