"""The meter tried with what vLLM's own request schema allows, through the real Envoy, sidecar and simulator,
in both profiles.

Each test is a field of vLLM v0.32.0's protocol models that changes what the engine does without the meter
seeing it: `truncate_prompt_tokens` with `n` (each sequence may run to the window less the kept prompt),
`chat_template_kwargs` (rendered by the template), per-step work (`stop`, `bad_words`, `logit_bias`, prompt
logprobs), and a tenant that trains its own completion forecast down before sending requests that declare
they run to their whole allowance (`ignore_eos`). After each profile's tests nothing is leaked.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from extproc.envoyconf.profiles import PROFILES
from tests.support.attacks import assert_nothing_leaked, chat, post, reserved, upstream_requests
from tests.support.stack import Reply, Stack, fixed_step_sim, http, profile_stack, start_stack
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
WINDOW = 8192
CONFIG: dict[str, Any] = {
    "admission": {"max_body_bytes": 1_100_000, "tenant": {"header": "x-tenant-id"}},
    "models": {"*": {"context_window": WINDOW, "template": {"per_message": 3, "per_request": 3}}},
    "limits": {"global": {"max_concurrency": 64, "tokens_per_minute": 50_000_000}},
}
SIM_ARGS = fixed_step_sim(MODEL, 1)
ONE_TOKEN = {"x-sim-output-tokens": "1"}
PROMPT_8K = "word " * 8000  # about 8,000 tokens: under the window, so the simulator serves it whole


@pytest.fixture(scope="module")
def stack(make_stack: Any, profile: str) -> Iterator[Stack]:
    for s in profile_stack(make_stack, profile, CONFIG, SIM_ARGS):
        yield s
        assert_nothing_leaked(s)


def refused_before_the_backend(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST `body`; it must get a 400 from the gateway and never reach the backend. Returns the error."""
    before = upstream_requests(stack)
    reply = post(stack, path, body, **ONE_TOKEN)
    assert reply.status == 400, (reply.status, reply.body[:300])
    assert upstream_requests(stack) == before
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- finding 1: truncate_prompt_tokens with n and no output bound -----------------------------------------


@pytest.mark.parametrize("n", [16, 32])
def test_truncated_prompt_with_n_reserves_what_each_sequence_may_generate(stack: Stack, n: int) -> None:
    """vLLM keeps t prompt tokens and lets each of n outputs run to window - t: the meter used to count the
    whole prompt p and reserve n x (window - p), 24x too little at n=32."""
    before = reserved(stack)
    reply = post(stack, "/v1/chat/completions", chat(PROMPT_8K, n=n, truncate_prompt_tokens=100), **ONE_TOKEN)
    assert reply.status == 200, reply.body[:300]
    got = reserved(stack) - before
    print(f"n={n}, truncate_prompt_tokens=100, 8k prompt: reserved {got:.0f}")
    assert got == 100 + n * (WINDOW - 100)


def test_completions_truncation_reserves_the_same_way(stack: Stack) -> None:
    before = reserved(stack)
    body = {"model": MODEL, "prompt": PROMPT_8K, "n": 8, "truncate_prompt_tokens": 50}
    reply = post(stack, "/v1/completions", body, **ONE_TOKEN)
    assert reply.status == 200, reply.body[:300]
    assert reserved(stack) - before == 50 + 8 * (WINDOW - 50)


def test_truncation_above_the_window_and_min_tokens_above_the_bound_are_refused(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": WINDOW + 1}
    assert refused_before_the_backend(stack, "/v1/completions", body)["param"] == "truncate_prompt_tokens"
    error = refused_before_the_backend(stack, "/v1/chat/completions", chat("hi", max_tokens=5, min_tokens=6))
    assert error["param"] == "min_tokens"


# -- finding 3: chat_template_kwargs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"documents": [{"title": "notes", "text": "fact " * 2000}]},
        {"custom_tools": [{"type": "function", "function": {"name": "f", "description": "fact " * 2000}}]},
        {"date_string": "fact " * 2000},
    ],
    ids=["documents", "custom_tools", "date_string"],
)
def test_chat_template_kwargs_text_is_counted(stack: Stack, kwargs: dict[str, Any]) -> None:
    """2,000 tokens of text in a template variable used to reserve 45 tokens."""
    before = reserved(stack)
    reply = post(
        stack, "/v1/chat/completions", chat("hi", max_tokens=1, chat_template_kwargs=kwargs), **ONE_TOKEN
    )
    assert reply.status == 200, reply.body[:300]
    assert reserved(stack) - before >= 2000 + 1


def test_a_chat_template_inside_chat_template_kwargs_is_refused(stack: Stack) -> None:
    """vLLM renders `chat_template_kwargs.chat_template` as the template itself, and refuses it without
    `--trust-request-chat-template`; the gateway refuses it first."""
    template = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"
    body = chat("x", max_tokens=5, chat_template_kwargs={"chat_template": template})
    error = refused_before_the_backend(stack, "/v1/chat/completions", body)
    assert (error["param"], error["code"]) == ("chat_template_kwargs.chat_template", "unsupported_parameter")


