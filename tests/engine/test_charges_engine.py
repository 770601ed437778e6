"""Charged for what the engine did, whatever the client does (issue 29), on the real engine in both profiles.

Each test diffs the sidecar's counters and vLLM's own around what a client does: the completion charged
(`extproc_tokens_settled_total{kind="completion"}`) against what the engine generated
(`vllm:generation_tokens_total`, vLLM 0.32.0 v1/metrics/loggers.py, one count per sequence: `n` fans out into
child requests, v1/engine/parallel_sampling.py).

* Streams of `n` sequences the client leaves before Envoy's buffer filled: the tokens that passed, rounded up
  to whole steps of all sequences (`pace.lockstep_floor`), and the step the abort lets finish; a
  non-streamed one left: the engines' own count from the feed's generation counters (`core.engine_tally`).
* A slow reader of `n` sequences: once the engine has finished, its KV booking is released and its slot
  given back while the client still reads (`extproc_kv_engine_finished_requests`,
  `extproc_slots_released_early_total`), and its close is charged as the engine counted.
* A flood of streams left after three chunks, and one of non-streamed answers left after 0.6 to 1.5 s: the
  total charged against the engine's count.
* Cached prompt tokens (the tier's engine runs with `--enable-prompt-tokens-details`): read from the usage,
  counted as vLLM counts them (`vllm:prompt_tokens_cached_total`), charged at the configured weight.
* Separate input and output limits: a prompt over the input budget is refused by name before the engine,
  the output bucket settles to the engine's usage.

One gateway per profile serves every test (its config has all of it: the KV budget with the feed, the
weight, a tenant with split limits) and Envoy's buffers small (`small_buffers`); the module adds about 110 s
to the tier on a two-core host, most of it the slow reader and the two floods, about 12 s each per profile.
"""

from __future__ import annotations

import concurrent.futures
import math
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.engine.flood import FLOOD_CLIENTS, FLOOD_S, LONG_ANSWER, leave_after_three
from tests.engine.stacks import Ledger, engine_config, engine_host_envoy, start_gateway, warm_up
from tests.support.engine import ENGINE_TEST_TIMEOUT_S, MODEL, Engine
from tests.support.stack import Reply, Stack, http, slow_reader_post

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

WEIGHT = 0.25
"""`admission.cached_prompt_token_weight`: a cached prompt token costs a quarter of an uncached one."""
SPLIT_TENANT = "split"
INPUT_TPM, OUTPUT_TPM = 600, 300


SMALL_BUFFER = 65536
"""Envoy's flow-control watermark on the client's and the engine's connections here (2 MiB as shipped): a
slow reader's unread answer then waits in the engine, not in Envoy, at a few MB less; the n=8 stream left
after 160 events (about 40 KB) passes under it, as any does under the shipped 2 MiB."""


def charges_config() -> dict[str, Any]:
    config = engine_config(
        tenants={SPLIT_TENANT: {"input_tokens_per_minute": INPUT_TPM, "output_tokens_per_minute": OUTPUT_TPM}}
    )
    config["admission"]["cached_prompt_token_weight"] = WEIGHT
    config["kv_budget"] = {"enabled": True, "target_utilization": 0.9}
    config["admission"]["proxy_buffer_bytes"] = SMALL_BUFFER  # what Envoy here buffers (`small_buffers`)
    return config


def small_buffers(config: dict[str, Any]) -> None:
    """The tier's Envoy patch, and a small buffer on the ingress listener and the upstream cluster."""
    engine_host_envoy(config)
    resources = config["static_resources"]
    for item in (*resources["listeners"], *resources["clusters"]):
        if item["name"] in ("llm_ingress", "llm_upstream"):
            item["per_connection_buffer_limit_bytes"] = SMALL_BUFFER


@pytest.fixture(scope="module", params=["lean", "inline"])
def gateway(request: pytest.FixtureRequest, engine: Engine) -> Iterator[Stack]:
    """Both profiles with the feed (the KV budget books by forecast once it has a sample and a pace)."""
    stack = start_gateway(
        engine, charges_config(), request.param, with_exporter=True, envoy_patch=small_buffers
    )
    try:
        gateway = Stack(stack)
        warm_up(gateway)
        yield gateway
    finally:
        stack.stop()


