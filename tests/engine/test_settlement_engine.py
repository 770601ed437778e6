"""Settlement against the real engine, in both profiles: what the sidecar charges equals vLLM's usage.

Each test diffs the sidecar's counters and the engine's own (`vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, vLLM 0.32.0 v1/metrics/loggers.py) around one call, so a token charged,
refunded or lost anywhere moves a number. The model has random weights and never stops on its own
(build_model.never_stops_unbidden), so an answer runs to `max_tokens` unless the test forces the end-of-turn
token with `logit_bias`.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from extproc.admission.vocabulary.tokens import DEFAULT_ENCODING, count_text
from extproc.envoyconf.upstream import UPSTREAM_CLUSTER
from tests.engine.stacks import Ledger, assert_settled_as_engine
from tests.support.engine import ENGINE_TEST_TIMEOUT_S, MODEL
from tests.support.stack import Stack, http

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

EOT_ID = 100263
"""`<|eot_id|>` in the tiny model's vocabulary (tests/engine/build_model.py): the model's stop token."""
DISCONNECT_MAX_TOKENS = 4000
ABORT_STEPS = 32
"""Decode steps (one token each here) the engine may run after a client leaves, before the abort reaches it
through Envoy and vLLM's API server: measured 12 and 18 on this two-core host (docs/simulator.md,
calibration), where the CPU engine also freezes the host for seconds (bench/RESULTS.md section 5)."""
RAN_ON_TOKENS = 1000
"""More than this generated for a client that read five chunks: the engine missed the abort (a timely one
stops within `ABORT_STEPS`; a late one on this host, within the 1.5 s a count waits, a few hundred)."""
RUN_ON_SHARE = 0.97
"""What of an answer decoded on after its client left is charged at least where the proxy read it on: this
module's stacks have no KV feed, so the charge is what passed Envoy (lean: its Lua reader's count; inline:
the sidecar's count of what it processed, or its pace estimate). A clean-clone run charged 3,719 of 3,759;
another, inline, 3,419 of 4,000 (not diagnosed): a miss is run once more."""
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Summarise the plot of a long novel in a few words, 9901 of them."},
]


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_chat_settles_usage_and_admission_counted_the_prompt(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24)
    assert result.usage is not None
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, result.usage.prompt_tokens, 24)
    # With Llama-3's template costs the booking at admission is the engine's prompt, exactly.
    assert delta.reserved == result.usage.prompt_tokens + 24


def test_chat_stream_with_usage(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 20
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, usage.prompt_tokens, usage.completion_tokens)


def test_chat_stream_without_usage_settles_what_the_engine_generated(
    stack: Stack, client: openai.OpenAI
) -> None:
    before = Ledger.read(stack)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=18,
        stream=True,
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, int(delta.engine_prompt), 18)


def test_n_choices_settle_every_sequence(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, n=3)
    assert result.usage is not None and len(result.choices) == 3
    delta = Ledger.read(stack) - before
    assert result.usage.completion_tokens == 30
    assert (delta.prompt, delta.completion) == (result.usage.prompt_tokens, 30)
    assert delta.charged == result.usage.prompt_tokens + 30
    # vLLM's usage counts the prompt once, but its counter once per sequence (each of the n is a child
    # request with the whole prompt, v1/engine/parallel_sampling.py).
    assert (delta.engine_prompt, delta.engine_generated) == (3 * result.usage.prompt_tokens, 30)


def test_n_choices_streamed(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = list(stream)[-1].usage
    assert usage is not None and usage.completion_tokens == 16
    delta = Ledger.read(stack) - before
    assert (delta.prompt, delta.completion) == (usage.prompt_tokens, 16)
    assert delta.charged == usage.prompt_tokens + 16
    assert (delta.engine_prompt, delta.engine_generated) == (2 * usage.prompt_tokens, 16)


def test_early_stop_refunds_the_unused_output(stack: Stack, client: openai.OpenAI) -> None:
    """The end-of-turn token forced first: the engine stops after one token of the 200 reserved."""
    before = Ledger.read(stack)
    result = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        logit_bias={str(EOT_ID): 100},
    )
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, result.usage.prompt_tokens, result.usage.completion_tokens)
    assert result.usage.completion_tokens == 1
    assert delta.refunded == 199


def test_early_stop_streamed(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        logit_bias={str(EOT_ID): 100},
        stream=True,
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, int(delta.engine_prompt), 1)


def test_completions_count_the_bos_token(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    result = client.completions.create(model=MODEL, prompt=["Once upon a time", "In a galaxy"], max_tokens=9)
    assert result.usage is not None
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, result.usage.prompt_tokens, 18)
    # The tokenizer adds <|begin_of_text|> to each prompt: admission books it (`template.bos`).
    assert delta.reserved == result.usage.prompt_tokens + 18


def test_completions_stream(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    stream = client.completions.create(
        model=MODEL,
        prompt="A streamed prompt",
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = list(stream)[-1].usage
    assert usage is not None
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, usage.prompt_tokens, 12)


def test_responses_api(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    result = client.responses.create(model=MODEL, input="Say something about rivers.", max_output_tokens=16)
    assert result.usage is not None
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, result.usage.input_tokens, result.usage.output_tokens)


def test_responses_api_streamed(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    events = list(
        client.responses.create(
            model=MODEL, input="Say something about lakes.", max_output_tokens=12, stream=True
        )
    )
    done = [e for e in events if e.type == "response.completed"]
    assert done and done[0].response.usage is not None
    usage = done[0].response.usage
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, usage.input_tokens, usage.output_tokens)


def anthropic_client(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=120)


def test_messages_api(stack: Stack) -> None:
    before = Ledger.read(stack)
    with anthropic_client(stack) as c:
        result = c.messages.create(
            model=MODEL, max_tokens=14, messages=[{"role": "user", "content": "Name a colour."}]
        )
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, result.usage.input_tokens, result.usage.output_tokens)


def test_messages_api_streamed(stack: Stack) -> None:
    before = Ledger.read(stack)
    with (
        anthropic_client(stack) as c,
        c.messages.stream(
            model=MODEL, max_tokens=11, messages=[{"role": "user", "content": "A fruit?"}]
        ) as s,
    ):
        final = s.get_final_message()
    delta = Ledger.read(stack) - before
    assert final.usage.output_tokens == 11
    assert_settled_as_engine(delta, int(delta.engine_prompt), 11)


@dataclass(frozen=True)
class Left:
    """A stream the client left: the ledgers' difference, the generated texts the client received, and the
    bytes Envoy read from the engine meanwhile."""

    delta: Ledger
    texts: list[str]
    read_bytes: float = 0.0

    @property
    def read_on(self) -> bool:
        """Whether Envoy read the engine's run-on (`EVENT_BYTES` a token it generated): what the inline
        sidecar can count of it. In a clean-clone run Envoy read 6 of 4,000 such tokens, and the sidecar,
        without a feed, charged those 6; in the try before it, Envoy read on and 1,185 of 1,186 were
        charged."""
        return self.read_bytes >= EVENT_BYTES * RUN_ON_SHARE * self.delta.engine_generated

    def floor(self, profile: str) -> int:
        """What reached the client, counted as the profile counts a stream that reports no usage: the lean
        profile's Lua reader one token per event with text, the inline profile's tracker the text's tokens
        (extproc/admission/tracking/usage_tracker.py). vLLM streams a token that ends inside a UTF-8
        character as an event with empty text (chat_completion/serving.py, vLLM 0.32.0), so either can be
        below the events read."""
        if profile == "lean":
            return sum(1 for t in self.texts if t)
        return sum(count_text(t, DEFAULT_ENCODING) for t in self.texts if t)


EVENT_BYTES = 100
"""Fewer bytes than any streamed chat chunk vLLM sends for one token (its `data: {"id": ..., "object":
"chat.completion.chunk", "created": ..., "model": ..., "choices": [...]}` line: Envoy read ~280 bytes an
event of a stream left after five here)."""


def envoy_read_bytes(stack: Stack) -> float:
    """Envoy's count of the bytes it read from the engine's cluster (`upstream_cx_rx_bytes_total`)."""
    pattern = urllib.parse.quote(rf"^cluster\.{UPSTREAM_CLUSTER}\.upstream_cx_rx_bytes_total$")
    url = f"http://127.0.0.1:{stack.stack.ports.envoy_admin}/stats?filter={pattern}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(":", 1)[1]) for line in text.splitlines() if ":" in line)


def leave_after_five_chunks(stack: Stack) -> Left:
    """A 4,000-token streamed answer the client leaves after five chunks past the role's."""
    before, read_before = Ledger.read(stack), envoy_read_bytes(stack)
    texts: list[str] = []
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        stream = c.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=DISCONNECT_MAX_TOKENS,
            stream=True,
        )
        for i, chunk in enumerate(stream):
            texts.extend(choice.delta.content or "" for choice in chunk.choices if not choice.delta.role)
            if i == 5:
                break
        stream.close()
    delta = Ledger.read(stack) - before
    return Left(delta, texts, envoy_read_bytes(stack) - read_before)


