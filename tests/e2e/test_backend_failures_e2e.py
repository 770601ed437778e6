"""Settlement when the backend fails: a crash mid-stream, and the restarting engine's 503 before any byte.

The simulator runs in `oom` mode with a tiny KV cache: two long streams outgrow it, the engine crashes
(both streams end with an error event), and for a moment every new request gets 503.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.ledger import Ledger, wait_settled
from tests.support.stack import Stack, fixed_step_sim, profile_stack

MODEL = "llama-3-8b"
CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 1024, "default_max_tokens": 128}},
    "limits": {"global": {"tokens_per_minute": 1_000_000}},
}
SIM_ARGS = fixed_step_sim(
    MODEL,
    5,
    "--overflow",
    "oom",
    "--num-gpu-blocks",
    "64",
    "--max-model-len",
    "1024",
    "--oom-restart-seconds",
    "3",
)
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write as much as you can."}]


@pytest.fixture(scope="module")
def stack(make_stack: Any, profile: str) -> Iterator[Stack]:
    yield from profile_stack(make_stack, profile, CONFIG, SIM_ARGS)


def test_crash_mid_stream_charges_only_what_was_streamed_and_then_503_refunds_everything(
    stack: Stack,
) -> None:
    before = Ledger.read(stack)
    received: list[int] = []
    errors: list[BaseException] = []

    def consume() -> None:
        count = 0
        try:
            with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
                stream = client.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    max_tokens=900,
                    stream=True,
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        count += 1
        except openai.APIError as exc:
            errors.append(exc)
        finally:
            received.append(count)

    # 64 blocks hold 1,024 tokens: two 900-token answers cannot both fit, and this engine cannot preempt.
    threads = [threading.Thread(target=consume) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert stack.upstream("sim_oom_events_total") == 1
    assert len(errors) == 2, "both streams should end with the engine's error event"
    assert wait_settled(stack)
    delta = Ledger.read(stack) - before
    assert stack.sidecar("extproc_settlements_total", outcome="upstream_error") == 2
    # Charged exactly what the client received before the crash, no more.
    assert delta.completion == sum(received)
    assert 0 < sum(received) < 1800
    assert delta.refunded == delta.reserved - (delta.prompt + delta.completion)

    # The engine is down for a moment: its 503 refuses the request before the engine reads it, so the whole
    # reservation is refunded (`engine_busy`, docs/architecture.md), prompt included.
    before = Ledger.read(stack)
    with (
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client,
        pytest.raises(openai.InternalServerError) as err,
    ):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100)
    assert err.value.status_code == 503
    assert wait_settled(stack)
    delta = Ledger.read(stack) - before
    assert delta.completion == 0 and delta.prompt == 0
    assert delta.refunded == delta.reserved
    assert delta.refunded >= 100
    assert stack.sidecar("extproc_settlements_total", outcome="engine_busy") == 1
    assert stack.sidecar("extproc_active_requests") == 0
    # And the engine comes back.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
            try:
                ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
                assert ok.usage is not None and ok.usage.completion_tokens == 5
                break
            except openai.InternalServerError:
                time.sleep(0.2)
    else:
        raise AssertionError("engine did not come back")