def profile(gateway: Stack) -> str:
    return gateway.stack.profile


def counted_answers(gateway: Stack) -> float:
    """Answers not seen whole that were charged the engine's count (else an estimate)."""
    return gateway.sidecar("extproc_unfinished_answers_total", model=MODEL, basis="engine_count")


# -- n sequences left by the client ------------------------------------------------------------------------


def leave_stream(gateway: Stack, n: int, events: int) -> Ledger:
    """A completions stream of `n` sequences the client leaves after `events` events."""
    before = Ledger.read(gateway)
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        stream = c.completions.create(model=MODEL, prompt="Hi", n=n, max_tokens=LONG_ANSWER, stream=True)
        for i, _ in enumerate(stream):
            if i + 1 == events:
                break
        stream.close()
    return Ledger.read(gateway) - before


STREAM_LEFT_BOUNDS = (0.95, 1.05)
"""The charge of a stream of eight sequences left mid-way, as a share of what the engine generated: its share
of the engine's count over its time, alone on the engine here (after a feed interval idle: a CPU engine
runs one sequence faster than each of eight, and the split takes them at one pace), so all of it. By the
tokens that passed in whole steps and the step the abort lets finish, as charged before, 1.05 and 1.09 (168
of 160, 176 of 161); by a pace over the stream's time 1.56 to 2.1 on this host, 3.4 to 5.5 on another. One
sequence's tokens, an eighth, fails the floor."""
STREAM_EVENTS = 160


def ignored_the_abort(delta: Ledger) -> bool:
    """The engine ran on long after the client left at 20 steps of eight, over twice what passed: it missed
    the reset (seen once in five runs, inline, 6,697 of 8,000 generated while 315 were charged; vLLM issue
    #54947, tests/engine/test_settlement_engine.py), or saw it seconds late, past the window the count reads
    (once in 12 runs, lean, 1,110 generated where 160 passed and 183 were charged: about 4 s more), and
    nothing in front of it could tell its steps then from another replica's."""
    return delta.engine_generated >= 2 * STREAM_EVENTS


def test_a_stream_of_n_sequences_left_is_charged_what_the_engine_generated(gateway: Stack) -> None:
    """Left after 160 events, a stream of eight sequences: the engine generated every sequence as far (and
    a few steps more until the abort reached it), and the charge is its count. Where the engine ran on past
    the abort (`ignored_the_abort`, the engine's doing) the stream is left once more; if it does again, what
    the product guarantees whatever the engine does is asserted: at least what passed, at most the
    reservation and `STREAM_LEFT_BOUNDS`' ceiling of the engine's count (the steps it ran after the client
    left are not all the stream's as far as the gateway can tell)."""
    for _ in range(2):
        time.sleep(FEED_INTERVAL_S + 0.5)
        delta = leave_stream(gateway, n=8, events=STREAM_EVENTS)
        missed = ignored_the_abort(delta)
        case = "the engine missed the abort" if missed else "the engine aborted in time"
        print(f"{profile(gateway)}: n=8 stream left, {case}: {delta.completion} of {delta.engine_generated}")
        assert delta.engine_generated >= STREAM_EVENTS
        ceiling = min(8 * LONG_ANSWER, STREAM_LEFT_BOUNDS[1] * delta.engine_generated)
        assert STREAM_EVENTS <= delta.completion <= ceiling, delta
        if not missed:
            break
    if not missed:
        low, high = STREAM_LEFT_BOUNDS
        ratio = delta.completion / delta.engine_generated
        assert low <= ratio <= high, (delta.completion, delta.engine_generated)


BODY_LEFT_BOUNDS = (0.95, 1.05)
"""A non-streamed answer of four sequences left after 1.5 s, charged against the engine's count: 1.00 measured
in both profiles (241 of 241 and 234 of 234 lean, 260 of 260 inline). Nothing passed; the charge is the
engines' own count from the feed's generation counters over the request's time (`core.engine_tally`). The
pace learned from single answers, charged before, gave 1.10 to 1.29 on this host and 2.1 to 3.3 on another,
where four sequences decoded together each ran at a fraction of one alone's pace; one sequence's share, a
quarter, fails the floor."""