def test_client_disconnect_charges_what_the_engine_generated(stack: Stack) -> None:
    """The client leaves after a few chunks of a 4,000-token answer: the engine aborts the request a few
    steps later, and the sidecar charges what passed the proxy: at least what reached the client, at most
    a few steps past what the engine's own counter says it generated. Where the engine missed the abort and
    decoded on, and Envoy read it on, that too (`RUN_ON_SHARE`; with a feed, run-ons are charged from the
    engine's counter: `core/engine/runon.py`, tests/e2e/test_run_on_e2e.py)."""
    left = leave_after_five_chunks(stack)
    if ignored_the_reset(left.delta):
        # vLLM missed the reset once in a clean-clone run (Envoy logged the client gone after 67 ms and 21
        # tokens; the engine decoded all 4,000 over 12 s; vLLM issue #54947 reports the same of v0.22). Left
        # once more for a measurement with the abort honoured; a second miss is the engine's again, and its
        # run-on is what is asserted of it. Both profiles: an inline run charged a run-on 3,419 of 4,000 in a
        # clean-clone CI run (0.85), not reproduced on demand.
        print(f"{stack.stack.profile}: the engine missed the reset: {left.delta}")
        left = leave_after_five_chunks(stack)
    delta = left.delta
    missed = ignored_the_reset(delta)
    seen = "the engine missed the reset" if missed else "the engine aborted in time"
    read = f"Envoy read {left.read_bytes:.0f} B of the engine"
    print(f"{stack.stack.profile}: left after five chunks ({seen}): {delta}, {read}")
    assert 5 <= delta.engine_generated <= DISCONNECT_MAX_TOKENS
    assert delta.prompt == delta.engine_prompt
    assert delta.charged == delta.prompt + delta.completion
    # At least what reached the client; at most a few steps over the engine's count: a stream left under
    # Envoy's buffer is charged what passed and the step the abort lets finish (InFlight._unheld).
    assert len(left.texts) == 5
    assert left.floor(stack.stack.profile) <= delta.completion <= delta.engine_generated + ABORT_STEPS
    if missed:
        # What Envoy read on of the steps the engine ran after the client left; where it did not read them,
        # nothing here counts them (these stacks have no feed).
        assert not left.read_on or delta.completion >= RUN_ON_SHARE * delta.engine_generated
    elif stack.stack.profile == "lean":
        # Envoy's Lua reader counts every chunk that reached Envoy: all but the steps the engine ran after
        # the close, before its abort landed.
        assert delta.completion >= delta.engine_generated - ABORT_STEPS
    # The inline profile counts the chunks the sidecar processed; chunks Envoy held for it when the client
    # left are never counted, so it charges less than the engine generated (measured: 521 of 662 on two
    # loaded cores; docs/simulator.md, calibration).


