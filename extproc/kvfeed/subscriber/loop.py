"""`FeedbackLoop`: what the sidecar instantiates to turn the KV feed into per-pool limit scales.

Wiring (see docs/feedback.md): the sidecar builds a `SubscriberConfig`, per-pool `AdaptiveConfig`s and an
`on_update(pool, state)` callback, awaits `start()` at startup and `stop()` at shutdown, and multiplies
each pool's base limits by `state.scale`. Pools are keyed by the model name as served.

Evaluation happens on the event loop: at once for the pool of each arriving sample (so a drop applies
within one scrape), and for every pool on a periodic tick (so staleness and gradual recovery advance with
no samples arriving). `on_update` runs only when a pool's state changed (ignoring `updated_at`);
`on_sample(pool, snapshot, now)` runs for every fresh sample that arrives (the KV budget's engine reading).
Each pool's generation counters feed its `EngineTally` (`engine_tally(pool)`): what the engines generated
for a request whose answer was not seen whole.
`served` maps the names the engines serve (aliases, LoRA adapters) to their pools.

A pool whose every endpoint the feed shows refusing connections (`PoolSnapshot.no_live_endpoint`) is not
stale: its controller holds the scale (`AdaptiveController.unreachable`), and past the grace the pool is down
(`engine_down_for`), which admission refuses up front; an endpoint's first up sample ends it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from extproc.core.engine.adaptive import AdaptiveConfig, AdaptiveController, ControllerState
from extproc.core.engine.counter import PoolCounter
from extproc.core.engine.tally import EngineTally
from extproc.kvfeed.sample import FeedSample, SampleKey
from extproc.kvfeed.subscriber.aggregate import PoolSnapshot, aggregate
from extproc.kvfeed.subscriber.client import FeedSubscriber, Sleeper
from extproc.kvfeed.subscriber.endpoints import (
    EndpointReadings,
    generated_in,
    prompted_in,
    read_generated,
    read_prompted,
)
from extproc.kvfeed.subscriber.metrics import FeedbackMetrics
from extproc.kvfeed.subscriber.readtime import ReadTimes
from extproc.kvfeed.subscriber.served import ServedNames
from extproc.kvfeed.subscriber.settings import KvMode, SubscriberConfig

log = logging.getLogger(__name__)

OnUpdate = Callable[[str, ControllerState], None]

OnSample = Callable[[str, PoolSnapshot, float], None]

OnEngineSample = Callable[[str, str, float], None]

OnEnginesForgotten = Callable[[set[tuple[str, str]]], None]


def _same(a: ControllerState, b: ControllerState) -> bool:
    return (a.kv_usage, a.waiting, a.target_scale, a.scale, a.stale, a.engine_down) == (
        b.kv_usage,
        b.waiting,
        b.target_scale,
        b.scale,
        b.stale,
        b.engine_down,
    )


class FeedbackLoop:
    """Subscriber + aggregation + one adaptive controller per pool."""

    def __init__(
        self,
        subscriber: SubscriberConfig,
        adaptive: Mapping[str, AdaptiveConfig] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_update: OnUpdate | None = None,
        *,
        default_adaptive: AdaptiveConfig | None = None,
        metrics: FeedbackMetrics | None = None,
        tick_interval: float = 0.25,
        kv_aggregation: KvMode = "max",
        sleeper: Sleeper = asyncio.sleep,
        on_sample: OnSample | None = None,
        on_engine_sample: OnEngineSample | None = None,
        on_engines_forgotten: OnEnginesForgotten | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if tick_interval <= 0:
            raise ValueError("feedback.tick_interval: must be > 0")
        self._configs = dict(adaptive or {})
        self._default = default_adaptive or AdaptiveConfig()
        self._clock = clock
        self._wall = wall_clock  # what a sample's `sample_time` is read against (`ReadTimes`)
        self._on_update = on_update
        self._on_fresh = on_sample
        self._on_engine = on_engine_sample
        self._on_forgotten = on_engines_forgotten
        self._metrics = metrics
        self._tick_interval = tick_interval
        self._kv_mode = kv_aggregation
        self._controllers: dict[str, AdaptiveController] = {}
        self._snapshots: dict[str, PoolSnapshot] = {}
        self._rejections: dict[SampleKey, float] = {}  # each endpoint's admission-rejection counter
        self._tallies: dict[str, EngineTally] = {}  # per pool: its engines' generation counters
        self._prompted: dict[str, PoolCounter] = {}  # per pool: its engines' prefilled prompt tokens
        self._engines = EndpointReadings()  # each engine read alone (a picker named it: `endpoints.py`)
        self._read_times = ReadTimes()  # when each endpoint's samples were read, on `clock`
        self._tick_task: asyncio.Task[None] | None = None
        self.served = ServedNames(subscriber.forget_after)
        self.subscriber = FeedSubscriber(
            subscriber, clock=clock, on_sample=self._on_sample, sleeper=sleeper, metrics=metrics
        )
        now = clock()
        for pool in self._configs:
            self._controller(pool, now)

    # -- public API --------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.subscriber.start()
        self._tick_task = asyncio.create_task(self._tick_loop(), name="feedback-tick")
        self.evaluate()

    async def stop(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
            self._tick_task = None
        await self.subscriber.stop()
        for tally in self._tallies.values():
            tally.close()  # requests waiting for a count get none from this loop

    def states(self) -> dict[str, ControllerState]:
        """Current state of every known pool (configured pools and pools seen in the feed)."""
        return {pool: c.state for pool, c in self._controllers.items()}

    def state(self, pool: str) -> ControllerState | None:
        c = self._controllers.get(pool)
        return c.state if c is not None else None

    def snapshots(self) -> dict[str, PoolSnapshot]:
        return dict(self._snapshots)

    def capacity_tokens(self, pool: str) -> int | None:
        """KV capacity of the pool's fresh endpoints in tokens, None when unknown or stale."""
        snap = self._snapshots.get(pool)
        return snap.kv_capacity_tokens if snap is not None and not snap.stale else None

    def decode_tokens_per_second(self, pool: str) -> float | None:
        """The decode pace per sequence the pool's fresh endpoints publish, None when none does or stale."""
        snap = self._snapshots.get(pool)
        return snap.decode_tokens_per_second if snap is not None and not snap.stale else None

    def prompted(self, pool: str) -> float | None:
        """The prompt tokens the pool's engines have prefilled since the feed first read them (the growth of
        vLLM's `vllm:prompt_tokens_total`); None where no endpoint of the pool publishes it now."""
        counter = self._prompted.get(pool)
        return counter.total if counter is not None and counter.known else None

    def endpoint_snapshot(self, pool: str, endpoint: str) -> PoolSnapshot | None:
        """One engine of `pool` read as a pool of one now (`EndpointReadings`); None before its first
        sample."""
        return self._engines.snapshot(pool, endpoint, self._clock(), self._stale_after, self._kv_mode)

    def endpoint_prompted(self, pool: str, endpoint: str) -> float | None:
        """`prompted` for one engine of `pool` alone."""
        return self._engines.prompted(pool, endpoint)

    def endpoint_tally(self, pool: str, endpoint: str) -> EngineTally | None:
        """`engine_tally` for one engine of `pool` alone (`EndpointReadings.tally`)."""
        return self._engines.tally(pool, endpoint)

    def engine_tally(self, pool: str) -> EngineTally | None:
        """The pool's generation counters over time; None before a sample of the pool carried one."""
        return self._tallies.get(pool)

    def evaluate(self, pools: set[str] | None = None) -> None:
        """Re-aggregate and step the controllers of `pools` (all when None) at `clock()`."""
        now = self._clock()
        snaps = aggregate(self.subscriber.samples(), now, self._stale_after, self._kv_mode)
        self._snapshots = snaps
        targets = set(self._controllers) | set(snaps) if pools is None else pools
        for pool in targets:
            ctl = self._controller(pool, now)
            before = ctl.state
            snap = snaps.get(pool)
            if snap is not None and snap.no_live_endpoint:
                state = ctl.unreachable(now)
            elif snap is None or snap.stale:
                state = ctl.observe(None, 0.0 if snap is None else snap.requests_waiting, None, now)
            else:
                state = ctl.observe(snap.kv_usage, snap.requests_waiting, snap.newest_at, now)
            self._publish(pool, before, state)

    def tick(self) -> None:
        """What time alone moves, every `tick_interval`: endpoints not heard from are forgotten (and what
        was kept for them), and every pool is evaluated again (staleness, recovery)."""
        self.subscriber.prune(self._clock())
        self._forget_endpoints()
        self.served.prune(self._clock())
        self.evaluate()

    def engine_down_for(self, pool: str) -> float | None:
        """Seconds since the feed first showed every endpoint of `pool` refusing connections, where it has
        for at least the grace (`adaptive.ENGINE_DOWN_GRACE_S`); None while it is not down, or unknown."""
        state = self.state(pool)
        if state is None or not state.engine_down or state.down_since is None:
            return None
        return max(0.0, self._clock() - state.down_since)

    def engine_refused(self, pool: str) -> None:
        """An engine of `pool` refused an admitted request (its queue full): its scale drops at once
        (`AdaptiveController.refused`). Only a pool the loop knows (configured, or in the feed): a client's
        made-up model name grows no controller."""
        ctl = self._controllers.get(pool)
        if ctl is None:
            return
        before = ctl.state
        self._publish(pool, before, ctl.refused(self._clock()))

    # -- internals ---------------------------------------------------------------------------------------

    def _publish(self, pool: str, before: ControllerState, state: ControllerState) -> None:
        """A pool's new state to its metrics, and to `on_update` when it changed."""
        if self._metrics is not None:
            self._metrics.observe_state(
                pool, state, self.capacity_tokens(pool), self.decode_tokens_per_second(pool)
            )
        if not _same(before, state) and self._on_update is not None:
            try:
                self._on_update(pool, state)
            except Exception:
                log.exception("feedback on_update failed", extra={"pool": pool})

    def _stale_after(self, pool: str) -> float:
        return self._configs.get(pool, self._default).stale_after_seconds

    def _controller(self, pool: str, now: float) -> AdaptiveController:
        ctl = self._controllers.get(pool)
        if ctl is None:
            ctl = AdaptiveController(self._configs.get(pool, self._default), now=now)
            self._controllers[pool] = ctl
            if self._metrics is not None:  # at 0 from the start: rate() sees the first refusals
                self._metrics.engine_rejections.labels(pool)
            log.info("pool added", extra={"pool": pool})
        return ctl

    def _on_sample(self, sample: FeedSample) -> None:
        now = self._clock()
        read_at = self._read_times.read_at(_endpoint(sample.key), sample.sample_time, now, self._wall())
        if self._metrics is not None:
            self._metrics.sample_delay.observe(now - read_at)
        self.served.observe(sample, now)
        self.evaluate({sample.model})
        self._count_rejections(sample)
        self._tally(sample, read_at)
        self._count_prompted(sample)
        self._engines.observe(sample, now, read_at)
        snap = self._snapshots.get(sample.model)
        if self._on_fresh is None or snap is None or snap.stale or not sample.up:
            return
        try:
            self._on_fresh(sample.model, snap, self._clock())
            if self._on_engine is not None:
                self._on_engine(sample.model, sample.endpoint, self._clock())
        except Exception:
            log.exception("feedback on_sample failed", extra={"pool": sample.model})

    def _count_rejections(self, sample: FeedSample) -> None:
        """The growth of an endpoint's admission-rejection counter since its previous sample: its engine
        refused requests for want of queue room (any gateway's, this one's included), so the pool's scale
        drops as when this sidecar sees such a refusal itself. A first sample, or a counter that went back
        (a restarted server), only sets the base."""
        total = sample.admission_rejections_total
        if not sample.up or total is None:
            return
        before = self._rejections.get(sample.key)
        self._rejections[sample.key] = total
        if before is None or total <= before:
            return
        if self._metrics is not None:
            self._metrics.engine_rejections.labels(sample.model).inc(total - before)
        self.engine_refused(sample.model)

    def _tally(self, sample: FeedSample, read_at: float) -> None:
        """An endpoint's generation counter into its pool's tally at `read_at`, when its exporter read the
        page (`ReadTimes`), not when the sample arrived: on a saturated host samples came seconds after
        their reading, and a point stamped on arrival put a stream's tokens after its stop. A busy engine
        answers its metrics page late, then renders and sends it at once (measured on two loaded cores: the
        counter read at 0.93-0.99 of a 0.2-5.3 s scrape), so the exporter stamps the page's end, never the
        scrape's start. A failed scrape (`up` false) keeps the endpoint's counter as last read, so the growth
        over the gap counts at its next reading; a sample without the counter makes its next reading a new
        baseline."""
        tally = self._tallies.get(sample.model)
        if tally is None and generated_in(sample):
            tally = self._tallies[sample.model] = EngineTally()
        if tally is not None:
            read_generated(tally, _endpoint(sample.key), sample, read_at)

    def _count_prompted(self, sample: FeedSample) -> None:
        """An endpoint's prompt counter into its pool's sum; a sample without one, or a down one, makes its
        next reading a new baseline."""
        counter = self._prompted.get(sample.model)
        if counter is None and prompted_in(sample):
            counter = self._prompted[sample.model] = PoolCounter()
        if counter is not None:
            read_prompted(counter, _endpoint(sample.key), sample)

    def _forget_endpoints(self) -> None:
        """Rejection counters and tallied counters of endpoints the subscriber forgot: memory follows the
        fleet."""
        known = {stored.sample.key for stored in self.subscriber.samples()}
        for key in [k for k in self._rejections if k not in known]:
            del self._rejections[key]
        endpoints = {_endpoint(key) for key in known}
        forgotten = self._engines.keep({(key[2], key[1]) for key in known})
        if forgotten and self._on_forgotten is not None:
            self._on_forgotten(forgotten)
        self._read_times.keep(endpoints)
        for tally in self._tallies.values():
            tally.keep(endpoints)
        for counter in self._prompted.values():
            counter.keep(endpoints)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self._tick_interval)
            try:
                self.tick()
            except Exception:
                log.exception("feedback tick failed")


def _endpoint(key: SampleKey) -> str:
    """One endpoint as a tally knows it: its node and address (a model is a pool's own tally)."""
    return f"{key[0]} {key[1]}"