FEED_INTERVAL_S = 2.0
"""The tier's exporter interval (`tests/engine/stacks.py`): the body tests wait one, and a little, idle
first, so that no other request shares the interval their count starts in. Before the sidecar kept its own
requests' runs, the warm-up's 32 tokens, finished just before, were once counted as the next request's (285
of 253); with them kept, an interval shared with an answer of one sequence still splits by sequence-seconds
as if each sequence ran at one pace, where four decoded together on a CPU engine each run slower."""


def test_a_non_streamed_answer_of_n_sequences_left_is_charged_the_engines_count(gateway: Stack) -> None:
    """Nothing of a non-streamed answer passes before its end: a client gone after 1.5 s is charged what the
    engine counted for its four sequences, read from the feed once it has read the engine past the end."""
    time.sleep(FEED_INTERVAL_S + 0.5)
    before = Ledger.read(gateway)
    counted = counted_answers(gateway)
    body = {"model": MODEL, "prompt": "Hi", "n": 4, "max_tokens": LONG_ANSWER}
    with pytest.raises(OSError):  # the read timed out: the client left
        http("POST", f"{gateway.url}/v1/completions", body, timeout_s=1.5)
    delta = Ledger.read(gateway) - before
    print(f"{profile(gateway)}: n=4 body left: {delta.completion} charged of {delta.engine_generated}")
    assert counted_answers(gateway) == counted + 1
    assert delta.engine_generated >= 4
    low, high = BODY_LEFT_BOUNDS
    ratio = delta.completion / delta.engine_generated
    assert low <= ratio <= high, (delta.completion, delta.engine_generated)


# -- a slow reader of n sequences ----------------------------------------------------------------------------

SLOW_N, SLOW_TOKENS, TOP_LOGPROBS = 4, 800, 20
"""3,200 tokens with their top 20 log-probabilities, about 1.5 KB an event: some 5 MB, more than Envoy's
(small) buffers and the sockets hold, so Envoy's stream (and with it the lean profile's end report) waits
for the client while the engine has long finished. With Envoy's shipped buffers 2,400 tokens sometimes fit
whole: the stream ended with the engine, 30 KB read."""


def open_slow_stream(gateway: Stack) -> socket.socket:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "n": SLOW_N,
        "max_tokens": SLOW_TOKENS,
        "logprobs": True,
        "top_logprobs": TOP_LOGPROBS,
        "stream": True,
    }
    return slow_reader_post(gateway.stack.ports.envoy, "/v1/chat/completions", body)


def read_slowly_until(gateway: Stack, sock: socket.socket, released: bool, limit_s: float) -> dict[str, Any]:
    """Read 1 KiB every 0.1 s until the engine has finished (and, where `released`, the sidecar books
    nothing for the open lease and holds no slot for it), `limit_s` at most: what was seen, while the client
    still reads."""
    started = time.monotonic()
    read, engine_done = b"", None
    seen: dict[str, Any] = {}
    turn = 0
    while time.monotonic() - started < limit_s:
        turn += 1
        read += sock.recv(1024)
        time.sleep(0.1)
        if turn % 5 or len(read) < 4096:
            continue  # scrapes every 0.5 s (two cores run the engine as well), once the answer runs
        if engine_done is None and gateway.upstream("vllm:num_requests_running") == 0:
            engine_done = time.monotonic() - started
        finished = gateway.sidecar("extproc_kv_engine_finished_requests", pool=MODEL)
        slots = gateway.sidecar("extproc_key_active_requests", key=f"model:{MODEL}")
        if engine_done is not None and (not released or (finished == 1 and slots == 0)):
            seen = {
                "finished": finished,
                "demand": gateway.sidecar("extproc_kv_demand_tokens", pool=MODEL),
                "held": gateway.sidecar("extproc_active_requests"),
                "slots": slots,
                "early": gateway.sidecar("extproc_slots_released_early_total"),
                "engine_done_s": engine_done,
                "seen_s": time.monotonic() - started,
            }
            break
    seen["read"] = len(read)
    seen["ended"] = b"[DONE]" in read
    return seen


