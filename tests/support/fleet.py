"""Several gateways in front of one engine pool (issue 39), as real processes on free localhost ports: one
simulator, one redis-server, and N gateways, each a real Envoy and its sidecar, every sidecar with the same
config plus a `store` on the Redis and a KV feed scraping the simulator itself (`feedback.direct_targets`).

Beside the stack: a closed-loop streamed load that honours `retry-after`, spread over the gateways, and a
sampler of what the engine runs against the slots the gateways hold (read in Redis, where they live). The
fleet end-to-end test (tests/e2e/test_fleet_e2e.py) and the benchmark `python -m bench.fleet` use both.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import redis

from devstack.processes import Ports, Process, free_port, wait_http
from devstack.run import LOCAL_SIM_ARGS
from devstack.stack import LocalStack
from extproc.envoyconf.profiles import DEFAULT_PROFILE
from tests.component.store.redis_server import RedisServer
from tests.support.stack import build_stack, metric

MODEL = "llama-3-8b"
MODEL_KEY = f"model:{MODEL}"
"""The limiter key of the model's limits."""
KEY_PREFIX = "extproc:"
"""The store's default `store.redis.key_prefix`: the fleet's configs keep it."""


def fleet_config(
    config: dict[str, Any],
    sim_url: str,
    redis_url: str,
    scrape_interval_s: float | None = None,
    direct: bool = True,
) -> dict[str, Any]:
    """`config` for one gateway of the fleet: its store on the shared Redis (other `store` keys kept) and its
    KV feed scraping the engine's page directly (`direct`; else its own exporter does, which the stack
    names), in place of any exporter or Service the config names."""
    out = copy.deepcopy(config)
    store = dict(out.get("store") or {})
    store["backend"] = "redis"
    store["redis"] = {**(store.get("redis") or {}), "url": redis_url}
    out["store"] = store
    feedback: dict[str, Any] = {
        k: v for k, v in (out.get("feedback") or {}).items() if k not in ("exporters", "service")
    }
    if direct:
        feedback["direct_targets"] = [{"url": f"{sim_url}/metrics", "kind": "vllm", "model": MODEL}]
    if scrape_interval_s is not None:
        feedback["scrape_interval_seconds"] = scrape_interval_s
    out["feedback"] = feedback
    return out


