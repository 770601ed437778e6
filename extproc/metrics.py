"""Prometheus metrics of the sidecar, all named `extproc_*` with the unit in the name.

Each `Metrics` owns its registry so that several sidecars (tests, benchmarks) can live in one process.
Label values are bounded: models not named in the config are reported as `other`, and per-key limit gauges
are exported only for configured keys, never for every tenant a client ever claimed; of tenants with limits
of their own, only the `MAX_TENANT_KEYS` busiest (a config may name 10^5 of them).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.core.limiter.limiter import SNAPSHOT_BUSIEST_KEYS, KeySnapshot
from extproc.core.ports import StoreHealth

DECISION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

MAX_TENANT_KEYS = SNAPSHOT_BUSIEST_KEYS
"""Tenant keys (`tenant:*`) with per-key gauges, the busiest (`_use`); other configured keys all have them."""
UNFINISHED_BASES = ("engine_count", "estimate")
"""What an answer not seen to its end is charged from (`extproc_unfinished_answers_total{basis}`)."""


class LabelledChildren:
    """Prometheus children by label values, looked up once per value set: `labels()` takes a lock and
    builds a key on every call, several times per request. Label values are bounded (configured models,
    classes, allow-listed tenants, fixed reasons), so the cache is too."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def __call__(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


def _use(snap: KeySnapshot) -> tuple[int, float]:
    """How busy a key is: leases held, then tokens short of a full bucket (recent use)."""
    capacity, available = snap.effective_tokens_per_minute, snap.tokens_available
    return snap.active, (capacity - available) if capacity is not None and available is not None else 0.0


def _bounded(snaps: Sequence[KeySnapshot]) -> Sequence[KeySnapshot]:
    """`snaps` with only the `MAX_TENANT_KEYS` busiest tenant keys (`_use`)."""
    tenants = [snap for snap in snaps if snap.key.startswith("tenant:")]
    if len(tenants) <= MAX_TENANT_KEYS:
        return snaps
    top = {snap.key for snap in heapq.nlargest(MAX_TENANT_KEYS, tenants, key=_use)}
    return [snap for snap in snaps if not snap.key.startswith("tenant:") or snap.key in top]


class _LimitCollector(Collector):
    """Reads the limiter's key state at scrape time, so the gauges can never drift from the truth."""

    def __init__(
        self, snapshot: Callable[[], Iterable[KeySnapshot]], exported: Callable[[], Collection[str]]
    ) -> None:
        self._snapshot = snapshot
        self._exported = exported

    def collect(self) -> Iterator[GaugeMetricFamily]:
        conc = GaugeMetricFamily(
            "extproc_limit_concurrency",
            "Effective concurrency limit per key (base limit times adaptive scale).",
            labels=["key"],
        )
        tpm = GaugeMetricFamily(
            "extproc_limit_tokens_per_minute",
            "Effective tokens-per-minute limit per key (base limit times adaptive scale).",
            labels=["key"],
        )
        active = GaugeMetricFamily(
            "extproc_key_active_requests", "Slots currently held per limited key.", labels=["key"]
        )
        avail = GaugeMetricFamily(
            "extproc_tokens_available", "Tokens in the key's bucket now (negative: debt).", labels=["key"]
        )
        scale = GaugeMetricFamily(
            "extproc_limit_scale_ratio", "Adaptive scale applied to the key's base limits.", labels=["key"]
        )
        exported = self._exported()
        snaps = _bounded([snap for snap in self._snapshot() if snap.key in exported])
        for snap in snaps:
            if snap.effective_concurrency is not None:
                conc.add_metric([snap.key], snap.effective_concurrency)
            if snap.effective_tokens_per_minute is not None:
                tpm.add_metric([snap.key], snap.effective_tokens_per_minute)
            if snap.tokens_available is not None:
                avail.add_metric([snap.key], snap.tokens_available)
            active.add_metric([snap.key], snap.active)
            scale.add_metric([snap.key], snap.scale)
        share_limit = GaugeMetricFamily(
            "extproc_share_limit_concurrency",
            "Effective slots of each share of a key: a class guarantee, or the burstable pool (_shared).",
            labels=["key", "share"],
        )
        share_active = GaugeMetricFamily(
            "extproc_share_active_requests", "Leases held in each share of a key.", labels=["key", "share"]
        )
        for snap in snaps:
            if len(snap.shares) < 2:
                continue
            for share in snap.shares:
                if share.effective_concurrency is not None:
                    share_limit.add_metric([snap.key, share.name], share.effective_concurrency)
                share_active.add_metric([snap.key, share.name], share.active)
        yield from (conc, tpm, active, avail, scale, share_limit, share_active)