def test_a_slow_reader_of_n_sequences_is_released_by_the_engine_and_charged_its_count(gateway: Stack) -> None:
    """The engine decodes the whole answer while the client reads 10 KiB/s of it. The lean profile's lease
    ends with Envoy's report, at the client's close; the inline profile sees the answer only as Envoy passes
    it on, at the client's pace, its progress stalled behind Envoy's full buffers. In both, once the engine
    runs nothing the sidecar books nothing for it (`EngineCorrection._engine_finished`; the inline profile
    kept 3,467 tokens booked before stalled streams counted), and once that holds over the feed's samples its
    slot goes back (`InFlight.engine_done`) while the lease waits for its charge. The close is charged about
    what the engine generated: the answer ran to `max_tokens`, and the learned pace to the close mostly
    reaches the reservation, its cap."""
    before = Ledger.read(gateway)
    early = gateway.sidecar("extproc_slots_released_early_total")
    sock = open_slow_stream(gateway)
    try:
        seen = read_slowly_until(gateway, sock, released=True, limit_s=60)
    finally:
        sock.close()
    delta = Ledger.read(gateway) - before
    print(f"{profile(gateway)}: slow reader {seen}: {delta.completion} charged of {delta.engine_generated}")
    assert not seen["ended"] and seen["read"] < 400_000, seen  # the client was still reading
    assert seen.get("held") == 1, seen  # its lease still open, its tokens not settled
    assert seen["finished"] == 1 and seen["demand"] == 0, seen
    assert seen["slots"] == 0 and seen["early"] == early + 1, seen  # its slot given back before the close
    assert delta.engine_generated == SLOW_N * SLOW_TOKENS
    # 0.94 to 1.0 measured (the 23,208 of 48,000 before the n sequences were counted).
    assert 0.85 * delta.engine_generated <= delta.completion <= SLOW_N * SLOW_TOKENS, delta


# -- a flood of streams left after three chunks ----------------------------------------------------------

FLOOD_BOUNDS = (0.6, 1.4)
"""The flood's total charge against the engine's count, as charged now: 7 of 12 runs within issue 29's 5 %
(lean 0.992, 1.001, 1.009; inline 0.997, 1.003, 1.003, 1.046), the rest with the host saturated (inline
0.926, 0.805, 0.645; lean 0.646 and 1.33, each with an answer the engine decoded whole after its client
left); 117 to 369 streams a run. Each stream is charged its share of the engine's count over its time, at
least the tokens that certainly passed, what that lifts taken off later shares (`EngineTally.charge`); the
runs ended within `engine_tally.SHOWN_AFTER_STOP_S` (5 s) are taken for still running where the feed's
running count has room for them. The engine runs on past what passed until the abort reaches it, 0.2 to 9
tokens a stream here, which nothing in front of it sees: charged what passed and one step more, as before,
the flood gave 0.58 to 1.23. On these two saturated cores the split errs more: it takes every running
sequence at one pace (one in its prefill generates nothing), and tokens of sequences the engine runs
beyond the allowance (vLLM's API server noticing clients gone late: it counts a request's tokens until its
abort, vllm 0.32.0 vllm/v1/engine/output_processor.py `abort_requests`) are taken for another replica's.
The 1.33 was likely Envoy reading that upstream on in the lean profile while its run stopped at the
proxy's end (since ended at its last upstream byte, `InFlight._upstream_until`). With four CPU hogs beside
the tier, clients fell so far behind that streams passed more than the proxy's buffer (`SMALL_BUFFER`)
before they left; charged by the pace rules then, a lean flood with two of them came to 1.07. Such streams
are counted too now (`InFlight._left_mid_answer`): since then 1.033 lean (its first run, with an answer
decoded whole, 0.79), inline 0.999, 0.995 and once 0.82 (180 streams, not diagnosed). A flood out of
bounds, or one where the engine decoded a whole answer (`long_answers`), is run again once; out of bounds
twice in a row with every abort in time fails; a second flood with an abort missed is held to what the
product guarantees whatever the engine does (see the test)."""


