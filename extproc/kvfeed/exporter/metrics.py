"""The exporter's own Prometheus metrics (`extproc_exporter_*`), created in a caller-given registry."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.kvfeed.sample import FeedSample


class ExporterMetrics:
    """Scrape health of the node's inference servers and the feed's fan-out."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.scrape_duration = Histogram(
            "extproc_exporter_scrape_duration_seconds",
            "Time to fetch and parse one target's metrics page.",
            ["target"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.scrape_errors = Counter(
            "extproc_exporter_scrape_errors_total",
            "Failed scrapes by target and reason "
            "(timeout, connect, http_status, incomplete, too_large, parse, no_model, invalid).",
            ["target", "reason"],
            registry=registry,
        )
        self.page_bytes = Gauge(
            "extproc_exporter_page_bytes",
            "Size of the target's last metrics page in bytes, as far as it was read (pages are read up to "
            "8 MiB; a larger one fails with reason too_large).",
            ["target"],
            registry=registry,
        )
        self.targets = Gauge("extproc_exporter_targets", "Targets currently known.", registry=registry)
        self.targets_up = Gauge(
            "extproc_exporter_targets_up", "Targets whose last scrape succeeded.", registry=registry
        )
        self.subscribers = Gauge(
            "extproc_exporter_subscribers", "Open KvFeed.Watch streams.", registry=registry
        )
        self.samples_published = Counter(
            "extproc_exporter_samples_published_total", "Samples handed to the feed.", registry=registry
        )
        self.discovery_errors = Counter(
            "extproc_exporter_discovery_errors_total",
            "Failed Kubernetes pod listings (the last good target list is kept).",
            registry=registry,
        )

        self.kv_usage = Gauge(
            "extproc_exporter_kv_usage_ratio",
            "KV-cache usage (0..1) of each model on each server of this node, as last scraped; absent while "
            "the server is down.",
            ["node", "endpoint", "model"],
            registry=registry,
        )

        self._error_labels: set[tuple[str, str]] = set()
        self._duration_labels: set[str] = set()
        self._usage_labels: set[tuple[str, str, str]] = set()

    def observe_scrape(self, target: str, seconds: float, reason: str | None, page_bytes: int = 0) -> None:
        self.scrape_duration.labels(target).observe(seconds)
        self.page_bytes.labels(target).set(page_bytes)
        self._duration_labels.add(target)
        if reason is not None:
            self.scrape_errors.labels(target, reason).inc()
            self._error_labels.add((target, reason))

    def observe_samples(self, samples: Iterable[FeedSample]) -> None:
        """Per-server KV usage: the breakdown of the pool aggregate the sidecar exports."""
        for sample in samples:
            labels = sample.key
            if sample.up and sample.kv_usage is not None:
                self.kv_usage.labels(*labels).set(sample.kv_usage)
                self._usage_labels.add(labels)
            elif labels in self._usage_labels:
                self._usage_labels.discard(labels)
                self.kv_usage.remove(*labels)

    def forget_target(self, target: str) -> None:
        """Remove a departed target's series so label cardinality follows the live pods."""
        for usage in [lab for lab in self._usage_labels if lab[1] == target]:
            self._usage_labels.discard(usage)
            self.kv_usage.remove(*usage)
        if target in self._duration_labels:
            self._duration_labels.discard(target)
            self.scrape_duration.remove(target)
            self.page_bytes.remove(target)
        for labels in [lab for lab in self._error_labels if lab[0] == target]:
            self._error_labels.discard(labels)
            self.scrape_errors.remove(*labels)
