"""vLLM v0.32.0's own rules for the effective prompt, the output bound, the chat template's inputs and the
per-step work, as the meter applies them (docs/admission.md "vLLM's rules ...", "Per-step work")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.admission.intake.request import Api, ParsedRequest, parse_request
from extproc.admission.intake.reservation import (
    Reservation,
    count_prompt_tokens,
    plan_reservation,
    prompt_token_lower_bound,
)
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.policy import MissingMaxTokens, ModelPolicy, StepBounds, TemplateCosts
from tests.unit.admission.apis_helpers import counts, parse, refused, tk

WINDOW = 8192
POLICY = ModelPolicy(WINDOW, template=TemplateCosts(0, 0))
LONG = "word " * 8100  # 8,100 tokens


def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


def planned(api: Api, body: dict[str, Any], policy: ModelPolicy = POLICY, **bounds: int) -> Reservation:
    req = parse_request(api, json.dumps(body).encode(), bounds=StepBounds(**bounds))
    return plan_reservation(req, count_prompt_tokens(req, policy), policy, StepBounds(**bounds))


def plan_refused(
    api: Api, body: dict[str, Any], policy: ModelPolicy = POLICY, **bounds: int
) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        planned(api, body, policy, **bounds)
    assert info.value.status == 400
    return info.value


# -- truncate_prompt_tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [16, 32, 128])
def test_truncation_reserves_what_vllm_lets_each_sequence_generate(n: int) -> None:
    """vLLM cuts the prompt to t tokens, then each of n outputs may run to window - t (get_max_tokens)."""
    got = planned(Api("chat"), chat(LONG, n=n, truncate_prompt_tokens=100))
    assert got.prompt_tokens == 100
    assert got.completion_tokens == n * (WINDOW - 100)


def test_truncation_cuts_a_prompt_longer_than_the_window_instead_of_refusing_it() -> None:
    body = {"model": "m", "prompt": LONG * 3, "truncate_prompt_tokens": 500, "n": 2}
    req = parse(Api("completions"), body)
    assert prompt_token_lower_bound(req, POLICY) == 500
    got = planned(Api("completions"), body)
    assert (got.prompt_tokens, got.completion_tokens) == (500, 2 * (WINDOW - 500))


def test_truncation_to_minus_one_keeps_the_window_less_one_token_for_generation() -> None:
    got = planned(Api("chat"), chat(LONG * 3, truncate_prompt_tokens=-1))
    assert (got.prompt_tokens, got.completion_tokens) == (WINDOW - 1, 1)
    pooled = planned(Api("embeddings"), {"model": "m", "input": LONG * 3, "truncate_prompt_tokens": -1})
    assert (pooled.prompt_tokens, pooled.completion_tokens) == (WINDOW, 0)


def test_truncation_clamps_an_explicit_bound_as_vllm_does() -> None:
    got = planned(Api("chat"), chat(LONG, truncate_prompt_tokens=8000, max_tokens=1000))
    assert got.completion_tokens == WINDOW - 8000


def test_a_short_prompt_is_kept_whole_under_truncation() -> None:
    got = planned(Api("completions"), {"model": "m", "prompt": "hello world", "truncate_prompt_tokens": 500})
    assert (got.prompt_tokens, got.completion_tokens) == (tk("hello world"), WINDOW - tk("hello world"))


def test_truncation_above_the_window_is_refused_naming_the_field() -> None:
    error = plan_refused(
        Api("completions"), {"model": "m", "prompt": "x", "truncate_prompt_tokens": WINDOW + 1}
    )
    assert error.param == "truncate_prompt_tokens"
    assert refused(Api("chat"), chat(truncate_prompt_tokens=-2)).param == "truncate_prompt_tokens"


def test_responses_truncation_auto_is_minus_one() -> None:
    body = {"model": "m", "input": LONG * 3, "truncation": "auto"}
    got = planned(Api("responses"), body, ModelPolicy(WINDOW, template=TemplateCosts(0, 0)))
    assert (got.prompt_tokens, got.completion_tokens) == (WINDOW - 1, 1)
    assert refused(Api("responses"), {**body, "truncation": "sometimes"}).param == "truncation"


def test_batch_chat_truncates_every_conversation() -> None:
    conversations = [[{"role": "user", "content": LONG}], [{"role": "user", "content": LONG}]]
    got = planned(Api("chat_batch"), {"model": "m", "messages": conversations, "truncate_prompt_tokens": 10})
    assert (got.prompt_tokens, got.completion_tokens) == (20, 2 * (WINDOW - 10))


# -- min_tokens and ignore_eos ---------------------------------------------------------------------------


def test_ignore_eos_commits_the_whole_bound_of_every_sequence() -> None:
    got = planned(Api("chat"), chat(n=3, max_tokens=100, ignore_eos=True))
    assert got.committed_completion_tokens == got.completion_tokens == 300


def test_min_tokens_commits_that_many_per_sequence() -> None:
    got = planned(
        Api("completions"), {"model": "m", "prompt": "hi", "n": 2, "max_tokens": 100, "min_tokens": 40}
    )
    assert (got.completion_tokens, got.committed_completion_tokens) == (200, 80)
    assert (
        planned(
            Api("completions"), {"model": "m", "prompt": "hi", "max_tokens": 9}
        ).committed_completion_tokens
        == 0
    )


def test_min_tokens_above_the_bound_is_refused_as_vllm_does() -> None:
    error = plan_refused(Api("chat"), chat(max_tokens=10, min_tokens=11))
    assert error.param == "min_tokens" and "max_tokens=10" in error.message
    # Without a bound, vLLM's bound is the rest of the window.
    small = ModelPolicy(200, template=TemplateCosts(0, 0))
    assert plan_refused(Api("chat"), chat(min_tokens=199), small).param == "min_tokens"
    assert planned(Api("chat"), chat(min_tokens=198), small).committed_completion_tokens == 198


def test_an_injected_bound_is_never_below_min_tokens() -> None:
    policy = ModelPolicy(WINDOW, template=TemplateCosts(0, 0), missing_max_tokens=MissingMaxTokens.INJECT)
    got = planned(Api("chat"), chat(min_tokens=2000), policy)
    assert got.injected_max_tokens == 2000 and got.committed_completion_tokens == 2000


def test_generate_tokens_reads_its_least_output_from_sampling_params() -> None:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 50, "ignore_eos": True, "n": 2}}
    assert planned(Api("generate_tokens"), body).committed_completion_tokens == 100
    bad = {"token_ids": [1], "sampling_params": {"min_tokens": -1}}
    assert refused(Api("generate_tokens"), bad).param == "sampling_params.min_tokens"


# -- chat template inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["documents", "custom_tools", "date_string"])
def test_every_chat_template_kwarg_is_counted(name: str) -> None:
    text = "fact " * 2000
    value: Any = text if name == "date_string" else [{"title": "t", "text": text}]
    req = parse(Api("chat"), chat(max_tokens=1, chat_template_kwargs={name: value}))
    expected = tk(text) if name == "date_string" else tk(json.dumps(value, separators=(",", ":")))
    assert counts(req)[0] >= tk("user", "hi") + expected >= 2000


@pytest.mark.parametrize(
    ("api", "body"),
    [
        (Api("chat_batch"), {"model": "m", "messages": [[{"role": "user", "content": "hi"}]]}),
        (Api("responses"), {"model": "m", "input": "hi"}),
        (Api("messages"), {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
        (Api("embeddings"), {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_chat_template_kwargs_count_in_every_templated_api(api: Api, body: dict[str, Any]) -> None:
    bare = counts(parse(api, body))[0]
    kwargs = {"chat_template_kwargs": {"documents": [{"text": "fact " * 500}]}}
    assert counts(parse(api, {**body, **kwargs}))[0] - bare >= 500


def test_chat_template_kwargs_must_be_an_object() -> None:
    assert refused(Api("chat"), chat(chat_template_kwargs=["x"])).param == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template": "{{ 1 }}"}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs.chat_template"),
        ({"chat_template_kwargs": {"chat_template": None}}, None),
    ],
)
def test_a_request_supplied_template_is_named_wherever_it_hides(
    fields: dict[str, Any], param: str | None
) -> None:
    req: ParsedRequest = parse(Api("chat"), chat(**fields))
    assert req.custom_template == param


# -- per-step work ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "fields", "param"),
    [
        (Api("chat"), {"stop": ["a"] * 5}, "stop"),
        (Api("completions"), {"bad_words": ["w"] * 129}, "bad_words"),
        (Api("chat"), {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        (Api("completions"), {"logprobs": 21}, "logprobs"),
        (Api("completions"), {"logprobs": -1}, "logprobs"),
        (Api("chat"), {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (Api("chat"), {"prompt_logprobs": 21}, "prompt_logprobs"),
        (Api("chat"), {"echo": True, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (Api("responses"), {"stop": ["a"] * 5}, "stop"),
        (Api("messages"), {"stop_sequences": ["a"] * 5}, "stop_sequences"),
    ],
)
def test_per_step_work_past_the_default_bounds_is_refused(
    api: Api, fields: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {
        Api("chat"): chat(),
        Api("completions"): {"model": "m", "prompt": "hi"},
        Api("responses"): {"model": "m", "input": "hi"},
        Api("messages"): {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    }[api]
    error = refused(api, {**base, **fields})
    assert (error.param, error.code) == (param, "invalid_value")


def test_per_step_work_within_the_bounds_passes_and_bounds_are_configurable() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "stop": ["a", "b", "c", "d"],
        "bad_words": ["w"] * 128,
        "logprobs": 20,
    }
    assert planned(Api("completions"), body).completion_tokens > 0
    with pytest.raises(AdmissionError) as info:
        parse_request(Api("completions"), json.dumps(body).encode(), bounds=StepBounds(stop=3))
    assert info.value.param == "stop"
    assert planned(Api("chat"), chat(stop=["x"] * 10), stop=10).completion_tokens > 0


@pytest.mark.parametrize(
    ("api", "fields"),
    [
        (Api("completions"), {"prompt_logprobs": 1}),
        (Api("completions"), {"echo": True, "logprobs": 1}),
        (Api("chat"), {"echo": True}),  # vLLM: echo without prompt_logprobs asks for top_logprobs (0) of them
    ],
)
def test_prompt_logprobs_are_bounded_by_prompt_length(api: Api, fields: dict[str, Any]) -> None:
    base = chat(LONG[:15_000]) if api == Api("chat") else {"model": "m", "prompt": LONG[:15_000]}
    error = plan_refused(api, {**base, "max_tokens": 1, **fields})
    assert error.param == "prompt_logprobs"
    assert planned(api, {**base, "max_tokens": 1, **fields}, prompt_logprobs_tokens=4000).prompt_tokens > 3000
    short = chat("hi") if api == Api("chat") else {"model": "m", "prompt": "hi"}
    assert planned(api, {**short, "max_tokens": 1, **fields}).prompt_tokens > 0


def test_completions_echo_without_logprobs_asks_for_no_prompt_logprobs() -> None:
    body = {"model": "m", "prompt": LONG[:15_000], "echo": True}
    assert planned(Api("completions"), body).prompt_tokens == tk(LONG[:15_000])


# -- SGLang's native /generate: the same rules under its own names --------------------------------------


def test_sglang_native_least_output_and_per_step_work() -> None:
    body: dict[str, Any] = {"text": "hi", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
    assert planned(Api("sglang_generate"), body).committed_completion_tokens == 50
    body["sampling_params"] = {"max_new_tokens": 50, "min_new_tokens": 60}
    assert plan_refused(Api("sglang_generate"), body).param == "min_new_tokens"
    body["sampling_params"] = [{"stop": ["a"] * 5}, {}]
    body["text"] = ["a", "b"]
    assert refused(Api("sglang_generate"), body).param == "stop"
    logprobs = {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}
    assert refused(Api("sglang_generate"), logprobs).param == "top_logprobs_num"
    prompt = {"text": LONG[:15_000], "return_logprob": True, "logprob_start_len": 0}
    assert plan_refused(Api("sglang_generate"), prompt).param == "prompt_logprobs"
    assert planned(Api("sglang_generate"), {**prompt, "logprob_start_len": -1}).prompt_tokens > 3000
