"""A burst of streamed chats sent at once by the official `openai` SDK, as applications send them (issue 41).

Forty chats of about 1,500 prompt and 300 output tokens, each from its own SDK client with the retries it is
given (the SDK's default is 2; it honours `retry-after` up to two minutes). What a run counts: the answers,
the 429s the clients met on the way (every attempt, retried or not), each answered request's time to its
first token from its first attempt (retries and queueing included), and the wall time of the whole burst.
Used by tests/e2e/test_burst_e2e.py, tests/engine/test_burst_engine.py, bench/burst_sim.py and
bench/protection/burst.py.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx2 as httpx
import openai

from extproc.sim.textgen import generate_tokens

REQUESTS = 40
PROMPT_WORDS = 1_490
"""Single-token words: with the chat template's overhead about 1,500 prompt tokens."""
OUTPUT_TOKENS = 300
SDK_DEFAULT_RETRIES = 2
"""The `openai` SDK's default `max_retries`."""
MODEL = "llama-3-8b"


LONG_PROMPT_WORDS = 2_500
"""A burst of longer prompts (about 12 KB of text each): past `admission.inline_count_bytes` (8 KB), they are
counted on the tokenizer threads, one client's at a time, not on the event loop."""


def prompt(seed: int, words: int = PROMPT_WORDS) -> str:
    """A distinct prompt per request: identical ones would share cached prefix blocks."""
    return "".join(generate_tokens(words, f"burst-{seed}"))


@dataclass(frozen=True)
class Shape:
    """Each chat's prompt words and answer tokens."""

    prompt_words: int = PROMPT_WORDS
    output_tokens: int = OUTPUT_TOKENS


CHATS = Shape()
"""Issue 41's chats: about 1,500 prompt and 300 output tokens."""


@dataclass
class Attempt:
    at_s: float
    status: int
    reason: str
    retry_after_s: float


@dataclass
class BurstResult:
    answered: int
    refused: int
    failed: int
    wall_s: float
    ttft_s: list[float]
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def refusals(self) -> int:
        """429s the clients met, every attempt counted."""
        return sum(1 for a in self.attempts if a.status == 429)

    @property
    def ttft_p99_s(self) -> float:
        """The 99th percentile (nearest rank) of the answered requests' time to first token."""
        if not self.ttft_s:
            return math.nan
        ordered = sorted(self.ttft_s)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    def reasons(self) -> Counter[str]:
        return Counter(a.reason or str(a.status) for a in self.attempts if a.status != 200)

    def row(self, mode: str) -> str:
        return (
            f"{mode}: answered {self.answered}/{self.answered + self.refused + self.failed}, "
            f"429s {self.refusals}, TTFT p99 {self.ttft_p99_s:.1f} s, wall {self.wall_s:.1f} s"
        )


class _Burst:
    def __init__(self, url: str, retries: int, seed: int, model: str, shape: Shape) -> None:
        self.shape = shape
        self.url = url
        self.retries = retries
        self.seed = seed
        self.model = model
        self.started = 0.0
        self.lock = threading.Lock()
        self.attempts: list[Attempt] = []
        self.ttft: list[float] = []

    def _record(self, response: httpx.Response) -> None:
        headers = response.headers
        attempt = Attempt(
            at_s=round(time.monotonic() - self.started, 3),
            status=response.status_code,
            reason=headers.get("x-extproc-reject-reason", ""),
            retry_after_s=float(headers.get("retry-after-ms", "0")) / 1000,
        )
        with self.lock:
            self.attempts.append(attempt)

    def prompt(self, index: int) -> str:
        return prompt(self.seed + index, self.shape.prompt_words)

    def one(self, index: int) -> str:
        http_client = httpx.Client(event_hooks={"response": [self._record]}, timeout=600)
        with openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=self.retries, http_client=http_client
        ) as client:
            began = time.monotonic()
            first: float | None = None
            try:
                stream = client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": self.prompt(index)}],
                    max_tokens=self.shape.output_tokens,
                    stream=True,
                )
                for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.monotonic() - began
            except openai.RateLimitError:
                return "refused"
            except openai.APIError:
                return "failed"
        if first is not None:
            with self.lock:
                self.ttft.append(first)
        return "answered"

    def run(self) -> BurstResult:
        self.started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            results = list(pool.map(self.one, range(REQUESTS)))
        wall = time.monotonic() - self.started
        return BurstResult(
            answered=results.count("answered"),
            refused=results.count("refused"),
            failed=results.count("failed"),
            wall_s=wall,
            ttft_s=sorted(self.ttft),
            attempts=sorted(self.attempts, key=lambda a: a.at_s),
        )


def burst(
    url: str, retries: int = SDK_DEFAULT_RETRIES, seed: int = 0, model: str = MODEL, shape: Shape = CHATS
) -> BurstResult:
    """Send the burst to `url` (Envoy's, or the engine's own) at once and wait for every client to finish."""
    return _Burst(url, retries, seed, model, shape).run()
