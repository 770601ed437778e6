"""The shared-prefix overload, for the real-engine tier (tests/engine/test_prefix_engine.py) and the benchmark
(bench/protection/prefix.py): forty streamed chats at once that share one long system prompt, each with a
short question of its own, `ignore_eos` so every answer runs its whole `max_tokens`, clients that honour
`retry-after`. What a run measures comes from the engine's own counters (`vllm:*`, the simulator exports the
same names), its KV gauge and the sidecar's booking sampled every 0.2 s, and each stream's first token.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.support.stack import metric

REQUESTS = 40
SYSTEM_WORDS = 1550
OWN_WORDS = 30
OUTPUT_TOKENS = 300
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit", "falcon", "ember")
"""Words cl100k encodes as one token each with their leading space, but " falcon" (two): the system prompt's
1,550 words are 1,666 tokens for the sidecar, the simulator and the engine tier's model (it uses cl100k)."""


def words(seed: int, count: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(count))


SYSTEM = words(7, SYSTEM_WORDS)


def chat_body(model: str, index: int, output_tokens: int = OUTPUT_TOKENS) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"question {index}: " + words(1000 + index, OWN_WORDS)},
        ],
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "stream": True,
    }


@dataclass
class Answer:
    status: int
    refusals: int
    ttft: float | None  # seconds from the first attempt to the first streamed byte of the served one
    resets: int = 0  # 503s of a connection reset, tried again as the `openai` SDK does
    decoding: tuple[float, float] | None = None  # monotonic times of the served stream's first event and end


