"""The node exporter: scrape local inference servers every second, serve KvFeed and /metrics.

One asyncio process: a scrape loop (all targets concurrently, each bounded by a timeout), an optional
Kubernetes re-list loop, a grpc.aio server (KvFeed + gRPC health) and an aiohttp server for its own
Prometheus metrics. A misbehaving target is marked down and counted; nothing a target does can stop the
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from extproc.kvfeed.exporter.discovery import Discovery, KubeDiscovery, KubeDiscoveryConfig, StaticDiscovery
from extproc.kvfeed.exporter.hub import SampleHub
from extproc.kvfeed.exporter.metrics import ExporterMetrics
from extproc.kvfeed.exporter.service import KvFeedService
from extproc.kvfeed.proto import feedback_pb2, feedback_pb2_grpc
from extproc.kvfeed.sample import FeedSample
from extproc.kvfeed.scraper import Scraper, ScrapeResult
from extproc.kvfeed.targets import Target
from extproc.logs import RateLimitedLog

log = logging.getLogger(__name__)

SERVICE_NAME = feedback_pb2.DESCRIPTOR.services_by_name["KvFeed"].full_name
DEFAULT_GRPC_PORT = 50061
DEFAULT_METRICS_PORT = 9465


@dataclass(frozen=True, slots=True)
class ExporterConfig:
    """Everything the exporter needs; built by the CLI or directly by tests (ports 0 = pick free)."""

    node_name: str
    targets: list[Target] = field(default_factory=list)
    kube: KubeDiscoveryConfig | None = None
    grpc_host: str = "0.0.0.0"
    grpc_port: int = DEFAULT_GRPC_PORT
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = DEFAULT_METRICS_PORT
    scrape_interval: float = 1.0
    scrape_timeout: float = 0.8
    log_interval: float = 30.0
    shutdown_grace: float = 2.0

    def __post_init__(self) -> None:
        if self.scrape_interval <= 0:
            raise ValueError("exporter.scrape_interval: must be > 0")
        if not 0 < self.scrape_timeout <= self.scrape_interval * 10:
            raise ValueError("exporter.scrape_timeout: must be > 0")
        if self.kube is None and not self.targets:
            raise ValueError("exporter.targets: give static targets or Kubernetes discovery")


class Exporter:
    """Lifecycle: `await start()`, then `await stop()` (idempotent)."""

    def __init__(
        self,
        config: ExporterConfig,
        registry: CollectorRegistry | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.metrics = ExporterMetrics(self.registry)
        self.hub = SampleHub()
        self._mono = monotonic
        self._targets: list[Target] = list(config.targets)
        self._down: dict[str, str | None] = {}
        self._ratelimit = RateLimitedLog(config.log_interval, monotonic)
        self._session: aiohttp.ClientSession | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._discovery: Discovery = StaticDiscovery(list(config.targets))
        self.grpc_port = 0
        self.metrics_port = 0

    @property
    def targets(self) -> list[Target]:
        return list(self._targets)

    async def start(self) -> None:
        cfg = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, ttl_dns_cache=30), trust_env=False
        )
        self._scraper = Scraper(self._session, cfg.node_name, timeout=cfg.scrape_timeout)
        if cfg.kube is not None:
            self._discovery = KubeDiscovery(self._session, cfg.kube)
            self._targets = []
            await self._relist_once()

        # Sidecars ping every 10 s to detect dead nodes; accept that without GOAWAY "too_many_pings".
        self._server = grpc.aio.server(
            options=[
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_ping_strikes", 0),
            ]
        )
        service = KvFeedService(self.hub, self.metrics)
        feedback_pb2_grpc.add_KvFeedServicer_to_server(service, self._server)  # type: ignore[no-untyped-call]
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.grpc_port = self._server.add_insecure_port(f"{cfg.grpc_host}:{cfg.grpc_port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC on {cfg.grpc_host}:{cfg.grpc_port}")
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

        if cfg.metrics_port is not None:
            app = web.Application()
            app.router.add_get("/metrics", self._handle_metrics)
            app.router.add_get("/healthz", self._handle_healthz)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, cfg.metrics_host, cfg.metrics_port)
            await site.start()
            server = site._server
            sockets = getattr(server, "sockets", None) or []
            self.metrics_port = sockets[0].getsockname()[1] if sockets else cfg.metrics_port

        self._tasks.append(asyncio.create_task(self._scrape_loop(), name="exporter-scrape"))
        if cfg.kube is not None:
            self._tasks.append(asyncio.create_task(self._relist_loop(), name="exporter-relist"))
        log.info(
            "exporter started",
            extra={
                "node": cfg.node_name,
                "grpc_port": self.grpc_port,
                "metrics_port": self.metrics_port,
                "targets": [t.url for t in self._targets],
            },
        )

    async def stop(self) -> None:
        """Health NOT_SERVING first, then close streams within the grace period, then the rest."""
        with contextlib.suppress(Exception):
            await self._health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self.hub.close_all()
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace)
            self._server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        log.info("exporter stopped")

    # -- scraping ----------------------------------------------------------------------------------------

    async def scrape_once(self) -> list[ScrapeResult]:
        """One round over all current targets (also used by tests to avoid waiting for the loop)."""
        targets = list(self._targets)
        results = await asyncio.gather(*(self._scraper.scrape(t) for t in targets), return_exceptions=True)
        done: list[ScrapeResult] = []
        for target, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                log.error("scrape crashed", extra={"target": target.url}, exc_info=result)
                continue
            self._record(result)
            done.append(result)
        self.metrics.targets.set(len(self._targets))
        self.metrics.targets_up.set(sum(1 for t in self._targets if self._down.get(t.url) is None))
        return done

    def _record(self, result: ScrapeResult) -> None:
        target = result.target
        self.metrics.observe_scrape(target.endpoint, result.duration, result.reason, result.page_bytes)
        previous = self._down.get(target.url, "unknown")
        self._down[target.url] = result.reason
        if result.reason is None:
            if previous is not None:
                log.info(
                    "target up", extra={"target": target.url, "models": [s.model for s in result.samples]}
                )
                self._ratelimit.forget(target.url)
        else:
            fields = {"target": target.url, "reason": result.reason, "error": result.error}
            if previous != result.reason:
                log.warning("target down", extra=fields)
                self._ratelimit.allow(target.url)
            else:
                allowed, suppressed = self._ratelimit.allow(target.url)
                if allowed:
                    log.warning("target still down", extra={**fields, "suppressed": suppressed})
        self.hub.publish(result.samples)
        self.metrics.samples_published.inc(len(result.samples))
        self.metrics.observe_samples(result.samples)

    async def _scrape_loop(self) -> None:
        interval = self.config.scrape_interval
        next_at = self._mono()
        while True:
            try:
                await self.scrape_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scrape round failed")
            next_at += interval
            delay = next_at - self._mono()
            if delay < 0:  # fell behind (slow round): skip missed ticks instead of bursting
                next_at = self._mono()
                delay = 0
            await asyncio.sleep(delay)

    # -- discovery ---------------------------------------------------------------------------------------

    async def _relist_once(self) -> None:
        try:
            new = await self._discovery.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.discovery_errors.inc()
            log.warning("pod listing failed, keeping last targets", extra={"error": str(exc)[:300]})
            return
        self.set_targets(new)

    def set_targets(self, new: list[Target]) -> None:
        """Swap the target list; departed targets get a final up=false sample and lose their series."""
        old = {t.url: t for t in self._targets}
        fresh = {t.url: t for t in new}
        now = time.time()
        for url, target in old.items():
            if url in fresh:
                continue
            gone = [
                FeedSample.down(self.config.node_name, target.endpoint, m, target.kind, "target removed", now)
                for m in self._scraper.known_models(target)
            ]
            self.hub.publish(gone)
            self.hub.forget_endpoint(target.endpoint)
            self.metrics.forget_target(target.endpoint)
            self._scraper.forget(target)
            self._down.pop(url, None)
            self._ratelimit.forget(url)
        if set(old) != set(fresh):
            log.info("targets changed", extra={"targets": sorted(fresh)})
        self._targets = list(new)
        self.metrics.targets.set(len(self._targets))

    async def _relist_loop(self) -> None:
        assert self.config.kube is not None
        while True:
            await asyncio.sleep(self.config.kube.relist_seconds)
            await self._relist_once()

    # -- HTTP --------------------------------------------------------------------------------------------

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _handle_healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")