def within(delta: Ledger, bounds: tuple[float, float]) -> bool:
    low, high = bounds
    return low <= delta.completion / delta.engine_generated <= high


def long_answers(gateway: Stack) -> float:
    """Requests the engine finished after more than 100 tokens (one that missed its abort decodes to its
    end): its per-request histogram (`vllm:request_generation_tokens`, 1-2-5 buckets up to the model's
    length, finished requests only; vllm 0.32.0 vllm/v1/metrics/loggers.py)."""
    total = gateway.upstream("vllm:request_generation_tokens_count")
    assert total > 0, "the engine's per-request generation histogram is missing"
    return total - gateway.upstream("vllm:request_generation_tokens_bucket", le="100.0")


@dataclass
class Flood:
    answered: int
    passed: int
    """Tokens the clients read, at least (chunks with text)."""
    reset: int
    """Requests whose connection the engine closed before answering (`Leaves.reset`)."""
    by_count: float
    """Streams charged the engine's count (`counted_answers`)."""
    missed: float
    """Streams the engine ran past 100 tokens: it missed their abort (`long_answers`)."""
    ran_on: float
    """Of the completion charged, the tokens charged as steps the engine ran past the counts
    (`extproc_tokens_run_on_total`, core/engine/runon.py)."""
    delta: Ledger

    @property
    def ratio(self) -> float:
        return self.delta.completion / self.delta.engine_generated

    def __str__(self) -> str:
        case = f"{self.missed:.0f} aborts missed by the engine" if self.missed else "every abort in time"
        return (
            f"flood of {self.answered} ({self.by_count:.0f} counted, {case}): {self.delta.completion} "
            f"charged ({self.ran_on:.0f} as run-ons) of {self.delta.engine_generated} generated "
            f"({self.ratio:.3f}), {self.passed} passed, {self.reset} reset by the engine"
        )


def flood_of_streams_left(gateway: Stack) -> Flood:
    """Four clients leaving streams after three chunks for `FLOOD_S`."""
    before = Ledger.read(gateway)
    counted, long_before = counted_answers(gateway), long_answers(gateway)
    ran_on = gateway.sidecar("extproc_tokens_run_on_total")
    deadline = time.monotonic() + FLOOD_S
    with concurrent.futures.ThreadPoolExecutor(FLOOD_CLIENTS) as pool:
        runs = list(pool.map(lambda _: leave_after_three(gateway.url, deadline), range(FLOOD_CLIENTS)))
    delta = Ledger.read(gateway) - before
    return Flood(
        answered=sum(run.answered for run in runs),
        passed=sum(run.passed for run in runs),
        reset=sum(run.reset for run in runs),
        by_count=counted_answers(gateway) - counted,
        missed=long_answers(gateway) - long_before,
        ran_on=gateway.sidecar("extproc_tokens_run_on_total") - ran_on,
        delta=delta,
    )


def test_a_flood_of_streams_left_early_is_charged_what_the_engine_generated(gateway: Stack) -> None:
    """Each stream charged its share of the engine's count over its own time: the engine ran on past what
    passed until the abort reached it, which nothing in front of it sees.

    Whatever the engine does, the flood is charged at least what passed to its clients and at most their
    reservations and `FLOOD_BOUNDS`' ceiling of the engine's count, and within `FLOOD_BOUNDS` of its count;
    a flood out of bounds, or with a request the engine's connection dropped (`Leaves.reset`), is run again
    once (the host's saturation, see there), twice in a row fails. Where
    the engine missed an abort (vLLM issue #54947: an answer decoded on after its client left,
    `long_answers`), the steps it ran past the counts are charged to the streams that stopped as run-ons
    (core/engine/runon.py): such a flood is held to the same bounds."""
    for _ in (1, 2):
        time.sleep(FEED_INTERVAL_S + 0.5)
        flood = flood_of_streams_left(gateway)
        print(f"{profile(gateway)}: {flood}")
        delta = flood.delta
        assert flood.answered >= FLOOD_CLIENTS, flood
        assert flood.passed >= flood.answered, flood  # each read a token or more
        assert flood.passed <= delta.completion <= flood.answered * LONG_ANSWER, flood
        assert delta.completion <= FLOOD_BOUNDS[1] * delta.engine_generated, flood
        if within(delta, FLOOD_BOUNDS) and not flood.reset:
            return
    raise AssertionError(f"run again, the flood is out of {FLOOD_BOUNDS} or reset: {flood}")


