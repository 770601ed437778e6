"""The sidecar's side of the feed: watch every exporter, keep the newest sample per (node, endpoint, model).

Exporters come from a static host:port list or from the A/AAAA records of a headless Service re-resolved
periodically (`loop.getaddrinfo`), so DaemonSet pods joining or leaving are picked up without restarts.
Every exporter gets its own watch task that reconnects with capped exponential backoff and jitter (so a
fleet of sidecars does not reconnect in lockstep after an exporter restart). Sleeper, clock, random source
and resolver are injectable so tests run without waiting.

Without exporters (a single-node setup) the subscriber can scrape inference servers directly with the
exporter's scraper.

The sidecar does not trust the wire: every sample goes through `sample.checked` on arrival, so one holding
a reading no server can have (NaN, ±inf, a negative usage or count, a capacity of 0 or above 2^40 tokens)
is stored as a down sample (its endpoint missing from the pool), counted in
`extproc_feed_invalid_samples_total{field}` and logged at most every 30 s per endpoint.

Freshness is judged by receive time on the sidecar's clock. A sample whose exporter timestamp is not newer
than the one already stored (the exporter replaying its cache after a reconnect) does not refresh it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections.abc import Awaitable, Callable

import aiohttp
import grpc

from extproc.kvfeed.proto import feedback_pb2, feedback_pb2_grpc
from extproc.kvfeed.sample import FeedSample, SampleKey, checked, from_proto
from extproc.kvfeed.scraper import Scraper
from extproc.kvfeed.subscriber.aggregate import StoredSample
from extproc.kvfeed.subscriber.metrics import FeedbackMetrics
from extproc.kvfeed.subscriber.settings import SubscriberConfig, split_hostport
from extproc.logs import RateLimitedLog

log = logging.getLogger(__name__)

Sleeper = Callable[[float], Awaitable[None]]
Resolver = Callable[[str, int], Awaitable[list[str]]]

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def backoff_delay(attempt: int, cfg: SubscriberConfig, rng: random.Random) -> float:
    """Capped exponential delay for the attempt-th consecutive failure, with multiplicative jitter."""
    base = min(cfg.backoff_max, cfg.backoff_initial * cfg.backoff_multiplier ** min(attempt, 64))
    return base * (1.0 - cfg.backoff_jitter * rng.random())


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address of `host` as host:port (A and AAAA records of a headless Service)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = set()
    for family, *_rest, sockaddr in infos:
        ip = str(sockaddr[0])
        out.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(out)


class FeedSubscriber:
    """Collects samples from exporters (or servers directly); `on_sample` runs on the event loop."""

    def __init__(
        self,
        config: SubscriberConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_sample: Callable[[FeedSample], None] | None = None,
        sleeper: Sleeper = asyncio.sleep,
        rng: random.Random | None = None,
        resolver: Resolver = resolve_all,
        metrics: FeedbackMetrics | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._on_sample = on_sample
        self._sleep = sleeper
        self._rng = rng or random.Random()
        self._resolve = resolver
        self._metrics = metrics
        self._store: dict[SampleKey, StoredSample] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._ratelimit = RateLimitedLog(30.0)
        self.reconnects = 0
        self.samples_received = 0
        self.connected: set[str] = set()

    # -- store -------------------------------------------------------------------------------------------

    def ingest(self, sample: FeedSample) -> None:
        """Store a sample (newest wins) and notify. Replayed samples do not refresh freshness; one with an
        impossible reading is stored as down."""
        sample = self._checked(sample)
        now = self._clock()
        prev = self._store.get(sample.key)
        if prev is not None and sample.sample_time <= prev.sample.sample_time and sample.up == prev.sample.up:
            return
        self._store[sample.key] = StoredSample(sample, now)
        self.samples_received += 1
        if self._metrics is not None:
            self._metrics.samples.inc()
        if self._on_sample is not None:
            self._on_sample(sample)

    def _checked(self, sample: FeedSample) -> FeedSample:
        safe = checked(sample)
        if safe.up or not sample.up:
            return safe
        field = safe.error.removeprefix("invalid: ").partition(" ")[0]
        if self._metrics is not None:
            self._metrics.invalid_samples.labels(field).inc()
        allowed, suppressed = self._ratelimit.allow(("invalid", sample.endpoint))
        if allowed:
            log.warning(
                "feed sample refused, endpoint taken as missing",
                extra={
                    "node": sample.node,
                    "endpoint": sample.endpoint,
                    "model": sample.model,
                    "error": safe.error,
                    "suppressed": suppressed,
                },
            )
        return safe

    def samples(self) -> list[StoredSample]:
        return list(self._store.values())

    def prune(self, now: float) -> None:
        """Forget endpoints not heard from for `forget_after` seconds so the store tracks the fleet."""
        limit = self.config.forget_after
        for key in [k for k, v in self._store.items() if now - v.received_at > limit]:
            del self._store[key]

    @property
    def addresses(self) -> list[str]:
        return sorted(self._watchers)

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        self._set_addresses(list(cfg.exporters))
        if cfg.service:
            self._tasks.append(asyncio.create_task(self._resolve_loop(cfg.service), name="feed-resolve"))
        if cfg.direct_targets:
            self._session = aiohttp.ClientSession(trust_env=False)
            self._tasks.append(asyncio.create_task(self._direct_loop(), name="feed-direct"))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._watchers.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._watchers.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _set_addresses(self, addresses: list[str]) -> None:
        wanted = set(addresses)
        for addr in [a for a in self._watchers if a not in wanted]:
            self._watchers.pop(addr).cancel()
            log.info("exporter removed", extra={"exporter": addr})
        for addr in sorted(wanted - set(self._watchers)):
            self._watchers[addr] = asyncio.create_task(self._watch(addr), name=f"feed-watch-{addr}")
            log.info("exporter added", extra={"exporter": addr})

    async def _resolve_loop(self, service: str) -> None:
        host, port = split_hostport(service)
        while True:
            try:
                addresses = await self._resolve(host, port)
                self._set_addresses(list(self.config.exporters) + addresses)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the current exporters on a DNS failure
                allowed, _ = self._ratelimit.allow(("resolve", service))
                if allowed:
                    log.warning(
                        "exporter service resolution failed", extra={"service": service, "error": str(exc)}
                    )
            await self._sleep(self.config.resolve_interval)

    # -- streams -----------------------------------------------------------------------------------------

    async def _watch(self, address: str) -> None:
        cfg = self.config
        attempt = 0
        options = _CHANNEL_OPTIONS + list(cfg.extra_channel_options)
        while True:
            error = "stream ended"
            try:
                async with grpc.aio.insecure_channel(address, options=options) as channel:
                    stub = feedback_pb2_grpc.KvFeedStub(channel)  # type: ignore[no-untyped-call]
                    call = stub.Watch(feedback_pb2.WatchRequest(models=list(cfg.models)))
                    while True:
                        async with asyncio.timeout(cfg.idle_timeout):
                            msg = await call.read()
                        if msg is grpc.aio.EOF:
                            break
                        if attempt:
                            log.info("feed connected", extra={"exporter": address})
                        attempt = 0
                        self.connected.add(address)
                        self.ingest(from_proto(msg))
            except asyncio.CancelledError:
                self.connected.discard(address)
                raise
            except TimeoutError:
                error = f"no sample for {cfg.idle_timeout:g}s"
            except grpc.aio.AioRpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            self.connected.discard(address)
            self.reconnects += 1
            if self._metrics is not None:
                self._metrics.reconnects.inc()
            delay = backoff_delay(attempt, cfg, self._rng)
            attempt += 1
            allowed, suppressed = self._ratelimit.allow(("watch", address))
            if allowed:
                log.warning(
                    "feed disconnected, retrying",
                    extra={
                        "exporter": address,
                        "error": error[:300],
                        "retry_in_s": round(delay, 3),
                        "suppressed": suppressed,
                    },
                )
            await self._sleep(delay)

    async def _direct_loop(self) -> None:
        cfg = self.config
        assert self._session is not None
        scraper = Scraper(self._session, cfg.direct_node, timeout=cfg.scrape_timeout)
        while True:
            results = await asyncio.gather(*(scraper.scrape(t) for t in cfg.direct_targets))
            for result in results:
                for sample in result.samples:
                    self.ingest(sample)
            await self._sleep(cfg.scrape_interval)
