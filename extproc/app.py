"""The running sidecar: gRPC ext_proc server, health, admin HTTP, config reload and graceful shutdown.

Shutdown order matters for capacity accounting: first report NOT_SERVING (readiness fails, so Kubernetes and
Envoy stop sending new work), then stop accepting RPCs while in-flight streams finish within the grace
period, then settle whatever is still open with what is known, and only then close the loop. No lease is
left unsettled and no refund is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc import __version__
from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.admission.compose import build_admission
from extproc.config import DEFAULT_MODEL, Config, ConfigWatcher, ReloadResult, load_config, log_warnings
from extproc.config.load import rest_after
from extproc.core.clock import Clock, monotonic
from extproc.core.ports import LimiterStore
from extproc.kvfeed.subscriber.runtime import FeedbackRuntime
from extproc.metrics import Metrics
from extproc.protocol.accesslog import EndReports
from extproc.protocol.lean import LeanRuntime
from extproc.protocol.relay import ReportRelay
from extproc.protocol.servicer import ExtProcServicer
from extproc.store.factory import build_store

log = logging.getLogger(__name__)

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PRUNE_INTERVAL_S = 30.0


@dataclass
class Sidecar:
    config: Config
    config_path: Path | None = None
    store: LimiterStore | None = None
    clock: Clock = monotonic
    metrics: Metrics = field(default_factory=Metrics)

    def __post_init__(self) -> None:
        if self.store is None:
            self.store = build_store(self.config.store, self.clock)
        self.executor = ThreadPoolExecutor(
            max_workers=self.config.admission.tokenizer_threads, thread_name_prefix="tokenize"
        )
        # Settlement of large answers has its own thread: a flood of prompts to tokenize must not delay the
        # release of capacity that finished requests give back.
        self.settle_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="settle")
        assert self.store is not None
        self.feedback = FeedbackRuntime(self.metrics.registry, self._set_scale, clock=self.clock)
        # Replicas sharing a store divide each pool's KV budget by demand through it (core/kv/fleet.py).
        self.feedback.share_through(self.store.kv_board(), self.config.store.fallback_share)
        self.queue = AdmissionQueue(self.store, self.clock, self.metrics)
        self.store.on_wake(self.queue.kick)  # a shared store: capacity freed on other replicas
        self.feedback.on_room = self.queue.kick  # the fleet's order puts a waiter here first
        built = build_admission(
            lambda: self.config.admission_rules,  # converted once per load; swapped with the config
            self.store,
            self.clock,
            self.metrics,
            signals=self.feedback,
            queue=self.queue,
            executor=self.executor,
            settle_executor=self.settle_executor,
            served_as=self.feedback.served_as,
        )
        self.admission = built.service
        self.streams = built.streams
        self.unseen = built.unseen
        self.lean = LeanRuntime(built.unseen)
        self.servicer = ExtProcServicer(built, self.lean)
        self.end_reports = EndReports(built.unseen)
        self.relay: ReportRelay | None = None  # with a shared store (`_start_relay`)
        self.health = health.aio.HealthServicer()
        self.ready = False
        self.grpc_server: grpc.aio.Server | None = None
        self.grpc_port: int | None = None
        self.admin_runner: web.AppRunner | None = None
        self.admin_port: int | None = None
        self.watcher: ConfigWatcher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._limit_keys: Collection[str] = ()
        self._started = False
        self._stopped = False
        self.metrics.info.labels(__version__).set(1)
        for result in ReloadResult:  # every outcome exported from the start: increase() sees the first one
            self.metrics.config_reloads.labels(result.value)
        self.metrics.watch_limits(self.store.snapshot, self._exported_keys)
        self.metrics.watch_store(self.store.health)

    def _exported_keys(self) -> Collection[str]:
        """The configured keys, as last applied (not rebuilt per scrape: 10^5 tenants take 0.1 s)."""
        return self._limit_keys

    def _set_scale(self, key: str, scale: float) -> None:
        """Adaptive feedback runs on the event loop; the in-process store applies a scale at once. A shared
        store takes it as this replica's proposal: every replica admits at the one effective scale stored."""
        assert self.store is not None
        self.store.propose_scale(key, scale)
        self.queue.kick()  # a raised scale may admit waiters

    async def apply_config(self, config: Config) -> None:
        """Make a config current: new requests see new limits; in-flight leases are untouched."""
        assert self.store is not None
        started = time.perf_counter()
        specs, defaults = config.limit_specs()
        await rest_after(started)  # 10^5 tenants' specs take 0.1 s to build: a rest before applying them
        await self.store.apply_limits(specs, defaults, config.priority)
        self._limit_keys = specs.keys()
        self.config = config
        admission = config.admission
        self.admission.paces.default_tokens_per_second = admission.assumed_decode_tokens_per_second
        self.admission.lanes.configure(config.admission_rules.tokenizing)
        for model in config.model_labels():
            self.metrics.touch_model(model)  # the label values requests are counted under
        self.queue.configure(
            config.priority, {c.name: c.max_queued if c.queues else 0 for c in config.classes}
        )
        logging.getLogger().setLevel(config.log_level)
        if self._started:
            pools = [name for name in config.limits.models if name != DEFAULT_MODEL]
            await self.feedback.apply(config.feedback, pools)
            self._export_scale_floors(config, pools)

    def _export_scale_floors(self, config: Config, pools: list[str]) -> None:
        """Each adaptive pool's `min_scale`, so an alert can tell a pool held at its floor (as the runtime
        builds its controllers: every pool with limits, plus every pool with its own `adaptive` entry)."""
        feedback = config.feedback
        adaptive = {pool: feedback.adaptive_default for pool in pools} | dict(feedback.adaptive_pools)
        floors = {pool: cfg.min_scale for pool, cfg in adaptive.items()} if feedback.enabled else {}
        self.metrics.set_scale_floors(floors)

    def _count_reload(self, result: ReloadResult) -> None:
        self.metrics.config_reloads.labels(result.value).inc()

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._started = True
        assert self.store is not None
        await self.store.start()
        await self.apply_config(self.config)
        size = self.config.server.max_receive_message_bytes
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.servicer, server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self.end_reports, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.grpc_port = server.add_insecure_port(self.config.server.grpc_listen)
        if not self.grpc_port:
            raise RuntimeError(f"cannot listen on {self.config.server.grpc_listen}")
        await server.start()
        self.grpc_server = server
        await self._start_admin()
        if self.config_path is not None:
            self.watcher = ConfigWatcher(
                self.config_path,
                self.apply_config,
                self.config.server.config_poll_seconds,
                on_result=self._count_reload,
            )
            self.watcher.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self._prune_loop(), name="prune"))
        self.lean.start()
        await self._start_relay()
        for service in ("", EXTPROC_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.ready = True
        log.info(
            "sidecar started",
            extra={
                "grpc": self.config.server.grpc_listen,
                "admin": self.config.server.admin_listen,
                "version": __version__,
            },
        )

    async def _start_relay(self) -> None:
        """With a store shared by replicas, end reports for leases of other replicas go to them, and theirs
        come here (extproc/protocol/relay.py), through the store's mailbox: subscribed before the sidecar
        reports ready."""
        assert self.store is not None
        mailbox = self.store.mailbox(self.unseen.report_prefix)
        if mailbox is None:
            return
        relay = ReportRelay(mailbox, self.unseen.report_prefix, self.end_reports.settle)
        await relay.start()
        self.relay = self.end_reports.relay = relay

    async def _start_admin(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, _, port = self.config.server.admin_listen.rpartition(":")
        site = web.TCPSite(runner, host.strip("[]"), int(port))
        await site.start()
        self.admin_runner = runner
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.admin_port = sockets[0].getsockname()[1] if sockets else int(port)

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        if self.ready:
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_INTERVAL_S)
            assert self.store is not None
            self.store.prune()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: fail readiness, let in-flight streams finish within the grace period, settle the rest."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.server.shutdown_grace_seconds if grace_s is None else grace_s
        self.ready = False
        await self.health.enter_graceful_shutdown()
        if self.watcher is not None:
            await self.watcher.stop()
        await self.feedback.stop(reset=False)
        for task in self._tasks:
            task.cancel()
        if self.grpc_server is not None:
            log.info("draining ext_proc streams", extra={"grace_seconds": grace})
            stopping = asyncio.ensure_future(self.grpc_server.stop(grace))
            await self._end_reports_when_drained(stopping)
            await stopping
        self.queue.close()
        await self.lean.stop()
        self.streams.close_all()
        self.unseen.expire_all()
        await self.admission.drain()
        if self.relay is not None:
            await self.relay.close()
        assert self.store is not None
        await self.store.close()
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.settle_executor.shutdown(wait=False, cancel_futures=True)
        log.info("sidecar stopped")

    async def _end_reports_when_drained(self, stopping: asyncio.Future[None]) -> None:
        """Envoy keeps its access-log stream open for good: close it once no ext_proc stream is open and no
        lease waits for its end report, or the server's stop would always wait the whole grace period."""
        while not stopping.done():
            if len(self.streams) == 0 and not self.unseen.awaiting_reports():
                self.end_reports.close()
                return
            await asyncio.sleep(0.05)


async def serve(config_path: Path) -> None:
    """Run until SIGTERM or SIGINT, then drain and exit."""
    config = load_config(config_path)
    log_warnings(config, config_path)
    sidecar = Sidecar(config=config, config_path=config_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await sidecar.start()
    await stop.wait()
    log.info("shutdown requested")
    await sidecar.stop()