BODY_FLOOD_BOUNDS = (0.95, 1.05)
"""The total charge of a flood of non-streamed answers left after 0.6 to 1.5 s, against the engine's count:
1.006 lean (3,691 of 3,668) and 1.007 inline (3,435 of 3,410), 52 answers each, each share then rounded up
(half a token a request of the excess; now to the nearest token). Each is charged its share of
the engine's count by the sequence-seconds it and the others ran, the others as this sidecar saw them
(`EngineTally.begin` / `end`); by the feed's running counts alone the same flood gave 1.11 and 1.26: a
closed loop of clients, each next request coming as the last leaves, hides inside a 2 s interval."""


BODY_ANSWER = 1600
"""The non-streamed answers' `max_tokens` (two sequences each; the tier's model never stops before it,
tests/engine/build_model.py): 1,600 steps, far more than a host runs in the longest wait (1.5 s) here (7 ms a
step for two sequences on the loaded CI host; at 1,000 an answer once came back, 200, before its client
left on a fresh clone's host), while four still fit the KV budget at once (12,800 tokens of its 14,745).
An answer served whole all the same is charged its usage, counted in the comparison like the rest."""


def leave_bodies(url: str, deadline: float, wait_s: float) -> tuple[int, int]:
    """Non-streamed answers of two sequences, each left after `wait_s`, one after another until `deadline`:
    how many were left, and how many answered before their client left."""
    left = answered = 0
    body = {"model": MODEL, "prompt": "Hi", "n": 2, "max_tokens": BODY_ANSWER}
    while time.monotonic() < deadline:
        try:
            reply = http("POST", f"{url}/v1/completions", body, timeout_s=wait_s)
        except OSError:
            left += 1
            continue
        if reply.status == 200:  # the host ran the answer faster than the client waited: charged its usage
            answered += 1
            continue
        assert reply.status == 429, reply.body  # nothing else answers before the client leaves
        time.sleep(0.5)
    return left, answered


def test_a_flood_of_non_streamed_answers_left_is_charged_the_engines_count(gateway: Stack) -> None:
    """Four clients leaving answers nobody saw, overlapping: each charged its share of the engine's count
    over its own time, by the sequences running beside it.

    Within `BODY_FLOOD_BOUNDS` where every answer was charged the engine's count and the engine honoured
    every abort. Two things outside the gateway's reach change that, and then the flood is run again once:
    the feed's readings coming too late for a count (the host saturated: an answer is charged its pace
    estimate, CI once charged 17 of 29 so and the flood 1.17), and the engine decoding an answer on after
    its client left (vLLM #54947: its late steps may be nobody's, CI once 0.946). Twice in a row, what holds
    whatever happens is asserted: at most the reservations (an estimate on the saturated host charged 1.57x
    the engine's count once, 15 of 34 answers charged so)."""
    for attempt in (1, 2):
        time.sleep(FEED_INTERVAL_S + 0.5)
        before = Ledger.read(gateway)
        counted, long_before = counted_answers(gateway), long_answers(gateway)
        deadline = time.monotonic() + FLOOD_S
        waits = (0.6, 0.9, 1.2, 1.5)
        with concurrent.futures.ThreadPoolExecutor(len(waits)) as pool:
            runs = list(pool.map(leave_bodies, [gateway.url] * len(waits), [deadline] * len(waits), waits))
        left, answered = sum(r[0] for r in runs), sum(r[1] for r in runs)
        delta = Ledger.read(gateway) - before
        by_count, missed = counted_answers(gateway) - counted, long_answers(gateway) - long_before
        report = (
            f"{profile(gateway)}: {left} bodies left ({by_count:.0f} counted, {missed:.0f} aborts missed), "
            f"{answered} answered: {delta.completion} of {delta.engine_generated}"
        )
        print(report)
        assert left >= len(waits), report
        assert delta.completion <= delta.reserved, report  # what holds whatever happens: the reservations
        disturbed = by_count < left or missed > 0
        if not disturbed:
            assert within(delta, BODY_FLOOD_BOUNDS), report
            return
        if attempt == 2:
            return  # the host's or the engine's doing, twice: what holds either way is asserted above