class _StoreCollector(Collector):
    """Store health read at scrape time, exported from the first scrape so a healthy store shows zeros."""

    def __init__(self, health: Callable[[], StoreHealth]) -> None:
        self._health = health

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        health = self._health()
        yield GaugeMetricFamily(
            "extproc_store_available",
            "1 while the limiter store answers; 0 while the shared store fails (fallback or 503s).",
            value=1.0 if health.available else 0.0,
        )
        yield CounterMetricFamily(
            "extproc_store_fallback_acquires",
            "Admission attempts decided on this replica's local share because the shared store failed.",
            value=health.fallback_acquires,
        )
        yield GaugeMetricFamily(
            "extproc_store_fallback_leases",
            "Requests running on leases taken on this replica's local share while the shared store failed, "
            "not yet counted in it (each is adopted into it once it answers).",
            value=health.fallback_leases,
        )
        yield CounterMetricFamily(
            "extproc_store_lost_leases",
            "Leases found expired at renewal: the shared store was unreachable for longer than their TTL.",
            value=health.lost_leases,
        )
        yield CounterMetricFamily(
            "extproc_store_dropped_releases",
            "Settlements given up after their retries: the slot stays counted until the lease TTL.",
            value=health.dropped_releases,
        )
        yield CounterMetricFamily(
            "extproc_store_state_losses",
            "Times the shared store was found to have lost the limiter state (flushed, restarted empty, "
            "evicted); admissions waited while the replicas re-asserted their leases.",
            value=health.state_losses,
        )
        yield CounterMetricFamily(
            "extproc_store_restored_leases",
            "Leases this replica re-added to the shared store because it had lost them before expiry.",
            value=health.restored_leases,
        )
        eviction = GaugeMetricFamily(
            "extproc_store_eviction_check",
            "1 for the shared store's eviction verdict: safe (maxmemory-policy noeviction), evicting (the "
            "store refuses to admit through it) or unverified (CONFIG GET refused).",
            labels=["state"],
        )
        for state in ("safe", "evicting", "unverified"):
            eviction.add_metric([state], 1.0 if health.eviction == state else 0.0)
        yield eviction


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "extproc_requests",
            "Requests seen by the sidecar, by decision (admitted, rejected, shadow_rejected, passthrough), "
            "reason, model and priority class.",
            ["decision", "reason", "model", "class"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "extproc_tenant_requests",
            "Requests per tenant (allow-listed tenants; the rest are counted as `other`) and decision.",
            ["tenant", "decision"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "extproc_queue_depth", "Requests waiting for capacity, per class.", ["class"], registry=r
        )
        self.queue_wait_seconds = Histogram(
            "extproc_queue_wait_seconds",
            "Time spent waiting for capacity, by class and outcome (admitted, timeout, cancelled, full).",
            ["class", "outcome"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.streams_cut = Counter(
            "extproc_streams_cut",
            "In-flight streams reset because the pool's KV usage passed the class's cut watermark.",
            ["class"],
            registry=r,
        )
        self.slots_released_early = Counter(
            "extproc_slots_released_early",
            "Admitted requests whose concurrency slots went back before they ended, by model: the KV feed "
            "found the engine done with them while their clients still read the answer (a slow reader); "
            "their tokens settle when they end, as any request's.",
            ["model"],
            registry=r,
        )
        self.picked_engine_unread = Counter(
            "extproc_picked_engine_unread",
            "Requests whose endpoint picker named an engine (admission.inference_pool."
            "trust_destination_endpoint) that the KV feed has no fresh reading of, by model: booked on the "
            "pool's KV budget. Steadily above 0: the feed does not read the engines at the addresses the "
            "picker writes (a metrics port apart from the serving one, another form of the address).",
            ["model"],
            registry=r,
        )
        self.unfinished_answers = Counter(
            "extproc_unfinished_answers",
            "Requests that went upstream and ended before their answer was seen whole at the engine's own "
            "pace (a client gone before the first byte or mid-stream, a stream cut, an end report that never "
            "came), by model and what their completion was charged from: engine_count, the engines' "
            "generation counters in the KV feed over the request's time; estimate, the decode-rate estimate "
            "or what passed (no feed, or it did not read the engines in time).",
            ["model", "basis"],
            registry=r,
        )
        self.tokens_run_on = Counter(
            "extproc_tokens_run_on",
            "Completion tokens charged to answers not seen whole for steps their engines ran past the count "
            "(an abort missed or seen seconds late: the pool's running count above every replica's runs), "
            'by model; included in extproc_tokens_settled_total{kind="completion"}.',
            ["model"],
            registry=r,
        )
        self.end_reports = Counter(
            "extproc_end_reports",
            "Lean profile: access-log entries received, by result (matched: settled a waiting lease; "
            "relayed: handed to the replica holding its lease; unknown: its lease was settled already, or "
            "was issued before a restart; envoy_refusal: a refusal Envoy answered itself, counted in "
            "extproc_requests_total; ext_proc_failed: a request whose ext_proc exchange failed, its message "
            "timer fired, so Envoy never forwarded it: its lease, if admitted, is refunded in full).",
            ["result"],
            registry=r,
        )
        for result in ("matched", "relayed", "unknown", "envoy_refusal", "ext_proc_failed"):
            self.end_reports.labels(result)
        self.end_report_channel = Gauge(
            "extproc_end_report_channel_up",
            "Lean profile: 1 while Envoy's access-log end reports reach the sidecar, 0 once the channel is "
            "found lost (no access-log stream open, or 3 ended requests in a row without a report): "
            "leases are then released when their request ends, charged the engines' count where the feed has "
            "it, else the decode-rate estimate (extproc_unfinished_answers_total{basis}).",
            registry=r,
        )
        self.end_report_channel.set(1)
        self.end_report_channel_losses = Counter(
            "extproc_end_report_channel_losses",
            "Lean profile: times the end-report channel was found lost, by how (stream_closed, misses, "
            "never_connected: requests ended without reports and no access-log stream ever connected).",
            ["cause"],
            registry=r,
        )
        for cause in ("stream_closed", "misses", "never_connected"):
            self.end_report_channel_losses.labels(cause)
        self.active = Gauge("extproc_active_requests", "Admitted requests not yet settled.", registry=r)
        self.streams = Gauge("extproc_streams_active", "Open ext_proc gRPC streams.", registry=r)
        self.tokens_reserved = Counter(
            "extproc_tokens_reserved",
            "Tokens reserved at admission (prompt + completion).",
            ["model"],
            registry=r,
        )
        self.tokens_refunded = Counter(
            "extproc_tokens_refunded",
            "Reserved tokens given back at settlement (reservation minus actual).",
            ["model"],
            registry=r,
        )
        self.tokens_overrun = Counter(
            "extproc_tokens_overrun",
            "Tokens used beyond the reservation, charged as bucket debt.",
            ["model"],
            registry=r,
        )
        self.tokens_settled = Counter(
            "extproc_tokens_settled",
            "Tokens actually charged at settlement, by kind (prompt: as charged, cached tokens at "
            "admission.cached_prompt_token_weight; completion).",
            ["model", "kind"],
            registry=r,
        )
        self.tokens_cached_prompt = Counter(
            "extproc_tokens_cached_prompt",
            "Prompt tokens the engine reported served from its prefix cache (usage.prompt_tokens_details."
            "cached_tokens and each API's like field; vLLM needs --enable-prompt-tokens-details for chat and "
            "completions), counted whole whatever they cost.",
            ["model"],
            registry=r,
        )
        self.settlements = Counter(
            "extproc_settlements",
            "Leases settled, by how the response ended (completed, aborted, upstream_error, cut, expired: "
            "the lean profile's end report did not come within admission.end_report_wait_seconds; "
            "not_forwarded: a filter after the sidecar, such as an endpoint picker, answered it; "
            "engine_busy: the engine refused it, its queue full: nothing charged; engine_unreachable: the "
            "proxy could not connect to any engine, its response flags UF or UH: nothing charged).",
            ["outcome"],
            registry=r,
        )
        self.engine_refusals = Counter(
            "extproc_engine_refusals",
            "Admitted requests the engine itself refused for want of room, by model and reason (queue_full: "
            "a 503 from the engine, vLLM's --max-num-queued-reqs or --max-num-queued-tokens): refunded in "
            "full, and the pool's adaptive scale drops. Apart from engine failures (upstream_error).",
            ["model", "reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "extproc_decision_seconds",
            "Time from receiving the request body to the admission decision, tokenizing included, by "
            "outcome (admitted, refused): what admitted clients waited, apart from what refusals cost.",
            ["outcome"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        for outcome in ("admitted", "refused"):
            self.decision_seconds.labels(outcome)
        self.tokenize_seconds = Histogram(
            "extproc_tokenize_seconds",
            "Time spent counting prompt tokens per request (in a worker thread).",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.config_reloads = Counter(
            "extproc_config_reloads",
            "Config file changes by result (applied, refused: invalid, failed: apply raised, unreadable).",
            ["result"],
            registry=r,
        )
        self.scale_floor = Gauge(
            "extproc_adaptive_min_scale_ratio",
            "The adaptive scale's floor (adaptive.min_scale) of each pool with KV feedback.",
            ["pool"],
            registry=r,
        )
        self._floor_pools: set[str] = set()
        self.info = Gauge(
            "extproc_build_info", "Constant 1, labelled with the sidecar version.", ["version"], registry=r
        )

    def touch_model(self, model: str) -> None:
        """Export a model label's token and engine-refusal counters at 0 before its first request, so a
        query or an alert on `increase()` sees the first refund, overrun or refusal instead of a series
        that starts at 1."""
        for counter in (
            self.tokens_reserved,
            self.tokens_refunded,
            self.tokens_overrun,
            self.tokens_cached_prompt,
            self.slots_released_early,
            self.tokens_run_on,
        ):
            counter.labels(model)
        for kind in ("prompt", "completion"):
            self.tokens_settled.labels(model, kind)
        for basis in UNFINISHED_BASES:
            self.unfinished_answers.labels(model, basis)
        self.engine_refusals.labels(model, "queue_full")

    def set_scale_floors(self, floors: Mapping[str, float]) -> None:
        """Export exactly these pools' floors (a pool dropped from the config loses its series)."""
        for pool in self._floor_pools - floors.keys():
            self.scale_floor.remove(pool)
        for pool, floor in floors.items():
            self.scale_floor.labels(pool).set(floor)
        self._floor_pools = set(floors)

    def watch_limits(
        self, snapshot: Callable[[], Iterable[KeySnapshot]], exported: Callable[[], Collection[str]]
    ) -> None:
        """Export limit gauges at scrape time for the keys `exported()` names (one call per scrape)."""
        self.registry.register(_LimitCollector(snapshot, exported))

    def watch_store(self, health: Callable[[], StoreHealth]) -> None:
        """Export the store's health at scrape time (`extproc_store_*`)."""
        self.registry.register(_StoreCollector(health))
