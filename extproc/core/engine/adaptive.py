"""Adaptive limit controller: turns KV-cache usage and queue depth of a model pool into a scale factor.

The sidecar multiplies its base limits (in-flight slots, token budgets) by `ControllerState.scale`. The
controller is pure: no I/O, no clock reads. Every call receives `now` (seconds, any monotonic origin) so
tests drive it with a fake clock and the sidecar decides which clock is authoritative.

Curve, per pool:

* KV term: 1.0 at or below `low_watermark`, `min_scale` at or above `high_watermark`, linear in between.
* Queue term: a second linear curve on the pool's summed waiting requests, 1.0 at or below `waiting_low`,
  `min_scale` at or above `waiting_high`. A backend queue means the engine is already out of KV or batch
  slots, even when its KV gauge lags (SGLang sets its gauges only every 40 decode steps).
* Target = min(KV term, queue term).

Hysteresis: a lower target applies at once (KV overflow costs preemptions, recomputation and latency for
every running request), a higher target is approached at most `recovery_per_second` per second, so one
noisy low reading cannot open the limits and a burst of N sidecars cannot all jump to full limits together.

Engine refusals: an engine that refuses an admitted request for want of room (vLLM's 503, its queue full)
has shown what the gauges may not yet: the pool is past its capacity. `refused(now)` drops the scale to
`min_scale` at once, as a queue at `waiting_high` would, and it recovers from there at `recovery_per_second`
like any other drop.

Staleness: with no sample newer than `stale_after_seconds` the controller cannot see the GPU, so it falls to
`stale_scale` (default `min_scale`, never full limits) and recovers gradually once samples return.

Engines down: a feed that keeps arriving and says every endpoint of the pool refuses connections is not a
stale feed and not KV pressure: the sidecar sees the pool's state exactly (nothing runs there). `unreachable`
holds the scale where it was (an engine that comes back has an empty cache: falling to `stale_scale` would
only keep the limits at 60 % for the eight seconds of recovery after it returns) and, once that has lasted
`ENGINE_DOWN_GRACE_S`, says so (`ControllerState.engine_down`, with `down_since`): admission then refuses the
pool's requests up front. The first up sample ends it at once (`observe`), the scale as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ENGINE_DOWN_GRACE_S = 1.0
"""How long every endpoint of a pool must have been seen refusing connections before the pool counts as
down (`AdaptiveController.unreachable`). One failed scrape can be a listener restarting; two in a row, a
scrape interval (1 s) apart, say the engine is gone. Meanwhile admitted requests get the proxy's own 503,
refunded and settled as `engine_unreachable`, so the grace costs the clients nothing they would have had."""


def never_down(_pool: str) -> float | None:
    """How long a pool has been down where nothing watches its engines (no KV feed): never."""
    return None


class AdaptiveConfigError(ValueError):
    """A bad `AdaptiveConfig` field: `key` names it and `reason` says why, so a config loader can put the
    problem under its own key path (`adaptive.pools.llama.min_scale`) without editing the message."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"adaptive.{key}: {reason}")
        self.key = key
        self.reason = reason


