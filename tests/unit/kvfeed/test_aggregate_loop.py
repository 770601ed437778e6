"""Aggregation, backoff, sample store and FeedbackLoop evaluation, all on an injected clock."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from extproc.core.engine.adaptive import AdaptiveConfig, ControllerState
from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.sample import FeedSample
from extproc.kvfeed.subscriber.aggregate import StoredSample, aggregate, spread_tokens
from extproc.kvfeed.subscriber.client import FeedSubscriber, backoff_delay
from extproc.kvfeed.subscriber.loop import FeedbackLoop
from extproc.kvfeed.subscriber.metrics import register_feedback_metrics
from extproc.kvfeed.subscriber.settings import SubscriberConfig


def s(
    endpoint: str,
    kv: float | None,
    waiting: float = 0,
    *,
    model: str = "m",
    up: bool = True,
    cap: int | None = 1000,
    t: float = 1.0,
    rejections: float | None = None,
    error: str = "",
) -> FeedSample:
    return FeedSample(
        "node",
        endpoint,
        model,
        ServerKind.VLLM,
        kv,
        waiting,
        1.0,
        0.0,
        cap,
        t,
        up,
        error=error,
        admission_rejections_total=rejections,
    )


REFUSED = "connect: ClientConnectorError: Cannot connect to host 127.0.0.1:8000 [Connection refused]"
"""A down sample's error when the engine's port refuses connections (extproc/kvfeed/scraper.py `_down`)."""


def gone(endpoint: str, t: float, error: str = REFUSED) -> FeedSample:
    """A down sample of `endpoint`, its scrape failed with `error`."""
    return s(endpoint, None, t=t, up=False, cap=None, error=error)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def five(_pool: str) -> float:
    return 5.0


def test_aggregate_max_sum_and_exclusions() -> None:
    stored = [
        StoredSample(s("a:1", 0.5, 2), 100.0),
        StoredSample(s("b:1", 0.9, 3), 99.0),
        StoredSample(s("c:1", None, 1, cap=None), 100.0),
        StoredSample(s("d:1", 0.99, 50, up=False), 100.0),  # down: excluded
        StoredSample(s("e:1", 0.99, 50), 90.0),  # too old: excluded
        StoredSample(s("x:1", 0.1, model="other"), 80.0),
    ]
    snaps = aggregate(stored, 100.0, five)
    m = snaps["m"]
    assert m.kv_usage == pytest.approx(0.9)
    assert m.requests_waiting == 6 and m.requests_running == 3
    assert m.kv_capacity_tokens == 2000
    assert (m.endpoints_fresh, m.endpoints_known, m.newest_at, m.stale) == (3, 5, 100.0, False)
    assert snaps["other"].stale and snaps["other"].kv_usage is None
    assert aggregate(stored, 100.0, five, "mean")["m"].kv_usage == pytest.approx(0.7)


def test_a_pool_of_engines_reads_as_full_as_its_fullest_for_the_budget() -> None:
    """Two 1,000-token engines at 0.9 and 0.3 (and one of 2,000 at 0.5): the sum in use, plus what the others
    would hold were they as full as the fullest (`spread_tokens`), in `max` mode only; one engine has none."""
    stored = [StoredSample(s("a:1", 0.9), 100.0), StoredSample(s("b:1", 0.3), 100.0)]
    m = aggregate(stored, 100.0, five)["m"]
    assert m.kv_used_tokens == pytest.approx(1200) and m.kv_spread_tokens == pytest.approx(600)
    assert aggregate(stored, 100.0, five, "mean")["m"].kv_spread_tokens == 0
    assert aggregate(stored[:1], 100.0, five)["m"].kv_spread_tokens == 0
    bigger = [*stored, StoredSample(s("c:1", 0.5, cap=2000), 100.0)]
    assert aggregate(bigger, 100.0, five)["m"].kv_spread_tokens == pytest.approx(600 + 0.4 * 2000)
    assert spread_tokens([]) == 0


def test_backoff_grows_caps_and_jitters() -> None:
    cfg = SubscriberConfig(exporters=("h:1",), backoff_initial=0.5, backoff_max=4.0, backoff_jitter=0.5)
    rng = random.Random(7)
    delays = [backoff_delay(i, cfg, rng) for i in range(8)]
    for i, d in enumerate(delays):
        base = min(4.0, 0.5 * 2**i)
        assert base * 0.5 <= d <= base
    assert len({round(d, 6) for d in delays[4:]}) > 1  # jittered at the cap


def test_subscriber_config_validation() -> None:
    with pytest.raises(ValueError, match="exporters"):
        SubscriberConfig()
    with pytest.raises(ValueError, match="host:port"):
        SubscriberConfig(exporters=("nohost",))
    with pytest.raises(ValueError, match="backoff_jitter"):
        SubscriberConfig(exporters=("h:1",), backoff_jitter=1.0)


def test_replayed_sample_does_not_refresh_freshness() -> None:
    clock = Clock()
    seen: list[FeedSample] = []
    sub = FeedSubscriber(SubscriberConfig(exporters=("h:1",)), clock=clock, on_sample=seen.append)
    sub.ingest(s("a:1", 0.5, t=10.0))
    clock.now = 200.0
    sub.ingest(s("a:1", 0.5, t=10.0))  # exporter replays its cache after a reconnect
    assert sub.samples()[0].received_at == 100.0
    sub.ingest(s("a:1", 0.6, t=11.0))
    assert sub.samples()[0].received_at == 200.0
    assert len(seen) == 2
    sub.prune(200.0 + 301.0)
    assert sub.samples() == []


def make_loop(clock: Clock, updates: list[tuple[str, ControllerState]]) -> FeedbackLoop:
    return FeedbackLoop(
        SubscriberConfig(exporters=("127.0.0.1:1",)),
        {"m": AdaptiveConfig(), "idle": AdaptiveConfig(stale_scale=0.5)},
        clock,
        lambda pool, state: updates.append((pool, state)),
        metrics=register_feedback_metrics(CollectorRegistry()),
    )


def test_loop_drops_at_once_recovers_and_goes_stale() -> None:
    clock = Clock()
    updates: list[tuple[str, ControllerState]] = []
    loop = make_loop(clock, updates)
    assert loop.states()["m"].stale and loop.states()["idle"].scale == 0.5
    loop.subscriber.ingest(s("a:1", 0.3, t=1.0))
    st = loop.states()["m"]
    assert not st.stale and st.target_scale == 1.0 and st.scale == pytest.approx(0.6)
    assert updates[-1][0] == "m"
    assert loop.capacity_tokens("m") == 1000

    clock.now += 4.0
    loop.subscriber.ingest(s("a:1", 0.3, t=2.0))
    assert loop.states()["m"].scale == pytest.approx(0.8)
    clock.now += 1.0
    loop.subscriber.ingest(s("a:1", 0.95, t=3.0))  # one noisy sample: drop at once
    assert loop.states()["m"].scale == pytest.approx(0.6)
    clock.now += 1.0
    loop.subscriber.ingest(s("a:1", 0.3, t=4.0))
    assert loop.states()["m"].scale == pytest.approx(0.65)

    n = len(updates)
    loop.evaluate()  # nothing changed at the same instant: no callback
    assert len(updates) == n

    clock.now += 5.5  # no samples: stale
    loop.evaluate()
    st = loop.states()["m"]
    assert st.stale and st.scale == pytest.approx(0.6)
    assert loop.capacity_tokens("m") is None
    assert updates[-1] == ("m", st)


def test_loop_learns_unconfigured_pools_from_the_feed() -> None:
    clock = Clock()
    updates: list[tuple[str, ControllerState]] = []
    loop = make_loop(clock, updates)
    loop.subscriber.ingest(s("a:1", 0.9, model="new-model"))
    assert "new-model" in loop.states()
    assert loop.state("new-model") is not None and loop.state("nope") is None


def test_loop_down_sample_makes_pool_stale() -> None:
    clock = Clock()
    loop = make_loop(clock, [])
    loop.subscriber.ingest(s("a:1", 0.1, t=1.0))
    clock.now += 1
    loop.subscriber.ingest(s("a:1", None, t=2.0, up=False))
    assert loop.states()["m"].stale


def test_on_update_exceptions_do_not_escape() -> None:
    clock = Clock()

    def boom(pool: str, state: ControllerState) -> None:
        raise RuntimeError("sidecar bug")

    loop = FeedbackLoop(SubscriberConfig(exporters=("h:1",)), {}, clock, boom)
    loop.subscriber.ingest(s("a:1", 0.1))
    assert "m" in loop.states()


def test_an_engine_refusal_drops_a_known_pools_scale_and_tells_on_update() -> None:
    clock = Clock()
    updates: list[tuple[str, ControllerState]] = []
    loop = make_loop(clock, updates)
    loop.subscriber.ingest(s("a:1", 0.3, t=1.0))
    clock.now += 10.0
    loop.subscriber.ingest(s("a:1", 0.3, t=2.0))
    assert loop.states()["m"].scale == pytest.approx(1.0)
    loop.engine_refused("m")
    assert loop.states()["m"].scale == pytest.approx(0.6)
    assert updates[-1] == ("m", loop.states()["m"])
    clock.now += 2.0
    loop.subscriber.ingest(s("a:1", 0.3, t=3.0))  # recovers at recovery_per_second (0.05/s)
    assert loop.states()["m"].scale == pytest.approx(0.7)
    n = len(updates)
    loop.engine_refused("a-name-no-engine-serves")  # grows no controller
    assert loop.state("a-name-no-engine-serves") is None and len(updates) == n


def test_an_engines_rejection_counter_growing_in_the_feed_drops_the_scale() -> None:
    """Refusals of any gateway's requests, seen in the feed: the first sample only sets the base, growth
    drops the scale and is counted, a counter that went back (a restarted server) sets a new base."""
    clock = Clock()
    updates: list[tuple[str, ControllerState]] = []
    loop = make_loop(clock, updates)
    grown = loop._metrics.engine_rejections if loop._metrics is not None else None
    assert grown is not None
    loop.subscriber.ingest(s("a:1", 0.3, t=1.0, rejections=40.0))
    clock.now += 10.0
    loop.subscriber.ingest(s("a:1", 0.3, t=2.0, rejections=40.0))
    assert loop.states()["m"].scale == pytest.approx(1.0)
    clock.now += 1.0
    loop.subscriber.ingest(s("a:1", 0.3, t=3.0, rejections=43.0))
    assert loop.states()["m"].scale == pytest.approx(0.6)
    assert grown.labels("m")._value.get() == 3.0
    clock.now += 8.0
    loop.subscriber.ingest(s("a:1", 0.3, t=4.0, rejections=0.0))  # restarted: no drop
    assert loop.states()["m"].scale == pytest.approx(1.0)
    assert grown.labels("m")._value.get() == 3.0


def test_a_pool_has_no_live_endpoint_only_when_every_endpoint_recently_refused_connections() -> None:
    both = [StoredSample(gone("a:1", 1.0), 100.0), StoredSample(gone("b:1", 1.0), 99.0)]
    m = aggregate(both, 100.0, five)["m"]
    assert m.no_live_endpoint and m.stale and (m.endpoints_unreachable, m.endpoints_known) == (2, 2)
    one_up = [*both[:1], StoredSample(s("b:1", 0.2), 100.0)]
    assert not aggregate(one_up, 100.0, five)["m"].no_live_endpoint
    # A scrape that timed out says nothing about whether the engine serves (a busy engine answers late).
    slow = [*both[:1], StoredSample(gone("b:1", 1.0, "timeout: no answer within 0.8s"), 100.0)]
    assert not aggregate(slow, 100.0, five)["m"].no_live_endpoint
    # An endpoint not heard from within the window (its exporter gone) may be serving: stale, not down.
    quiet = [*both[:1], StoredSample(gone("b:1", 1.0), 90.0)]
    snap = aggregate(quiet, 100.0, five)["m"]
    assert snap.stale and not snap.no_live_endpoint


def test_loop_holds_the_scale_while_the_engines_are_down_and_admits_again_on_the_first_up_sample() -> None:
    clock = Clock()
    updates: list[tuple[str, ControllerState]] = []
    loop = make_loop(clock, updates)
    registry = loop._metrics
    assert registry is not None
    loop.subscriber.ingest(s("a:1", 0.1, t=1.0))
    clock.now += 10.0  # recovered from the start's stale scale
    loop.subscriber.ingest(s("a:1", 0.1, t=2.0))
    assert loop.states()["m"].scale == 1.0

    clock.now += 1.0
    loop.subscriber.ingest(gone("a:1", 3.0))  # the engine's port refuses connections
    state = loop.states()["m"]
    assert (state.scale, state.stale, state.engine_down) == (1.0, False, False)
    assert loop.engine_down_for("m") is None  # within the grace: the proxy's own 503s meanwhile
    clock.now += 1.0
    loop.subscriber.ingest(gone("a:1", 4.0))
    assert loop.states()["m"].engine_down and loop.engine_down_for("m") == pytest.approx(1.0)
    assert registry.engine_down.labels("m")._value.get() == 1.0
    assert registry.stale.labels("m")._value.get() == 0.0  # not a stale feed
    for t in range(5, 25):  # long past stale_after_seconds, the exporter still reporting it down
        clock.now += 1.0
        loop.subscriber.ingest(gone("a:1", float(t)))
    assert loop.engine_down_for("m") == pytest.approx(21.0)
    assert loop.states()["m"].scale == 1.0  # no fall to the stale scale: nothing to recover from after

    clock.now += 0.5
    loop.subscriber.ingest(s("a:1", 0.0, t=25.0))  # the engine answers again
    state = loop.states()["m"]
    assert (state.engine_down, state.stale, state.scale) == (False, False, 1.0)
    assert loop.engine_down_for("m") is None
    assert registry.engine_down.labels("m")._value.get() == 0.0
    assert updates[-1] == ("m", state)