@dataclass
class Fleet:
    """One simulator, one Redis, `gateways` Envoy + sidecar pairs. `start()`, then always `stop()` (also a
    context manager); a start that fails stops what it started.

    With `engine_port` the gateways front an engine already running there (the real-engine tier's vLLM)
    and no simulator starts; with `exporter_args` each gateway's feed comes from its own exporter started
    with them (a slow engine page outlasts a direct scrape's timeout) instead of a direct scrape."""

    config: dict[str, Any]
    gateways: int = 2
    sim_args: Sequence[str] = LOCAL_SIM_ARGS
    profile: str = DEFAULT_PROFILE
    scrape_interval_s: float | None = None
    engine_port: int | None = None
    exporter_args: Sequence[str] | None = None
    envoy_patch: Callable[[dict[str, Any]], None] | None = None
    """None: the shipped Envoy, the tenant header stripped from clients."""
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="extproc-fleet-")))
    sim_port: int = field(default_factory=free_port)
    """The engine's port: the simulator's own, or `engine_port`."""
    sim: Process | None = None
    redis: RedisServer | None = None
    stacks: list[LocalStack] = field(default_factory=list)

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    @property
    def urls(self) -> list[str]:
        """Each gateway's Envoy listener, in order."""
        return [stack.envoy_url for stack in self.stacks]

    @property
    def admin_urls(self) -> list[str]:
        """Each gateway's sidecar admin server (`/metrics`), in order."""
        return [stack.admin_url for stack in self.stacks]

    def start(self) -> Fleet:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.redis = RedisServer()
        self.redis.start()
        if self.engine_port is not None:
            self.sim_port = self.engine_port
        else:
            argv = [sys.executable, "-m", "extproc.sim", "--host", "127.0.0.1", "--port", str(self.sim_port)]
            self.sim = Process.start("simulator", [*argv, "--model", MODEL, *self.sim_args], self.workdir)
            wait_http(f"{self.sim_url}/health", proc=self.sim)
        exporter = self.exporter_args is not None
        config = fleet_config(self.config, self.sim_url, self.redis.url, self.scrape_interval_s, not exporter)
        for index in range(self.gateways):
            stack = build_stack(
                config,
                profile=self.profile,
                ports=replace(Ports.free(), upstream=self.sim_port),
                with_simulator=False,
                with_exporter=exporter,
                exporter_args=tuple(self.exporter_args or ()),
                envoy_patch=self.envoy_patch,
                model=MODEL,
                workdir=self.workdir / f"gateway-{index}",
            )
            self.stacks.append(stack)
            stack.start()

    def wait_fed(self, limit_s: float = 30.0) -> None:
        """Until every sidecar knows the pool's KV capacity from the feed and the others' figures from the
        store (`extproc_kv_peers_known`), and the limits are whole: every sidecar's adaptive scale back at 1
        from the safe scale it starts at, and so the fleet's, the one Redis holds. The fleet then admits as
        it will under load."""
        assert self.redis is not None
        client = redis.Redis.from_url(self.redis.url, socket_timeout=2)
        scale_key = f"{KEY_PREFIX}{{limits}}:c:{len(MODEL_KEY)}:{MODEL_KEY}"
        deadline = time.monotonic() + limit_s
        try:
            while True:
                if all(self._fed(i) for i in range(len(self.stacks))) and client.hget(scale_key, "e") is None:
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"the sidecars not fed within {limit_s}s; logs in {self.workdir}")
                time.sleep(0.1)
        finally:
            client.close()

    def _fed(self, index: int) -> bool:
        return (
            self.sidecar(index, "extproc_kv_capacity_tokens") > 0
            and self.sidecar(index, "extproc_kv_peers_known") == 1
            and self.sidecar(index, "extproc_adaptive_scale_ratio") == 1
        )

    def sidecar(self, index: int, name: str) -> float:
        """One of the pool's series on gateway `index`'s sidecar."""
        return metric(f"{self.stacks[index].admin_url}/metrics", name, pool=MODEL)

    def stop(self) -> None:
        for stack in reversed(self.stacks):
            with contextlib.suppress(Exception):
                stack.stop()
        if self.sim is not None:
            self.sim.stop()
            self.sim = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- what the engine runs against what the gateways hold -------------------------------------------------

_ENGINE_SERIES = re.compile(
    rb"^(vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc|num_preemptions_total"
    rb"|generation_tokens_total))(?:\{[^}]*\})? (\S+)$",
    re.MULTILINE,
)


def engine_page(url: str) -> dict[str, float]:
    """The simulator's running, waiting, KV usage, preemptions and generated tokens (one engine: each
    series summed over its labels), read from its page with nothing but a regex (sampled every 50 ms)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        page = resp.read()
    out: dict[str, float] = {}
    for name, value in _ENGINE_SERIES.findall(page):
        key = name.decode()
        out[key] = out.get(key, 0.0) + float(value)
    return out


LEASES_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local since = '(' .. string.format('%.6f', now)
local held = {}
for _, share in ipairs(redis.call('SMEMBERS', KEYS[1] .. 's:' .. ARGV[1])) do
  local slots = KEYS[1] .. 'l:' .. ARGV[1] .. ':' .. share
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', slots, since, '+inf')) do
    held[#held + 1] = m
  end
end
return {held, redis.call('ZRANGEBYSCORE', KEYS[1] .. 'u', since, '+inf')}
"""
"""The live leases of one limiter key, in one atomic read: those holding a slot (its share sets `l:`) and
those whose slot went back before their end while their tokens stay reserved (`u`). Key layout:
docs/store.md."""


