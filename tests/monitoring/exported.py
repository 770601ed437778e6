"""Every series name the sidecar and the exporter can export, read from their real registries."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry

from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.kvfeed.exporter.metrics import ExporterMetrics
from extproc.metrics import Metrics

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
METRIC = re.compile(r"\b(extproc_[a-z0-9_]+)")
SCRAPE_SERIES = {"up"}  # written by Prometheus itself for every target


def exported_series() -> set[str]:
    """Sample names of every metric family: the sidecar's (feedback included) and the exporter's."""
    sidecar = Sidecar(config=parse_config({}), metrics=Metrics())
    exporter = CollectorRegistry()
    ExporterMetrics(exporter)
    names: set[str] = set()
    try:
        for registry in (sidecar.metrics.registry, exporter):
            for family in registry.collect():
                names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    finally:
        sidecar.executor.shutdown(wait=False)
    return names


def series_in(expr: str) -> set[str]:
    return set(METRIC.findall(expr))