# -- cached prompt tokens ----------------------------------------------------------------------------------

SYSTEM = "You answer questions about KV caches, briefly and exactly. " * 60
"""About 660 tokens: five of the engine's 128-token blocks shared by two requests."""


def chat_with_system(gateway: Stack, question: str) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 6,
    }
    reply = http("POST", f"{gateway.url}/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    usage: dict[str, Any] = reply.json()["usage"]
    return usage


def test_cached_prompt_tokens_are_read_counted_and_discounted(gateway: Stack) -> None:
    chat_with_system(gateway, f"What is a block? ({profile(gateway)})")
    before = Ledger.read(gateway)
    cached_before = gateway.sidecar("extproc_tokens_cached_prompt_total", model=MODEL)
    engine_cached_before = gateway.upstream("vllm:prompt_tokens_cached_total")
    usage = chat_with_system(gateway, "And what is eviction?")
    delta = Ledger.read(gateway) - before
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 512, usage  # the system prompt's whole blocks
    assert gateway.sidecar("extproc_tokens_cached_prompt_total", model=MODEL) - cached_before == cached
    assert gateway.upstream("vllm:prompt_tokens_cached_total") - engine_cached_before == cached
    charged_prompt = usage["prompt_tokens"] - math.floor(cached * (1 - WEIGHT))
    assert (delta.prompt, delta.completion) == (charged_prompt, usage["completion_tokens"])
    assert delta.charged == charged_prompt + usage["completion_tokens"]
    assert (delta.engine_prompt, delta.engine_generated) == (usage["prompt_tokens"], 6)


# -- separate input and output limits --------------------------------------------------------------------


def split_chat(gateway: Stack, content: str, max_tokens: int) -> Reply:
    """A chat of the split tenant; the prompt opens with the profile's name, so it shares no cached block
    with the other profile's run on the same engine (a hit would discount the input bucket's charge)."""
    content = f"{profile(gateway)}: {content}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return http("POST", f"{gateway.url}/v1/chat/completions", body, {"x-tenant": SPLIT_TENANT})


def test_split_limits_refuse_by_name_and_settle_the_output_to_the_engines_usage(gateway: Stack) -> None:
    before = Ledger.read(gateway)
    answered = split_chat(gateway, "tokens " * 350, max_tokens=100)
    assert answered.status == 200, answered.body
    usage = answered.json()["usage"]
    assert 300 < usage["prompt_tokens"] < INPUT_TPM and usage["completion_tokens"] == 100
    delta = Ledger.read(gateway) - before
    assert (delta.engine_prompt, delta.engine_generated) == (usage["prompt_tokens"], 100)
    # The output bucket holds 300 a minute (5 a second): the 100 generated are gone from it, give or take
    # what refilled since.
    output_left = gateway.sidecar("extproc_tokens_available", key=f"output:tenant:{SPLIT_TENANT}")
    assert OUTPUT_TPM - 100 <= output_left <= OUTPUT_TPM - 100 + 30, output_left
    before = Ledger.read(gateway)
    refused = split_chat(gateway, "tokens " * 350, max_tokens=5)  # the input bucket has < 300 left
    assert refused.status == 429, refused.body
    assert refused.headers["x-extproc-reject-reason"] == "input_tokens"
    assert float(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "tokens" and error["code"] == "rate_limit_exceeded", error
    assert "input tokens per min" in error["message"], error
    too_large = split_chat(gateway, "tokens " * (INPUT_TPM + 10), max_tokens=5)
    assert too_large.status == 429
    assert too_large.headers["x-extproc-reject-reason"] == "request_exceeds_token_limit"
    assert too_large.headers["x-should-retry"] == "false"
    delta = Ledger.read(gateway) - before
    assert (delta.engine_prompt, delta.charged) == (0, 0)  # neither reached the engine nor cost anything