def ignored_the_reset(delta: Ledger) -> bool:
    """The engine decoded on far past a timely abort (`RAN_ON_TOKENS`): it never saw one, or saw it late. A
    random-weights model may still end its answer early: 3,759 of 4,000 in a clean-clone run."""
    return delta.engine_generated > RAN_ON_TOKENS


def test_upstream_error_charges_the_prompt_only(stack: Stack) -> None:
    """vLLM refuses `top_p` outside (0, 1] with a 400 after admission (SamplingParams._verify_args,
    sampling_params.py, vLLM 0.32.0); the gateway does not check it. The engine ran nothing; the sidecar
    keeps the prompt (its rule for any upstream error, extproc/admission/capacity/charging.py: it cannot
    tell a refusal from a failure mid-prefill) and refunds the whole output reservation. (`logprobs` past
    vLLM's `max_logprobs` is refused by the gateway itself: admission.per_step.logprobs.)"""
    before = Ledger.read(stack)
    body: dict[str, Any] = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "top_p": 5}
    reply = http("POST", f"{stack.url}/v1/completions", body)
    assert reply.status == 400, reply.body
    assert "error" in reply.json() or "message" in reply.json()
    delta = Ledger.read(stack) - before
    assert delta.reserved == delta.prompt + 5
    assert (delta.charged, delta.completion) == (delta.prompt, 0)
    assert (delta.engine_prompt, delta.engine_generated) == (0, 0)
    assert stack.sidecar("extproc_active_requests") == 0