def watermarks_above(target_utilization: float) -> tuple[float, float]:
    """The default (low, high) watermarks beside a KV budget filling the cache to `target_utilization`:
    0.92 / 0.98, raised with a higher target, so the scale acts only on KV the budget cannot see (other
    traffic, an engine queue) instead of cutting limits on KV the budget still admits into (docs/feedback.md:
    below the target, a real vLLM showed the scale falling to 0.64 while the budget held the cache at 0.9)."""
    low = min(0.99, max(0.92, target_utilization))
    return low, min(1.0, max(0.98, low + 0.01))


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """Tuning of one pool's controller; validated on construction so bad config fails at startup."""

    low_watermark: float = 0.70
    high_watermark: float = 0.85
    min_scale: float = 0.60
    waiting_low: float = 2.0
    waiting_high: float = 10.0
    recovery_per_second: float = 0.05
    stale_after_seconds: float = 5.0
    stale_scale: float | None = None  # None means min_scale

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ValueError:
            return AdaptiveConfigError(key, why)

        for key in (
            "low_watermark",
            "high_watermark",
            "min_scale",
            "waiting_low",
            "waiting_high",
            "recovery_per_second",
            "stale_after_seconds",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise bad(key, f"must be a number, got {value!r}")
        if not 0.0 <= self.low_watermark < 1.0:
            raise bad("low_watermark", f"must be in [0, 1), got {self.low_watermark}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise bad("high_watermark", f"must be in (0, 1], got {self.high_watermark}")
        if self.low_watermark >= self.high_watermark:
            raise bad(
                "low_watermark",
                f"must be below high_watermark ({self.low_watermark} >= {self.high_watermark})",
            )
        if not 0.0 < self.min_scale <= 1.0:
            raise bad("min_scale", f"must be in (0, 1], got {self.min_scale}")
        if self.waiting_low < 0:
            raise bad("waiting_low", f"must be >= 0, got {self.waiting_low}")
        if self.waiting_high <= self.waiting_low:
            raise bad(
                "waiting_high",
                f"must be above waiting_low ({self.waiting_high} <= {self.waiting_low})",
            )
        if not (self.recovery_per_second > 0 and math.isfinite(self.recovery_per_second)):
            raise bad(
                "recovery_per_second", f"must be a positive finite number, got {self.recovery_per_second}"
            )
        if not (self.stale_after_seconds > 0 and math.isfinite(self.stale_after_seconds)):
            raise bad(
                "stale_after_seconds", f"must be a positive finite number, got {self.stale_after_seconds}"
            )
        if self.stale_scale is not None and (
            isinstance(self.stale_scale, bool)
            or not isinstance(self.stale_scale, (int, float))
            or not 0.0 < self.stale_scale <= 1.0
        ):
            raise bad("stale_scale", f"must be in (0, 1], got {self.stale_scale!r}")

    @property
    def effective_stale_scale(self) -> float:
        """Scale used while blind; defaults to the minimum so a dead feed never means full limits."""
        return self.min_scale if self.stale_scale is None else float(self.stale_scale)

    @property
    def floor(self) -> float:
        """Lowest scale the controller can ever output."""
        return min(self.min_scale, self.effective_stale_scale)


@dataclass(frozen=True, slots=True)
class ControllerState:
    """Inputs and output of one controller evaluation, immutable so it can be handed to other tasks.

    `kv_usage` is None when the pool reports no KV gauge (the KV term is then 1.0); `waiting` is the pool's
    summed backend queue; `target_scale` is what the curve asks for, `scale` what the limits should use
    after hysteresis; `stale` says the inputs are too old to trust; `updated_at` is the `now` of the call.
    `engine_down` says the feed has shown every endpoint of the pool refusing connections for at least
    `ENGINE_DOWN_GRACE_S`, since `down_since` (the first such reading; None while any endpoint is seen up).
    """

    kv_usage: float | None
    waiting: float
    target_scale: float
    scale: float
    stale: bool
    updated_at: float
    engine_down: bool = False
    down_since: float | None = None


def _linear_down(value: float, low: float, high: float, floor: float) -> float:
    """1.0 at or below `low`, `floor` at or above `high`, straight line in between."""
    if value <= low:
        return 1.0
    if value >= high:
        return floor
    return 1.0 - (1.0 - floor) * (value - low) / (high - low)


def _clean_ratio(value: float | None) -> float | None:
    """Bad gauges (NaN, inf, negative, > 1) are clamped or ignored instead of crashing the controller."""
    if value is None or math.isnan(value):
        return None
    return min(1.0, max(0.0, value))


def _clean_count(value: float) -> float:
    if math.isnan(value) or value < 0:
        return 0.0
    return value


@dataclass(slots=True)
class AdaptiveController:
    """Scale factor for one pool. Call `observe` with each aggregated reading and `tick` periodically.

    Starts stale at `stale_scale`: before the first sample the controller knows nothing about the GPUs.
    """

    config: AdaptiveConfig
    now: float
    _kv_usage: float | None = field(default=None, init=False)
    _waiting: float = field(default=0.0, init=False)
    _newest_sample_at: float | None = field(default=None, init=False)
    _down_since: float | None = field(default=None, init=False)
    _state: ControllerState = field(init=False)

    def __post_init__(self) -> None:
        stale_scale = self.config.effective_stale_scale
        self._state = ControllerState(
            kv_usage=None,
            waiting=0.0,
            target_scale=stale_scale,
            scale=stale_scale,
            stale=True,
            updated_at=self.now,
        )

    @property
    def state(self) -> ControllerState:
        """The last evaluation."""
        return self._state

    def target_for(self, kv_usage: float | None, waiting: float) -> float:
        """The curve alone (no hysteresis): min of the KV term and the queue term."""
        cfg = self.config
        kv = _clean_ratio(kv_usage)
        kv_term = (
            1.0 if kv is None else _linear_down(kv, cfg.low_watermark, cfg.high_watermark, cfg.min_scale)
        )
        queue_term = _linear_down(_clean_count(waiting), cfg.waiting_low, cfg.waiting_high, cfg.min_scale)
        return min(kv_term, queue_term)

    def observe(
        self, kv_usage: float | None, waiting: float, newest_sample_at: float | None, now: float
    ) -> ControllerState:
        """Feed the pool's aggregate (`newest_sample_at` = when the freshest contributing sample arrived,
        None when the pool has no fresh sample) and re-evaluate. Ends an outage (`unreachable`)."""
        self._down_since = None
        self._kv_usage = _clean_ratio(kv_usage)
        self._waiting = _clean_count(waiting)
        if newest_sample_at is not None and (
            self._newest_sample_at is None or newest_sample_at > self._newest_sample_at
        ):
            self._newest_sample_at = newest_sample_at
        elif newest_sample_at is None:
            self._newest_sample_at = None
        return self.tick(now)

    def unreachable(self, now: float) -> ControllerState:
        """The feed, fresh, shows every endpoint of the pool refusing connections: not KV pressure and not a
        blind sidecar, so the scale holds where it was (its time moves on, so recovery after the outage runs
        from the return, not from before it), and once this has lasted `ENGINE_DOWN_GRACE_S` the state says
        the pool is down. The next `observe` (an endpoint up, or the feed gone stale) ends it."""
        prev = self._state
        if self._down_since is None:
            self._down_since = now
        down = now - self._down_since >= ENGINE_DOWN_GRACE_S
        self._kv_usage, self._waiting = None, 0.0
        self._state = ControllerState(
            kv_usage=None,
            waiting=0.0,
            target_scale=prev.scale,
            scale=prev.scale,
            stale=False,
            updated_at=max(now, prev.updated_at),
            engine_down=down,
            down_since=self._down_since,
        )
        return self._state

    def refused(self, now: float) -> ControllerState:
        """The engine refused a request for want of room: the scale falls to `min_scale` now (the target too,
        for this instant), then recovers as usual from the next `tick`."""
        prev = self._state
        floor = self.config.min_scale
        self._state = ControllerState(
            kv_usage=prev.kv_usage,
            waiting=prev.waiting,
            target_scale=min(prev.target_scale, floor),
            scale=min(prev.scale, floor),
            stale=prev.stale,
            updated_at=max(now, prev.updated_at),
            engine_down=prev.engine_down,
            down_since=prev.down_since,
        )
        return self._state

    def tick(self, now: float) -> ControllerState:
        """Re-evaluate with the last inputs: detects staleness and advances gradual recovery."""
        cfg = self.config
        prev = self._state
        stale = self._newest_sample_at is None or now - self._newest_sample_at > cfg.stale_after_seconds
        target = cfg.effective_stale_scale if stale else self.target_for(self._kv_usage, self._waiting)
        if target <= prev.scale:
            scale = target
        else:
            elapsed = max(0.0, now - prev.updated_at)
            scale = min(target, prev.scale + cfg.recovery_per_second * elapsed)
        # Guard the invariant against float drift.
        scale = min(1.0, max(cfg.floor, scale))
        self._state = ControllerState(
            kv_usage=self._kv_usage,
            waiting=self._waiting,
            target_scale=target,
            scale=scale,
            stale=stale,
            updated_at=max(now, prev.updated_at),
        )
        return self._state
