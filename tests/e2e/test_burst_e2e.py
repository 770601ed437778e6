"""Issue 41: a burst the engine alone would serve is served through `make run`'s gateway too.

Forty streamed chats of about 1,500 prompt and 300 output tokens sent at once by the official `openai` SDK
(tests/support/burst.py) to the stack `make run` starts: config/local.yaml as shipped, the lean profile, the
simulator's 16,384-token cache (about eight of them fit), the KV-cache exporter. Straight to the simulator
all forty are answered, with preemptions; through the gateway with the config before its default queue, 8
were (every KV refusal told a flat second, the SDK's two retries spent before the first answers ended).
Now the shipped `interactive` class waits for the KV instead: all forty answered, none preempted, with the
SDK's default retries and with none. bench/burst_sim.py prints the same rows for bench/RESULTS.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.support.burst import (
    CHATS,
    LONG_PROMPT_WORDS,
    REQUESTS,
    SDK_DEFAULT_RETRIES,
    BurstResult,
    Shape,
    burst,
)
from tests.support.make_run import make_run_stack
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with make_run_stack() as started:
        yield started


def idle(stack: Stack) -> None:
    deadline = time.monotonic() + 30
    while stack.sidecar("extproc_active_requests") + stack.upstream("vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the stack never went idle"
        time.sleep(0.1)


def served(stack: Stack, retries: int, seed: int, shape: Shape = CHATS) -> BurstResult:
    idle(stack)
    preempted = stack.upstream("vllm:num_preemptions_total")
    waited = stack.sidecar("extproc_queue_wait_seconds_count", outcome="admitted")
    result = burst(stack.url, retries, seed, shape=shape)
    assert (result.answered, result.failed) == (REQUESTS, 0), (result.row("gateway"), result.reasons())
    assert stack.upstream("vllm:num_preemptions_total") == preempted
    # The cache holds about eight: the rest were answered because they waited for its KV.
    assert stack.sidecar("extproc_queue_wait_seconds_count", outcome="admitted") - waited >= REQUESTS // 2
    return result


def test_a_cold_burst_is_answered_whole_without_retries(stack: Stack) -> None:
    """The first traffic the stack sees, no pace learned: a client that never retries is answered too."""
    result = served(stack, retries=0, seed=0)
    assert result.refusals == 0


def test_the_sdk_defaults_are_answered_whole(stack: Stack) -> None:
    served(stack, retries=SDK_DEFAULT_RETRIES, seed=100)


def test_a_burst_of_long_prompts_waits_for_the_tokenizer_instead_of_being_refused(stack: Stack) -> None:
    """Prompts of about 12 KB are counted on the tokenizer threads, one client's at a time: the burst waits
    its turns there for milliseconds. (A backlog of four per client refused 7 of 40 at once with
    `tokenizer_busy`, lost to a client that does not retry.)"""
    result = served(stack, retries=0, seed=200, shape=Shape(LONG_PROMPT_WORDS, 100))
    assert result.refusals == 0, result.reasons()