def _usage_prompt(api: str, body: dict[str, Any]) -> int:
    usage = body["usage"]
    return int(usage["prompt_tokens"] if api in ("chat", "completions") else usage["input_tokens"])


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12345 * 678?"},
    {"role": "assistant", "content": "8,369,910."},
    {"role": "user", "content": "  And the same   with  spaces?\n\n"},
]
COUNT_CASES: dict[str, tuple[str, str, dict[str, Any], int]] = {
    "chat, one message": ("chat", "/v1/chat/completions", {"messages": MESSAGES[1:]}, 0),
    # Llama-3's template trims each message (`| trim`): the whitespace around the last one is counted by
    # the sidecar, not by the engine (one token over, the safe side).
    "chat, conversation": ("chat", "/v1/chat/completions", {"messages": CONVERSATION}, 1),
    "completions": ("completions", "/v1/completions", {"prompt": "Once upon a time, 1999 bears"}, 0),
    # vLLM tokenizes a chat request's template with the tokenizer's BOS too when asked, and a Responses
    # request's always (responses/protocol.py:460): `template.bos` is counted on top (prompt.py).
    "chat, add_special_tokens": (
        "chat",
        "/v1/chat/completions",
        {"messages": MESSAGES[1:], "add_special_tokens": True},
        0,
    ),
    "responses, messages": ("responses", "/v1/responses", {"input": CONVERSATION[1:2]}, 0),
    "responses, string": ("responses", "/v1/responses", {"input": "Say something about rivers."}, 0),
    "messages": ("messages", "/v1/messages", {"system": "Be brief.", "messages": CONVERSATION[1:2]}, 0),
}
"""(API, path, body, admission count minus vLLM's) for each way of sending a prompt."""


@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_prompt_count_at_admission_matches_vllm(stack: Stack, case: str) -> None:
    """The prompt the sidecar books at admission against vLLM's `prompt_tokens`, with Llama-3's template
    costs (tests/engine/stacks.py LLAMA3_TEMPLATE, shipped in config/local.yaml)."""
    api, path, extra, offset = COUNT_CASES[case]
    out_key = {"chat": "max_tokens", "completions": "max_tokens", "responses": "max_output_tokens"}
    body = {"model": MODEL, out_key.get(api, "max_tokens"): 4, **extra}
    before = Ledger.read(stack)
    reply = http("POST", f"{stack.url}{path}", body)
    assert reply.status == 200, reply.body
    delta = Ledger.read(stack) - before
    admitted_prompt = delta.reserved - 4
    assert admitted_prompt - _usage_prompt(api, reply.json()) == offset