def stream_once(url: str, body: dict[str, Any]) -> tuple[int, float | None, dict[str, str]]:
    """POST a streamed chat: (status, seconds to the first data event, the headers)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=300)
    started = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        first: float | None = None
        for line in resp:
            if first is None and line.startswith(b"data:"):
                first = time.monotonic() - started
        return resp.status, first, headers
    finally:
        conn.close()


RESETS_RETRIED = 2
"""A 503 that no gateway decided (no `x-extproc-reject-reason`: the proxy's connection to the engine reset) is
tried again, at most this many times half a second apart, as the `openai` SDK retries a 5xx. On the engine
tier's two-core host the CPU engine freezes the host for seconds, timers fire late, and once a request met a
connection the engine had just closed (503 UC upstream_reset_before_response_started); the shipped configs
already close idle engine connections first and retry a reset before the request was sent."""


def call(url: str, body: dict[str, Any], deadline: float) -> Answer:
    """One chat, retried after each 429's `retry-after-ms` until served, and after a reset."""
    refusals = resets = 0
    started = time.monotonic()
    while True:
        attempt = time.monotonic()
        status, first, headers = stream_once(url, body)
        if status == 503 and "x-extproc-reject-reason" not in headers and resets < RESETS_RETRIED:
            resets += 1
            time.sleep(0.5)
            continue
        if status != 429 or time.monotonic() > deadline:
            if first is None:
                return Answer(status, refusals, None, resets)
            decoding = (attempt + first, time.monotonic())
            return Answer(status, refusals, attempt - started + first, resets, decoding)
        refusals += 1
        time.sleep(min(float(headers.get("retry-after-ms", "1000")) / 1000, 10.0))


@dataclass
class Sampler:
    """Every 0.2 s while a load runs: the engine's KV usage and, behind a gateway, the sidecar's booking, each
    read by its own thread, so an engine whose API server stalls while it decodes (seconds on a two-core host)
    does not thin the booking's samples too."""

    engine_url: str
    admin_url: str | None = None
    kv: list[float] = field(default_factory=list)
    booked: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        sources = [(f"{self.engine_url}/metrics", "vllm:kv_cache_usage_perc", self.kv)]
        if self.admin_url is not None:
            sources.append((f"{self.admin_url}/metrics", "extproc_kv_booked_tokens", self.booked))
        self._threads = [threading.Thread(target=self._run, args=source, daemon=True) for source in sources]

    def _run(self, url: str, name: str, into: list[float]) -> None:
        while not self._stop.wait(0.2):
            try:
                into.append(metric(url, name))
            except OSError:
                continue

    def __enter__(self) -> Sampler:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


@dataclass
class Run:
    """One load's figures: the answers, and the engine's counters around it."""

    answers: list[Answer]
    seconds: float
    generated: float
    preemptions: float
    hit_rate: float
    kv: list[float]
    booked: list[float]
    capacity_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds

    @property
    def kv_peak(self) -> float:
        return max(self.kv, default=0.0)

    @property
    def streams_peak(self) -> int:
        """The most served streams decoding at once (between their first event and their end), timed by the
        clients: a measure of how much the engine was let hold that no sampled gauge can miss."""
        edges = sorted(
            edge for a in self.answers if a.decoding for edge in ((a.decoding[0], 1), (a.decoding[1], -1))
        )
        running = peak = 0
        for _, step in edges:
            running += step
            peak = max(peak, running)
        return peak

    @property
    def kv_mean(self) -> float:
        return sum(self.kv) / len(self.kv) if self.kv else 0.0

    @property
    def statuses(self) -> list[int]:
        return [a.status for a in self.answers]

    @property
    def refusals(self) -> int:
        return sum(a.refusals for a in self.answers)

    def ttft(self, q: float) -> float:
        values = sorted(a.ttft for a in self.answers if a.ttft is not None)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    def figures(self) -> dict[str, Any]:
        booked = max(self.booked, default=0.0) / self.capacity_tokens
        return {
            "served": self.statuses.count(200),
            "requests": len(self.answers),
            "seconds": round(self.seconds, 1),
            "output_tok_s": round(self.tokens_per_second, 1),
            "preemptions": self.preemptions,
            "kv_mean": round(self.kv_mean, 3),
            "kv_peak": round(self.kv_peak, 3),
            "kv_samples": len(self.kv),
            "streams_peak": self.streams_peak,
            "ttft_p50_s": round(self.ttft(0.5), 2),
            "ttft_p99_s": round(self.ttft(0.99), 2),
            "prefix_hit_rate": round(self.hit_rate, 3),
            "booked_peak_of_capacity": round(booked, 3) if self.booked else None,
            "refusals": self.refusals,
            "resets": sum(a.resets for a in self.answers),
        }

    def __str__(self) -> str:
        f = self.figures()
        return (
            f"{f['served']}/{f['requests']} in {f['seconds']}s, {f['output_tok_s']} output tok/s, "
            f"{f['preemptions']:.0f} preemptions, KV mean {f['kv_mean']} peak {f['kv_peak']} "
            f"({f['kv_samples']} samples), {f['streams_peak']} streams at once, "
            f"TTFT p50 {f['ttft_p50_s']}s p99 {f['ttft_p99_s']}s, prefix hits {f['prefix_hit_rate']:.0%}, "
            f"booked peak {f['booked_peak_of_capacity']}, {f['refusals']} refusals, {f['resets']} resets"
        )


def counters(engine_url: str) -> dict[str, float]:
    names = ("generation_tokens", "num_preemptions", "prefix_cache_hits", "prefix_cache_queries")
    return {name: metric(f"{engine_url}/metrics", f"vllm:{name}_total") for name in names}


def engine_idle(engine_url: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    url = f"{engine_url}/metrics"
    while metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.1)


def overload(
    model: str,
    engine_url: str,
    url: str,
    capacity_tokens: int,
    admin_url: str | None = None,
    settle: Callable[[], None] | None = None,
    requests: int = REQUESTS,
    at_once: int | None = None,
) -> Run:
    """The chats at once against `url` (the engine itself, or a gateway in front of it); with `at_once`, at
    most that many in flight, each sent as one before it ends (an admission that knows every length)."""

    def send() -> list[Answer]:
        deadline = time.monotonic() + 300
        with concurrent.futures.ThreadPoolExecutor(at_once or requests) as pool:
            return list(pool.map(lambda i: call(url, chat_body(model, i), deadline), range(requests)))

    return measured(engine_url, capacity_tokens, send, admin_url, settle)


def measured(
    engine_url: str,
    capacity_tokens: int,
    send: Callable[[], list[Answer]],
    admin_url: str | None = None,
    settle: Callable[[], None] | None = None,
) -> Run:
    """A load (`send`, its answers) measured from an idle engine (`settle`: until then) to an idle one: the
    engine's counters around it, its KV and the sidecar's booking sampled while it runs."""
    settle = settle or (lambda: engine_idle(engine_url))
    settle()
    before = counters(engine_url)
    started = time.monotonic()
    with Sampler(engine_url, admin_url) as sampler:
        answers = send()
    seconds = time.monotonic() - started
    settle()
    delta = {k: v - before[k] for k, v in counters(engine_url).items()}
    return Run(
        answers=answers,
        seconds=seconds,
        generated=delta["generation_tokens"],
        preemptions=delta["num_preemptions"],
        hit_rate=delta["prefix_cache_hits"] / max(1.0, delta["prefix_cache_queries"]),
        kv=sampler.kv,
        booked=sampler.booked,
        capacity_tokens=capacity_tokens,
    )