# -- finding 7: per-step work -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"bad_words": [f"w{i}" for i in range(20_000)]}, "bad_words"),
        ("/v1/chat/completions", {"logit_bias": {str(i): 1 for i in range(5000)}}, "logit_bias"),
        ("/v1/completions", {"stop": [f"s{i}" for i in range(1000)]}, "stop"),
        ("/v1/completions", {"logprobs": 50}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ],
    ids=["bad_words", "logit_bias", "stop", "logprobs", "top_logprobs"],
)
def test_per_step_work_past_its_bound_is_refused(
    stack: Stack, path: str, fields: dict[str, Any], param: str
) -> None:
    base = chat("hi") if path == "/v1/chat/completions" else {"model": MODEL, "prompt": "hi"}
    error = refused_before_the_backend(stack, path, {**base, "max_tokens": 1, **fields})
    assert (error["param"], error["code"]) == (param, "invalid_value")


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"echo": True, "logprobs": 20}),
        ("/v1/completions", {"prompt_logprobs": 20}),
        ("/v1/chat/completions", {"echo": True}),
    ],
    ids=["completions-echo", "prompt_logprobs", "chat-echo"],
)
def test_prompt_logprobs_on_a_long_prompt_are_refused(
    stack: Stack, path: str, fields: dict[str, Any]
) -> None:
    """Prompt logprobs are full-vocabulary logits at every prompt position; `echo` asks for them too."""
    text = "word " * 3000
    base = chat(text) if path == "/v1/chat/completions" else {"model": MODEL, "prompt": text}
    error = refused_before_the_backend(stack, path, {**base, "max_tokens": 1, **fields})
    assert error["param"] == "prompt_logprobs"


def test_per_step_work_within_its_bounds_is_served(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop": ["a", "b"], "logprobs": 5, "echo": True}
    assert post(stack, "/v1/completions", body, **ONE_TOKEN).status == 200


# -- finding 5: a tenant trains its own forecast down -----------------------------------------------------

BUDGET_WINDOW = 2048
BUDGET_CONFIG: dict[str, Any] = {
    "admission": {"tenant": {"header": "x-tenant-id"}},
    "models": {"*": {"context_window": BUDGET_WINDOW}},
    # A pool the config names gets a KV budget (an unnamed model counts against the global limit only).
    "limits": {"models": {MODEL: {"max_concurrency": 64}}},
    "kv_budget": {"enabled": True, "target_utilization": 0.9},
}
# 256 blocks of 16 tokens = 4,096 KV tokens (budget 3,686); a decode step takes 2 ms.
BUDGET_SIM_ARGS = fixed_step_sim(MODEL, 2, "--num-gpu-blocks", "256", "--max-model-len", str(BUDGET_WINDOW))
LONG_RUN = 1400  # three of these (4,230 KV tokens with their prompts) overflow the cache


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flavour", PROFILES)
def test_a_tenant_cannot_train_its_forecast_down_to_overfill_the_cache(flavour: str) -> None:
    """40 requests that stop after 1 of 1,000 allowed tokens teach mallory's learned completion ratio down to
    its floor (10 %); her next requests run to their whole allowance with `ignore_eos`. Booked at 10 % they
    would all be admitted and the engine would preempt; booked at what they declare, the third is refused."""
    local = start_stack(
        config=BUDGET_CONFIG,
        sim_args=BUDGET_SIM_ARGS,
        with_exporter=True,
        profile=flavour,
        envoy_patch=None,
    )
    stack = Stack(local)
    try:
        wait_for(
            lambda: stack.sidecar("extproc_kv_capacity_tokens", pool=MODEL) == 4096, 20, "capacity known"
        )
        mallory = {"x-tenant-id": "mallory"}
        for _ in range(40):
            reply = post(stack, "/v1/chat/completions", chat("hi", max_tokens=1000), **mallory, **ONE_TOKEN)
            assert reply.status == 200, reply.body[:300]
            # The lean profile releases a lease when Envoy's end report arrives, a few ms after the answer.
            wait_for(lambda: stack.sidecar("extproc_active_requests") == 0, 10, "training lease released")
        preempted = stack.upstream("vllm:num_preemptions_total")
        replies: list[Reply] = []
        body = chat("go on", max_tokens=LONG_RUN, ignore_eos=True)

        def long_run() -> None:
            replies.append(
                http(
                    "POST",
                    stack.url + "/v1/chat/completions",
                    body,
                    headers={**mallory, "x-sim-output-tokens": str(LONG_RUN)},
                )
            )

        threads = [threading.Thread(target=long_run) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        statuses = sorted(r.status for r in replies)
        preemptions = stack.upstream("vllm:num_preemptions_total") - preempted
        print(
            f"{flavour}: trained-down tenant's ignore_eos requests: {statuses}, preemptions {preemptions:.0f}"
        )
        assert statuses == [200, 200, 429]
        refusal = next(r for r in replies if r.status == 429)
        assert refusal.headers["x-extproc-reject-reason"] == "kv_budget"
        assert preemptions == 0
    finally:
        wait_for(lambda: stack.sidecar("extproc_active_requests") == 0, 20, "leases released")
        assert_nothing_leaked(stack)
        local.stop()