class Leases:
    """The fleet's leases on the model's key, read in the Redis every gateway's store shares."""

    def __init__(self, redis_url: str, key: str = MODEL_KEY) -> None:
        self.client = redis.Redis.from_url(redis_url, socket_timeout=2)
        self.prefix = f"{KEY_PREFIX}{{limits}}:"
        self.key = f"{len(key)}:{key}"
        self.script = self.client.register_script(LEASES_SCRIPT)

    def read(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(leases holding a slot, leases admitted and not yet settled: the former and those in `u`)."""
        held, freed = self.script(keys=[self.prefix], args=[self.key])
        return frozenset(held), frozenset(held) | frozenset(freed)

    def close(self) -> None:
        self.client.close()


@dataclass(frozen=True)
class Sample:
    """One 50 ms sample: the engine's counts between two reads of the leases.

    `held` and `admitted` count the leases found in either read. A request the engine runs at the engine's
    read holds its slot from before it was sent until after it ended, so it is in the first read (admitted
    before it) or the second (still running then, or ended less than a read pair ago: no answer here is
    that short). So `running <= held` holds at every sample of a fleet that releases no slot of a request
    the engine still runs, whatever happens between the reads."""

    at: float  # time.monotonic() of the engine's read
    running: float
    waiting: float
    kv: float
    generated: float  # the engine's generated tokens so far
    preemptions: float
    held: int
    admitted: int
    held_max: int  # the larger of the two reads: the slots held at one instant
    span_s: float  # from the first read of the leases to the end of the second


class Sampler(threading.Thread):
    """Samples every `interval_s` until `stop()`; a failed read (a process busy for seconds) is skipped.

    `admin_urls`: the sidecars whose requests running on their local fallback share, not yet in Redis
    (`extproc_store_fallback_leases`: a Redis call timed out under load; each is adopted into Redis once it
    answers, within a second or so), count as admitted and held too: the engine runs them."""

    def __init__(
        self, sim_url: str, redis_url: str, interval_s: float = 0.05, admin_urls: Sequence[str] = ()
    ) -> None:
        super().__init__(daemon=True, name="fleet-sampler")
        self.sim_url = sim_url
        self.admin_urls = tuple(admin_urls)
        self.leases = Leases(redis_url)
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.failed = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.wait(self.interval_s):
                try:
                    self.samples.append(self.sample())
                except (OSError, redis.RedisError):
                    self.failed += 1
        finally:
            self.leases.close()

    def sample(self) -> Sample:
        began = time.monotonic()
        held_before, admitted_before = self.leases.read()
        at = time.monotonic()
        page = engine_page(self.sim_url)
        local = sum(metric(f"{url}/metrics", "extproc_store_fallback_leases") for url in self.admin_urls)
        held_after, admitted_after = self.leases.read()
        return Sample(
            at=at,
            running=page.get("vllm:num_requests_running", 0.0),
            waiting=page.get("vllm:num_requests_waiting", 0.0),
            kv=page.get("vllm:kv_cache_usage_perc", 0.0),
            generated=page.get("vllm:generation_tokens_total", 0.0),
            preemptions=page.get("vllm:num_preemptions_total", 0.0),
            held=len(held_before | held_after) + round(local),
            admitted=len(admitted_before | admitted_after) + round(local),
            held_max=max(len(held_before), len(held_after)),
            span_s=time.monotonic() - began,
        )

    def stop(self) -> list[Sample]:
        self._stop_event.set()
        self.join(10)
        return self.samples

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def running_over_held(samples: Sequence[Sample]) -> float:
    """The most the engine ran beyond the slots the fleet held (<= 0: no slot released while its request
    ran); NaN without samples."""
    return max((s.running - s.held for s in samples), default=float("nan"))


def running_over_admitted(samples: Sequence[Sample]) -> float:
    """The most the engine ran beyond the requests the fleet held admitted (<= 0); NaN without samples."""
    return max((s.running - s.admitted for s in samples), default=float("nan"))


# -- the load ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """Closed-loop streamed clients: client i sends to gateway `gateway_of[i]`, one request at a time, a
    prompt of `prompt_tokens` (uniform, drawn from `seed`) and `output_tokens` (the simulator generates
    exactly that many), and sends a refused request again after its `retry-after`, until `seconds` have
    passed; the answers in flight then are read to their end (at most `drain_s`)."""

    gateway_of: tuple[int, ...]
    seconds: float
    prompt_tokens: tuple[int, int] = (1000, 1500)
    output_tokens: int = 300
    seed: int = 39
    drain_s: float = 60.0
    retry_wait_cap_s: float | None = None
    """The most a refused client waits before sending again, whatever its `retry-after` said (None: as it
    said)."""


def split(clients: int, shares: Sequence[int]) -> tuple[int, ...]:
    """`clients` spread over the gateways in proportion to `shares` (percent), the gateway of each client:
    30 clients at (90, 10) are 27 on gateway 0 and 3 on gateway 1."""
    counts = [round(clients * s / sum(shares)) for s in shares]
    counts[0] += clients - sum(counts)
    return tuple(i for i, n in enumerate(counts) for _ in range(n))


@dataclass
class Tally:
    """What the clients saw, per gateway."""

    answered: list[int]
    refused: list[int]
    errors: list[int]
    output_tokens: list[int]
    statuses: dict[int, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    """Refusals by `x-extproc-reject-reason`, both gateways together."""
    started: float = 0.0
    """time.monotonic() when the clients started: the load ran until `started + seconds`."""


def chat_body(rng: random.Random, client: int, sent: int, load: Load) -> dict[str, Any]:
    """A streamed chat of a drawn length. Its head is its own, so no two prompts share a prefix (the budget
    and the engine would hold a shared one once); each ' hello' after it is one token."""
    tokens = rng.randint(*load.prompt_tokens)
    return {
        "model": MODEL,
        "max_tokens": load.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"client {client} request {sent}:" + " hello" * tokens}],
    }


def retry_after_s(headers: Any) -> float:
    """The refusal's hint: `retry-after-ms`, else `retry-after` (seconds), else one second."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            with contextlib.suppress(ValueError):
                return max(0.0, float(value) * scale)
    return 1.0


async def _client(
    session: aiohttp.ClientSession, urls: Sequence[str], client: int, load: Load, until: float, tally: Tally
) -> None:
    gateway = load.gateway_of[client]
    url = f"{urls[gateway]}/v1/chat/completions"
    rng = random.Random(load.seed * 1_000_003 + client)
    sent = 0
    while time.monotonic() < until:
        sent += 1
        body = chat_body(rng, client, sent, load)
        while time.monotonic() < until:
            try:
                async with session.post(url, json=body) as resp:
                    if resp.status == 429:
                        tally.refused[gateway] += 1
                        reason = resp.headers.get("x-extproc-reject-reason", "")
                        tally.reasons[reason] = tally.reasons.get(reason, 0) + 1
                        wait = retry_after_s(resp.headers)
                        if load.retry_wait_cap_s is not None:
                            wait = min(wait, load.retry_wait_cap_s)
                        await resp.read()
                        await asyncio.sleep(min(wait, max(0.0, until - time.monotonic())))
                        continue
                    if resp.status != 200:
                        tally.errors[gateway] += 1
                        tally.statuses[resp.status] = tally.statuses.get(resp.status, 0) + 1
                        await resp.read()
                        await asyncio.sleep(0.1)
                        break
                    completion = 0
                    async for line in resp.content:
                        if b'"completion_tokens"' in line and line.startswith(b"data: {"):
                            usage = json.loads(line[len(b"data: ") :]).get("usage") or {}
                            completion = int(usage.get("completion_tokens") or 0)
                    tally.answered[gateway] += 1
                    tally.output_tokens[gateway] += completion
            except (aiohttp.ClientError, TimeoutError):
                tally.errors[gateway] += 1
                tally.statuses[0] = tally.statuses.get(0, 0) + 1
            break


async def _drive(urls: Sequence[str], load: Load) -> Tally:
    n = len(urls)
    tally = Tally([0] * n, [0] * n, [0] * n, [0] * n, started=time.monotonic())
    until = tally.started + load.seconds
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=load.seconds + load.drain_s + 30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [
            asyncio.create_task(_client(session, urls, i, load, until, tally))
            for i in range(len(load.gateway_of))
        ]
        _, pending = await asyncio.wait(tasks, timeout=load.seconds + load.drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return tally


def drive(urls: Sequence[str], load: Load) -> Tally:
    """Run `load` against the gateways at `urls` (blocks for its `seconds`, plus the drain)."""
    return asyncio.run(_drive(urls, load))
